"""`jaxformer generate --input FILES --output OUT`: continuations of a file
of prompts written by every process of a run, by the chunk engine of
`translate --output` (jaxformer/inference/bulk.py; its own tests are
test_bulk_translate.py): sampled, the same bytes whatever the number of
processes, a prompt's samples those `generate --input` prints, resumed
after a killed process, stopped cleanly by SIGTERM, on gs://.

The model is test_generate.py's random language model (an export), which
continues prompts with random-looking tokens."""
import gzip
import json
import pathlib
import signal
import sys
import time

import pytest

from test_bulk_translate import (TIMEOUT, committed, environment, launch,
                                 start_two)

from jaxformer.cli import main as cli
from jaxformer.data import builtin
from jaxformer.inference.chunks import chunk_name
from jaxformer.storage import paths

__all__ = ['environment']  # A fixture shared with those tests.

LINES = 600
# 16-line chunks: 38 of them, shared out among the processes.
SETTINGS = ['--batch-size', '8', '--seed', '3', '--max-new-tokens', '6',
            '--jsonl']


@pytest.fixture(scope='module')
def prompts(tmp_path_factory) -> pathlib.Path:
  """600 prompts of 0 to 7 words, every 8th line empty."""
  sentences = [source for source, _ in builtin.generate(LINES, 11, 'test')]
  lines = [' '.join(s.split()[:i % 8]) for i, s in enumerate(sentences)]
  path = tmp_path_factory.mktemp('prompts') / 'prompts.txt'
  path.write_text(''.join(line + '\n' for line in lines))
  return path


def generate_command(export, source, out, *extra, chunk_batches=2
                     ) -> list[str]:
  return ['generate', '--workdir', export, '--input', str(source),
          '--output', str(out), '--chunk-batches', str(chunk_batches),
          *SETTINGS, *extra]


def run(capfd, *args) -> tuple[int, str, str]:
  """`jaxformer ARGS` in this process: (status, stdout, stderr)."""
  capfd.readouterr()
  status = cli.main(list(args))
  out, errors = capfd.readouterr()
  return status, out, errors


@pytest.fixture(scope='module')
def reference(lm_export, prompts, tmp_path_factory) -> bytes:
  """The prompts continued by this process."""
  out = tmp_path_factory.mktemp('reference') / 'out.jsonl'
  assert cli.main(generate_command(lm_export[0], prompts, out)) == 0
  return out.read_bytes()


@pytest.mark.slow
def test_one_record_per_prompt_as_generate_prints_them(
    lm_export, prompts, reference, tmp_path, capfd):
  """The file holds, line by line, what `generate --input` prints: the
  samples of prompt i depend on i and the seed, not on its batch."""
  records = [json.loads(line) for line in reference.decode().splitlines()]
  assert [r['prompt'] for r in records] == prompts.read_text().splitlines()
  assert all(0 < len(r['ids']) <= 6 for r in records)
  assert len({tuple(r['ids']) for r in records}) > LINES // 2
  status, printed, errors = run(
      capfd, 'generate', '--workdir', lm_export[0], '--input', str(prompts),
      *SETTINGS)
  assert status == 0, errors
  assert printed.encode() == reference


@pytest.mark.slow
def test_plain_gz_output_and_the_refusals(lm_export, prompts, reference,
                                          tmp_path, capfd):
  """Without --jsonl a line is the prompt with its continuation; .gz is
  compressed; --num and --prompt are refused with --output."""
  flags = generate_command(lm_export[0], prompts, tmp_path / 'out.txt.gz')
  flags.remove('--jsonl')
  status, _, errors = run(capfd, *flags)
  assert status == 0, errors
  assert 'generate: 600/600 lines (100%)' in errors
  lines = gzip.decompress((tmp_path / 'out.txt.gz').read_bytes()).decode()
  texts = lines.split('\n')
  assert len(texts) == LINES + 1 and texts[-1] == ''
  records = [json.loads(line) for line in reference.decode().splitlines()]
  assert all(t.startswith(r['prompt'].split(' ')[0])
             for t, r in zip(texts, records))
  status, _, errors = run(capfd, *flags, '--num', '2')
  assert status == 1 and '--num 2 with --output' in errors
  status, _, errors = run(capfd, *flags, '--prompt', 'the')
  assert status == 1 and '--prompt and --input' in errors


@pytest.mark.slow
def test_gs_input_and_output(lm_export, prompts, reference, capfd,
                             gcs_emulator):
  paths.write_bytes('gs://test-bucket/generate/in.txt.gz',
                    gzip.compress(prompts.read_bytes()))
  status, _, errors = run(capfd, *generate_command(
      lm_export[0], 'gs://test-bucket/generate/in.txt.gz',
      'gs://test-bucket/generate/out.jsonl.gz'))
  assert status == 0, errors
  assert gzip.decompress(paths.read_bytes(
      'gs://test-bucket/generate/out.jsonl.gz')) == reference
  assert paths.list_dir('gs://test-bucket/generate') == ['in.txt.gz',
                                                         'out.jsonl.gz']


# --------------------------------------------------- processes and stops


# Enough work that a process signalled after its first chunk has more.
BIG_LINES, BIG_CHUNKS = 1800, 57  # 32-line chunks


@pytest.mark.slow
def test_a_sigterm_and_a_killed_process_then_two_processes_write_the_file(
    lm_export, prompts, environment, tmp_path):
  """SIGTERM to one of 2 processes stops both: each commits what it
  finished and exits 0. A process SIGKILLed in the next run ends it. The
  same command then finishes the file that 1 process writes."""
  big = tmp_path / 'big.txt'
  big.write_text(prompts.read_text() * (BIG_LINES // LINES))
  one = tmp_path / 'one.jsonl'
  assert cli.main(generate_command(lm_export[0], big, one,
                                   chunk_batches=4)) == 0

  out, parts = tmp_path / 'out.jsonl', tmp_path / 'out.jsonl.parts'
  command = [sys.executable, '-m', 'jaxformer', *generate_command(
      lm_export[0], big, out, '--config.distributed.heartbeat_timeout=10',
      chunk_batches=4)]
  processes = start_two(environment, command)
  wait_for_chunks(parts, processes, 1)
  processes[1].send_signal(signal.SIGTERM)
  errors = [p.communicate(timeout=TIMEOUT)[1] for p in processes]
  assert [p.returncode for p in processes] == [0, 0], errors
  assert 'generate: stopped (process 1 was stopped)' in errors[0]
  stopped = committed(parts)
  assert not out.exists() and len(stopped) < BIG_CHUNKS

  processes = start_two(environment, command)
  wait_for_chunks(parts, processes, len(stopped) + 1)
  processes[1].kill()
  _, errors = processes[0].communicate(timeout=TIMEOUT)
  assert processes[0].returncode != 0, errors[-3000:]
  processes[1].communicate(timeout=TIMEOUT)
  assert not out.exists() and stopped < committed(parts)
  assert len(committed(parts)) < BIG_CHUNKS
  launch(environment, 2, 1, command)
  assert out.read_bytes() == one.read_bytes()
  assert not parts.exists()


def wait_for_chunks(parts: pathlib.Path, processes, count: int) -> None:
  """Until `count` chunks are committed, one of them process 1's (the odd
  chunks)."""
  deadline = time.monotonic() + TIMEOUT
  odd = {chunk_name(c) for c in range(1, BIG_CHUNKS, 2)}
  while len(committed(parts)) < count or not odd & committed(parts):
    for process in processes:
      assert process.poll() is None, process.communicate()[1][-3000:]
    assert time.monotonic() < deadline
    time.sleep(0.02)
