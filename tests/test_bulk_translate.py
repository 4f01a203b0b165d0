"""`jaxformer translate --input FILES --output OUT`: a corpus translated
into one file by every process of a run (jaxformer/inference/bulk.py), the
same bytes whatever the number of processes and devices, resumed after a
killed process, stopped cleanly by SIGTERM, on local files and gs://.

The runs of several processes go through launch/local.sh (or are started
as it starts them, to signal one of them) on a tiny quick-start model that
translates badly but at varied lengths, greedily."""
import argparse
import gzip
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import cpu_devices
import pytest

from jaxformer.cli import main as cli
from jaxformer.cli import model_commands
from jaxformer.data import builtin
from jaxformer.inference import bulk, provenance, translator
from jaxformer.inference.chunks import Parts, Plan, length_batches, chunk_name
from jaxformer.storage import paths

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCAL_SH = REPO / 'launch' / 'local.sh'
LINES = 3000
# 64-line chunks: 47 of them, shared out among the processes.
SETTINGS = ['--beam', '1', '--batch-size', '16', '--chunk-batches', '4']
TIMEOUT = 900  # seconds; generous for a loaded 2-core machine


@pytest.fixture(scope='module')
def workdir(quickstart_workdir):
  """The quick start of 60 steps that the modules share: it does not
  translate yet, but its outputs differ from line to line and stop at
  different lengths."""
  return quickstart_workdir


@pytest.fixture(scope='module')
def corpus(tmp_path_factory) -> pathlib.Path:
  """3,000 sentences, every 300th line empty."""
  sentences = [source for source, _ in builtin.generate(LINES, 7, 'test')]
  for i in range(0, LINES, 300):
    sentences[i] = ''
  path = tmp_path_factory.mktemp('corpus') / 'corpus.txt'
  path.write_text(''.join(s + '\n' for s in sentences))
  return path


@pytest.fixture(scope='module')
def environment(process_environment) -> dict:
  """The processes' environment (trained_runs.process_environment: the
  compilation cache that the test run's processes share), with this
  checkout."""
  return dict(process_environment, PYTHONPATH=str(REPO))


def translate_command(workdir, source, out, *extra) -> list[str]:
  return [sys.executable, '-m', 'jaxformer', 'translate', '--workdir',
          str(workdir), '--input', str(source), '--output', str(out),
          *SETTINGS, *extra]


def launch(environment, processes: int, devices: int, command) -> str:
  """`command` as `processes` x `devices` through launch/local.sh; asserts
  that it succeeds; returns its stderr."""
  result = subprocess.run(
      [str(LOCAL_SH), '--processes', str(processes), '--devices',
       str(devices), '--', *command], env=environment, capture_output=True,
      text=True, timeout=TIMEOUT)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  return result.stderr


@pytest.fixture(scope='module')
def reference(workdir, corpus, environment, tmp_path_factory) -> bytes:
  """The corpus translated by one process of one device."""
  out = tmp_path_factory.mktemp('reference') / 'out.txt'
  errors = launch(environment, 1, 1, translate_command(workdir, corpus, out))
  assert f'3,000/3,000 lines (100%)' in errors and f'wrote {out}' in errors
  translations = out.read_text().split('\n')
  assert len(translations) == LINES + 1 and translations[-1] == ''
  assert all(translations[i] == '' for i in range(0, LINES, 300))
  assert len(set(translations)) > 100  # Not one answer for all.
  return out.read_bytes()


# --------------------------------------------------- the same file, any layout


@pytest.mark.slow
# One process of two devices, two of one, four of two: each shares the
# chunks out differently from the reference's one process of one device.
@pytest.mark.parametrize('processes, devices', [(1, 2), (2, 1), (4, 2)])
def test_every_layout_writes_the_same_file(workdir, corpus, environment,
                                           reference, tmp_path, processes,
                                           devices):
  out = tmp_path / 'out.txt'
  errors = launch(environment, processes, devices,
                  translate_command(workdir, corpus, out))
  assert f'({processes} process' in errors
  assert out.read_bytes() == reference
  assert not (tmp_path / 'out.txt.parts').exists()


# -------------------------------------------------- stopped and started again


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_two(environment, command) -> list[subprocess.Popen]:
  """`command` as 2 processes of 1 device, started as launch/local.sh
  starts them, so that one can be signalled."""
  port = free_port()
  return [subprocess.Popen(command, env=dict(
      environment, JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
      JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(index), JAX_PLATFORMS='cpu',
      XLA_FLAGS=cpu_devices.xla_flags(1)),
      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
      for index in range(2)]


def committed(parts: pathlib.Path) -> set[str]:
  return {p.name for p in parts.glob('chunk-*.txt')}


def wait_for_chunk_of_process_1(parts: pathlib.Path, processes) -> None:
  """Until process 1 (the odd chunks) has committed a chunk: it has 22
  more to decode."""
  deadline = time.monotonic() + TIMEOUT
  while not {chunk_name(c) for c in range(1, 47, 2)} & committed(parts):
    for process in processes:
      assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.02)


@pytest.mark.slow
def test_a_killed_process_and_a_restart_write_the_same_file(
    workdir, corpus, environment, reference, tmp_path):
  out, parts = tmp_path / 'out.txt', tmp_path / 'out.txt.parts'
  command = translate_command(workdir, corpus, out,
                              '--config.distributed.heartbeat_timeout=10')
  processes = start_two(environment, command)
  wait_for_chunk_of_process_1(parts, processes)
  processes[1].kill()
  # The runtime ends process 0 once process 1's heartbeats stop.
  _, errors = processes[0].communicate(timeout=TIMEOUT)
  assert processes[0].returncode != 0, errors[-3000:]
  processes[1].communicate(timeout=TIMEOUT)
  done = committed(parts)
  assert not out.exists() and 0 < len(done) < 47
  errors = launch(environment, 2, 1, command)
  assert out.read_bytes() == reference
  assert not parts.exists()


@pytest.mark.slow
def test_sigterm_commits_what_is_done_and_exits_0(workdir, corpus, environment,
                                                  reference, tmp_path):
  """SIGTERM to one process stops both: each commits what it finished (a
  chunk, or the batches of one) and exits 0; the same command finishes."""
  out, parts = tmp_path / 'out.txt', tmp_path / 'out.txt.parts'
  command = translate_command(workdir, corpus, out)
  processes = start_two(environment, command)
  wait_for_chunk_of_process_1(parts, processes)
  seen = committed(parts)
  processes[1].send_signal(signal.SIGTERM)
  errors = [p.communicate(timeout=TIMEOUT)[1] for p in processes]
  assert [p.returncode for p in processes] == [0, 0], errors
  assert 'translate: stopped (process 1 was stopped)' in errors[0]
  assert 'run the same command again to finish' in errors[0]
  assert not out.exists() and seen <= committed(parts)
  assert len(committed(parts)) < 47
  launch(environment, 2, 1, command)
  assert out.read_bytes() == reference


# ----------------------------------------------- one process, small corpora


def run(capfd, *args) -> tuple[int, str]:
  """`jaxformer translate ARGS` in this process: (status, stderr)."""
  status = cli.main(['translate', *args])
  return status, capfd.readouterr().err


@pytest.mark.slow
def test_empty_overlong_and_undecodable_lines(workdir, tmp_path, capfd):
  source, out = tmp_path / 'in.txt', tmp_path / 'out.txt'
  lines = ['he sold three old cups .', '', ' '.join(['seven hundred'] * 40),
           '   ', 'we bought nine red apples .']
  source.write_text('\n'.join(lines) + '\n')
  flags = ['--workdir', workdir, '--input', str(source), '--output',
           str(out), '--beam', '1', '--batch-size', '4', '--chunk-batches',
           '1']
  status, errors = run(capfd, *flags)
  assert status == 0, errors
  assert 'line 3 is longer than 40 tokens and was truncated' in errors
  translations = out.read_text().split('\n')
  assert len(translations) == 6 and translations[-1] == ''
  assert [t == '' for t in translations[:5]] == [False, True, False, True,
                                                 False]
  status, errors = run(capfd, *flags, '--on-too-long', 'error')
  assert status == 1 and 'Line 3 has' in errors
  assert 'more than the model maximum 40' in errors
  assert run(capfd, *flags)[0] == 0  # Its manifest alone is replaced.

  latin1 = tmp_path / 'latin1.txt'
  latin1.write_bytes('he sold three old cups .\nwe bought caf\xe9 .\n'
                     .encode('latin-1'))
  flags[3], flags[5] = str(latin1), str(tmp_path / 'latin1_out.txt')
  status, errors = run(capfd, *flags)
  assert status == 1 and f'{latin1}:2: invalid UTF-8' in errors
  assert '--invalid-utf8=replace' in errors
  assert not list(tmp_path.glob('latin1_out*'))  # Nothing started.
  status, errors = run(capfd, *flags, '--invalid-utf8', 'replace')
  assert status == 0, errors
  assert len((tmp_path / 'latin1_out.txt').read_text().splitlines()) == 2


@pytest.mark.slow
def test_output_needs_an_input_file(workdir, tmp_path, capfd):
  status, errors = run(capfd, '--workdir', workdir, '--output',
                       str(tmp_path / 'out.txt'))
  assert status == 1 and '--output needs --input FILE_OR_GLOB' in errors
  status, errors = run(capfd, '--workdir', workdir, '--input',
                       str(tmp_path / 'none-*.txt'), '--output',
                       str(tmp_path / 'out.txt'))
  assert status == 1 and 'none-*.txt: no such file' in errors


def small_corpus(corpus: pathlib.Path, lines: int) -> list[str]:
  return corpus.read_text().splitlines()[:lines]


@pytest.mark.slow
def test_a_glob_of_plain_and_gz_files_and_gz_output(workdir, corpus, tmp_path,
                                                    capfd):
  """The files of a glob are one input, in name order; OUT.gz is
  compressed without a time stamp."""
  sentences = small_corpus(corpus, 100)
  whole = tmp_path / 'whole.txt'
  whole.write_text(''.join(s + '\n' for s in sentences))
  (tmp_path / 'part-1.txt').write_text(''.join(s + '\n' for s in sentences[:30]))
  with gzip.open(tmp_path / 'part-2.txt.gz', 'wt') as f:
    f.write(''.join(s + '\n' for s in sentences[30:]))
  flags = ['--workdir', workdir, '--beam', '1', '--batch-size', '16',
           '--chunk-batches', '1']
  assert run(capfd, *flags, '--input', str(whole), '--output',
             str(tmp_path / 'whole.out'))[0] == 0
  for name in ('glob.out.gz', 'again.out.gz'):
    assert run(capfd, *flags, '--input', str(tmp_path / 'part-*'),
               '--output', str(tmp_path / name))[0] == 0
  assert (gzip.decompress((tmp_path / 'glob.out.gz').read_bytes())
          == (tmp_path / 'whole.out').read_bytes())
  assert ((tmp_path / 'glob.out.gz').read_bytes()
          == (tmp_path / 'again.out.gz').read_bytes())


@pytest.mark.slow
def test_gs_input_and_output(workdir, corpus, tmp_path, capfd, gcs_emulator):
  sentences = small_corpus(corpus, 100)
  text = ''.join(s + '\n' for s in sentences)
  local = tmp_path / 'in.txt'
  local.write_text(text)
  paths.write_bytes('gs://test-bucket/bulk/in.txt.gz',
                    gzip.compress(text.encode()))
  flags = ['--workdir', workdir, '--beam', '1', '--batch-size', '16',
           '--chunk-batches', '1']
  assert run(capfd, *flags, '--input', str(local), '--output',
             str(tmp_path / 'out.txt'))[0] == 0
  status, errors = run(capfd, *flags, '--input',
                       'gs://test-bucket/bulk/in.txt.gz', '--output',
                       'gs://test-bucket/bulk/out.txt')
  assert status == 0, errors
  assert 'wrote gs://test-bucket/bulk/out.txt' in errors
  assert (paths.read_bytes('gs://test-bucket/bulk/out.txt')
          == (tmp_path / 'out.txt').read_bytes())
  assert paths.list_dir('gs://test-bucket/bulk') == ['in.txt.gz', 'out.txt']
  assert not list(pathlib.Path.cwd().rglob('gs:'))


# ------------------------------------------------------ the parts, directly


def load(workdir):
  return model_commands.load_translator(argparse.Namespace(
      workdir=workdir, checkpoint=None, command='translate'), [])


def settings(**changes) -> translator.TranslateSettings:
  values = dict(batch_size=8, chunk_batches=2, beam_size=1, alpha=0.6,
                max_extra_len=16, max_source_length=40)
  return translator.TranslateSettings(**dict(values, **changes))


def translate_corpus(model, files, out, settings, stop):
  return bulk.decode_corpus(translator.Translation([model], settings),
                            files, out, {}, stop)


@pytest.mark.slow
def test_a_stopped_chunk_keeps_its_finished_batches(workdir, corpus,
                                                    tmp_path, capfd):
  """A chunk stopped part way keeps the batches it finished; the run that
  finishes it decodes only the others."""
  model = load(workdir)
  source, out = tmp_path / 'in.txt', str(tmp_path / 'out.txt')
  source.write_text(''.join(s + '\n' for s in small_corpus(corpus, 20)))
  reference = str(tmp_path / 'reference.txt')
  assert translate_corpus(model, [str(source)], reference, settings(),
                          bulk.Stop())[0] == 'done'
  # As a stop after the first batch of chunk 0 leaves it.
  plan = Plan(20, 8, 2)
  digests = provenance.chunk_digests(source.read_text().splitlines(), 16)[1]
  parts = Parts(out, plan, vars(settings()), digests)
  parts.check_manifest(dict(vars(settings()), inputs=[str(source)], lines=20))
  first = length_batches(source.read_text().splitlines()[:16], 8)[0]
  assert not parts.commit(0, [first, []], {0: ['kept'] * 8})
  assert sorted(os.listdir(parts.directory)) == [
      'chunk-00000000.partial.json', 'manifest.json']
  status, progress = translate_corpus(model, [str(source)], out,
                                      settings(), bulk.Stop())
  assert status == 'done' and progress.startswith('20/20 lines (100%)')
  expected = open(reference).read().split('\n')
  for i in first:
    expected[i] = 'kept'
  assert open(out).read().split('\n') == expected
  assert not os.path.exists(parts.directory)


@pytest.mark.slow
def test_parts_of_another_translation_are_not_mixed_in(workdir, corpus,
                                                       tmp_path):
  model = load(workdir)
  source, out = tmp_path / 'in.txt', str(tmp_path / 'out.txt')
  source.write_text(''.join(s + '\n' for s in small_corpus(corpus, 20)))
  stopped = bulk.Stop()
  stopped.request('SIGTERM')  # Before anything is decoded.
  assert translate_corpus(model, [str(source)], out, settings(),
                          stopped)[0] == 'stopped'
  assert os.listdir(out + '.parts') == ['manifest.json']
  # A manifest alone gives way to other settings; one with chunks does not.
  assert translate_corpus(model, [str(source)], out,
                          settings(batch_size=4), stopped)[0] == 'stopped'
  digests = provenance.chunk_digests(source.read_text().splitlines(), 8)[1]
  assert Parts(out, Plan(20, 4, 2), vars(settings(batch_size=4)),
               digests).commit(
      0, [[0, 1, 2, 3], [4, 5, 6, 7]], {0: ['a'] * 4, 1: ['b'] * 4})
  with pytest.raises(ValueError, match=r'out.txt.parts holds the parts of '
                     r'another run \(batch_size: 4 then, 8 now\); '
                     'run that command again to finish it, or remove'):
    translate_corpus(model, [str(source)], out, settings(), bulk.Stop())


def test_chunks_are_cut_from_the_input_alone():
  plan = Plan(lines=100, batch_size=8, chunk_batches=4)
  assert plan.chunks == 4 and plan.lines_of(3) == range(96, 100)
  assert plan.batch_sizes(0) == [8] * 4 and plan.batch_sizes(3) == [4]
  assert plan.owned(1, 3) == [1] and plan.owned(0, 3) == [0, 3]
  lines = ['ccc', 'a', '', 'bb', 'a', 'dddd']
  assert length_batches(lines, 4) == [[2, 1, 4, 3], [0, 5]]
  chunks = list(bulk.chunks_of(iter(str(i) for i in range(100)), plan, [1, 3]))
  assert [c for c, _ in chunks] == [1, 3]
  assert chunks[0][1] == [str(i) for i in range(32, 64)]
  assert chunks[1][1] == ['96', '97', '98', '99']
