"""gs:// workdirs end to end, against a GCS emulator (conftest.gcs_emulator).

Training, resuming after SIGKILL, every command and a 2-process run read and
write gs://test-bucket/... through the three standard variables only; no
byte may land in a local folder named `gs:`.
"""
import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import gcs_emulator as emulator
import numpy as np
import plain_install
import pytest
import trained_runs

from jaxformer.cli import main as cli
from jaxformer.storage import paths
from jaxformer.run import goodput
from jaxformer.run.metrics import EventFile, MetricsWriter, read_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
CONFIG = f'{REPO}/configs/quickstart.py:runlocal'
NUM_STEPS = 40
OVERRIDES = (f'train.num_steps={NUM_STEPS}', 'train.log_every=1',
             'train.peak_flops=1e9', 'checkpoint.every=10', 'eval.every=0',
             'eval.final_split=', 'eval.bleu_examples=0', 'eval.num_batches=1')
# Wall-clock measurements, which differ between equal runs.
TIMING_KEYS = ('tokens_per_second', 'step_time', 'mfu', *goodput.FIELDS)
TIMEOUT = 900  # seconds; generous for a loaded 2-core machine


def numbers(records):
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
          for r in records]


def between(records, first, last):
  return [r for r in records if first <= r['step'] <= last]


def no_gs_folder(*roots):
  for root in roots:
    found = [str(p) for p in pathlib.Path(root).rglob('gs:')]
    assert not found, f'a local gs: folder appeared: {found}'


class Training:
  """`jaxformer train` in a subprocess whose cwd (and HOME) is `home`."""

  def __init__(self, workdir: str, home: pathlib.Path, environment: dict,
               *overrides: str, process_env: dict | None = None):
    home.mkdir(parents=True, exist_ok=True)
    self.workdir = workdir
    self.first_record = len(self.logged())
    self.log_path = home / f'log_{time.time_ns()}.txt'
    command = [sys.executable, '-m', 'jaxformer', 'train', '--config',
               CONFIG, '--workdir', workdir]
    command += [f'--config.{o}' for o in OVERRIDES + overrides]
    env = dict(environment, HOME=str(home), **(process_env or {}))
    with open(self.log_path, 'w') as log:
      self.process = subprocess.Popen(command, stdout=log, cwd=home, env=env,
                                      stderr=subprocess.STDOUT)

  def logged(self) -> list[dict]:
    try:
      return read_metrics(self.workdir)
    except FileNotFoundError:
      return []

  def wait_until(self, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
      if self.process.poll() is not None:
        pytest.fail(f'training exited ({self.process.returncode}) before '
                    f'{what}:\n{self.output()[-4000:]}')
      if time.monotonic() > deadline:
        self.process.kill()
        pytest.fail(f'no {what} after {TIMEOUT} s:\n{self.output()[-4000:]}')
      time.sleep(0.2)

  def finish(self) -> int:
    return self.process.wait(TIMEOUT)

  def output(self) -> str:
    return self.log_path.read_text()

  def records(self) -> list[dict]:
    return self.logged()[self.first_record:]


def committed_steps(workdir: str) -> list[int]:
  """Checkpoint steps whose write is complete (Orbax marks them on GCS)."""
  directory = paths.join(workdir, 'checkpoints')
  return sorted(int(name) for name in paths.list_dir(directory)
                if name.isdigit() and paths.exists(
                    paths.join(directory, name, 'commit_success.txt')))


@pytest.fixture(scope='module')
def environment(tmp_path_factory, gcs_emulator):
  return dict(plain_install.environment(os.environ), **gcs_emulator,
              **trained_runs.process_settings(tmp_path_factory),
              PYTHONPATH=str(REPO))


@pytest.fixture(scope='module')
def local_reference(tmp_path_factory, environment):
  """An uninterrupted run in a local workdir: (workdir, metrics)."""
  home = tmp_path_factory.mktemp('local')
  run = Training(str(home / 'run'), home, environment)
  assert run.finish() == 0, run.output()[-4000:]
  return home / 'run', read_metrics(str(home / 'run'))


# ----------------------------------------------------------- the path layer


def test_local_and_remote_files_read_back_what_was_written(
    tmp_path, gcs_emulator, monkeypatch):
  monkeypatch.setattr(paths, 'PART_RECORDS', 2)
  for directory in (str(tmp_path / 'local'), 'gs://test-bucket/paths'):
    target = paths.join(directory, 'a', 'b.txt')
    paths.write_text(target, 'first')
    paths.write_text(target, 'second')
    assert paths.read_text(target) == 'second'
    assert paths.list_dir(paths.join(directory, 'a')) == ['b.txt']
    assert paths.is_dir(paths.join(directory, 'a'))
    assert not paths.exists(paths.join(directory, 'missing'))
    appended = paths.AppendableFile(paths.join(directory, 'log'))
    appended.append(b'1\n')
    appended.append(b'2\n')
    appended.close()
    paths.AppendableFile(paths.join(directory, 'log')).append(b'3\n')
    assert paths.read_appended(paths.join(directory, 'log')) == b'1\n2\n3\n'
  assert paths.stat('gs://test-bucket/paths/a/b.txt')[0] == len('second')
  # Remote: one part per writer and PART_RECORDS appends, in order.
  assert [name for name in paths.list_dir('gs://test-bucket/paths')
          if name.startswith('log')] == ['log.00000', 'log.00001']
  no_gs_folder(tmp_path, os.getcwd())


@pytest.mark.slow
def test_a_token_cache_on_gs_is_written_once_and_read_from_a_local_copy(
    tmp_path, gcs_emulator, monkeypatch):
  from jaxformer.data import builtin, pipeline, sources, token_cache
  from jaxformer.data import tokenizer as tokenizer_lib
  from jaxformer.data.defaults import default_data_config
  pairs = builtin.generate(60, 2, 'train')
  config = default_data_config()
  config.source = 'tsv'
  config.tsv.train = 'gs://test-bucket/cache-data/train.tsv'
  paths.write_text(config.tsv.train, ''.join(f'{s}\t{t}\n' for s, t in pairs))
  config.tokenizer.vocab_size = 120
  config.update(batch_size=4, max_source_length=40, max_target_length=40)
  tok = tokenizer_lib.train_tokenizer([t for p in pairs for t in p],
                                      str(tmp_path / 'joint'), config.tokenizer)
  monkeypatch.setattr(token_cache, 'SHARD_EXAMPLES', 25)
  local = tmp_path / 'host_cache'
  monkeypatch.setenv('JAXFORMER_TOKEN_CACHE_LOCAL', str(local))
  cache = 'gs://test-bucket/cache-run/tokenizer/token_cache'
  in_memory = token_cache.tokenized_split(config, 'train', tok, tok)
  expected = next(pipeline.translation_train_batches(config, tok, tok))
  expected_at_20 = next(pipeline.translation_train_batches(
      config, tok, tok, start_step=20))
  token_cache.tokenized_split(config, 'train', tok, tok, cache)
  (folder,) = paths.list_dir(cache)
  assert 'manifest.json' in paths.list_dir(paths.join(cache, folder))
  token_cache._open_splits.clear()
  monkeypatch.setattr(sources, 'iter_split', lambda *a: pytest.fail('read'))
  port = int(gcs_emulator['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1])
  before = emulator.stats(port)['requests']
  remote = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  # The manifest, then each of the 3 shards' 4 files in one download.
  assert emulator.stats(port)['requests'] - before <= 1 + 3 * 4
  assert sorted(os.listdir(local / folder)) == sorted(
      f'{n:05d}.{side}{part}.npy' for n in range(3)
      for side in ('source', 'target') for part in ('', '_lengths'))
  before = emulator.stats(port)['requests']
  rows = np.array([24, 25, 59, 0, 24])
  for got, want in zip(remote.gather(rows, 5, 40), in_memory.gather(rows, 5, 40)):
    np.testing.assert_array_equal(got, want)
  assert emulator.stats(port)['requests'] == before  # Examples are local.
  batch = next(pipeline.translation_train_batches(config, tok, tok,
                                                  token_cache=cache))
  for key in expected:
    np.testing.assert_array_equal(batch[key], expected[key], err_msg=key)
  # A resume stores the epochs' batch counts beside the cache, and reads them.
  resumed = [next(pipeline.translation_train_batches(
      config, tok, tok, start_step=20, token_cache=cache)) for _ in range(2)]
  (counts,) = [name for name in paths.list_dir(paths.join(cache, folder))
               if name.startswith('epochs-')]
  assert len(json.loads(paths.read_text(paths.join(cache, folder, counts)))[
      'counts']) >= 2
  for batch in resumed:
    for key in expected_at_20:
      np.testing.assert_array_equal(batch[key], expected_at_20[key], err_msg=key)
  no_gs_folder(tmp_path, os.getcwd())


def test_metrics_and_tensorboard_events_are_readable_by_tensorflow(
    tmp_path, gcs_emulator, monkeypatch):
  """Remote metrics are parts (2 appends each here) read as one stream; each
  events part is a TFRecord file, which TensorBoard reads in name order."""
  import tensorflow as tf
  monkeypatch.setattr(paths, 'PART_RECORDS', 2)
  workdir = 'gs://test-bucket/metrics'
  writer = MetricsWriter(workdir)
  writer.write(1, {'loss': np.float32(2.5), 'vector': np.ones(3)})
  writer.write(2, {'loss': 1.5}, prefix='eval_')
  writer.write(3, {'loss': 0.5})
  writer.close()
  MetricsWriter(workdir).write(4, {'loss': 0.25})  # A restart: a new part.
  assert read_metrics(workdir) == [
      {'step': 1, 'loss': 2.5}, {'step': 2, 'eval_loss': 1.5},
      {'step': 3, 'loss': 0.5}, {'step': 4, 'loss': 0.25}]
  assert [name for name in paths.list_dir(workdir) if 'metrics' in name] == [
      'metrics.jsonl.00000', 'metrics.jsonl.00001', 'metrics.jsonl.00002']
  events = []
  for name in paths.list_dir(paths.join(workdir, 'tensorboard')):
    local = tmp_path / name
    local.write_bytes(paths.read_bytes(paths.join(workdir, 'tensorboard', name)))
    events += [tf.compat.v1.Event.FromString(record.numpy()) for record in
               tf.data.TFRecordDataset(str(local))]  # Checks every CRC.
  assert [e.file_version for e in events if e.file_version] == [
      'brain.Event:2'] * 2
  assert [(e.step, v.tag, v.simple_value) for e in events
          for v in e.summary.value] == [(1, 'loss', 2.5), (2, 'eval_loss', 1.5),
                                        (3, 'loss', 0.5), (4, 'loss', 0.25)]
  EventFile(str(tmp_path / 'tb')).close()  # Local: a file with its header.
  assert len(os.listdir(tmp_path / 'tb')) == 1


def test_remote_metrics_write_bytes_linear_in_the_records(gcs_emulator,
                                                          monkeypatch):
  """Appending 4x the records to gs:// metrics uploads ~4x the bytes (a
  whole-file rewrite per record would upload ~15x)."""
  monkeypatch.setattr(paths, 'PART_RECORDS', 8)
  port = int(gcs_emulator['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1])

  def uploaded(records: int) -> int:
    before = emulator.stats(port)['bytes_received']
    writer = MetricsWriter(f'gs://test-bucket/linear-{records}')
    for step in range(records):
      writer.write(step, {'loss': 1.0 / (step + 1), 'learning_rate': 1e-3})
    writer.close()
    return emulator.stats(port)['bytes_received'] - before

  few, many = uploaded(paths.PART_RECORDS), uploaded(4 * paths.PART_RECORDS)
  assert 3.5 < many / few < 5, (few, many)


@pytest.mark.slow
def test_a_missing_bucket_fails_before_training_naming_it(tmp_path,
                                                          gcs_emulator):
  command = [sys.executable, '-m', 'jaxformer', 'train', '--config',
             CONFIG, '--workdir', 'gs://no-such-bucket/run']
  result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(REPO)),
                          timeout=TIMEOUT)
  assert result.returncode == 1
  assert 'error: Cannot write to gs://no-such-bucket/run' in result.stderr
  assert 'Check that the bucket gs://no-such-bucket exists' in result.stderr
  assert 'step' not in result.stdout
  no_gs_folder(tmp_path)


PLAIN_INSTALL_CHILD = """
import importlib, os, sys
import numpy as np
for name in ('pytest', 'gcp_storage_emulator'):
  try:
    importlib.import_module(name)
    sys.exit(f'{name} is importable: the test extra is not hidden')
  except ModuleNotFoundError:
    pass
from jaxformer.storage import paths
from jaxformer.data import token_cache
root = 'gs://test-bucket/plain-install'
paths.write_text(paths.join(root, 'a.txt'), 'written')
assert paths.read_text(paths.join(root, 'a.txt')) == 'written'
log = paths.AppendableFile(paths.join(root, 'log'))
log.append(b'1'); log.append(b'2')
assert paths.read_appended(paths.join(root, 'log')) == b'12'
tokens = np.arange(2, 12, dtype=np.uint16)
lengths = np.array([3, 7], np.int32)
shard = dict(source=tokens, source_lengths=lengths, target=tokens[::-1].copy(),
             target_lengths=lengths[::-1].copy())
token_cache.write(paths.join(root, 'cache'), [shard], key='k')
split = token_cache.read(paths.join(root, 'cache'))
got, splits, _, _ = split.gather(np.array([1, 0]))
assert got.tolist() == [5, 6, 7, 8, 9, 10, 11, 2, 3, 4], got
assert sorted(paths.list_dir(root)) == ['a.txt', 'cache', 'log.00000']
print('plain install ok')
"""


@pytest.mark.slow
def test_a_plain_install_reads_and_writes_gs_paths(tmp_path, gcs_emulator):
  """gs:// through the path layer (files, appended files, a token cache) in
  a process that sees only what `pip install .` installs, and only the
  emulator's address: pyproject's core dependencies must bring gcsfs."""
  env = plain_install.environment(os.environ)
  env.pop('EPATH_USE_TF', None)
  env.update(gcs_emulator, JAXFORMER_TOKEN_CACHE_LOCAL=str(tmp_path / 'local'))
  result = subprocess.run([sys.executable, '-c', PLAIN_INSTALL_CHILD],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=TIMEOUT)
  assert result.returncode == 0, result.stderr[-4000:]
  assert 'plain install ok' in result.stdout
  assert result.stderr == ''  # No gcsfs warning either.


# ------------------------------------------------ training and the commands


@pytest.mark.slow
def test_a_gs_workdir_resumes_exactly_after_sigkill_and_serves_the_commands(
    tmp_path, environment, local_reference, capsys):
  workdir = 'gs://test-bucket/run'
  reference_dir, expected = local_reference
  tokenizer = 'tokenizer/joint.model'
  paths.write_bytes(paths.join(workdir, tokenizer),
                    (reference_dir / tokenizer).read_bytes())

  killed = Training(workdir, tmp_path / 'killed', environment)
  killed.wait_until(lambda: committed_steps(workdir)
                    and max(r['step'] for r in killed.logged()) >= 12,
                    'a checkpoint and step 12')
  killed.process.send_signal(signal.SIGKILL)
  killed.finish()
  assert numbers(killed.records()) == numbers(
      between(expected, 1, killed.records()[-1]['step']))

  restored = committed_steps(workdir)[-1]
  resumed = Training(workdir, tmp_path / 'resumed', environment)
  assert resumed.finish() == 0, resumed.output()[-4000:]
  assert f'Resuming from the checkpoint of step {restored}' in resumed.output()
  assert numbers(resumed.records()) == numbers(
      between(expected, restored + 1, NUM_STEPS))
  assert committed_steps(workdir) == [30, 40]
  names = paths.list_dir(workdir)
  for name in ('checkpoints', 'config.json', 'metrics.jsonl.00000',
               'metrics.jsonl.00001', 'tensorboard', 'tokenizer'):
    assert name in names, names
  assert paths.list_dir(paths.join(workdir, 'checkpoints', '40', 'state'))

  def run(*argv) -> str:
    capsys.readouterr()
    assert cli.main(list(argv)) == 0, capsys.readouterr().err
    return capsys.readouterr().out

  sources = 'gs://test-bucket/sources.txt'
  paths.write_text(sources, 'he sold three cups .\nwe bought ten apples .\n')
  translations = run('translate', '--workdir', workdir, '--input', sources,
                     '--beam', '1')
  assert len(translations.splitlines()) == 2
  scores = json.loads(run('evaluate', '--workdir', workdir, '--split', 'test',
                          '--beam', '1', '--hypotheses',
                          f'{workdir}/test_hypotheses.txt'))
  assert scores['hypotheses'] == f'{workdir}/test_hypotheses.txt'
  assert len(paths.read_text(scores['hypotheses']).splitlines()) == 40
  run('average', '--workdir', workdir, '--last', '2', '--out',
      'gs://test-bucket/average')
  assert {'params', 'extra'} <= set(paths.list_dir('gs://test-bucket/average'))
  assert run('translate', '--workdir', 'gs://test-bucket/average', '--input',
             sources, '--beam', '1').count('\n') == 2
  run('attention', '--workdir', workdir, '--src', 'he sold three cups .',
      '--out', f'{workdir}/attention.png')
  run('curves', '--workdir', workdir, '--out', f'{workdir}/curves.png')
  for picture in ('attention.png', 'curves.png'):
    assert paths.read_bytes(f'{workdir}/{picture}').startswith(b'\x89PNG')
  no_gs_folder(tmp_path, os.getcwd(), REPO)


# ---------------------------------------------------------- two processes


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def train_two_processes(workdir, tmp_path, environment, steps, name):
  """2 processes x 2 devices, each with its own cwd and HOME; returns the
  output of process 0."""
  port = free_port()
  runs = [Training(workdir, tmp_path / f'{name}{i}', environment,
                   f'train.num_steps={steps}', process_env=dict(
                       JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
                       JAX_NUM_PROCESSES='2', JAX_PROCESS_ID=str(i)))
          for i in range(2)]
  try:
    for i, run in enumerate(runs):
      assert run.finish() == 0, f'process {i}:\n{run.output()[-4000:]}'
  finally:
    for run in runs:
      if run.process.poll() is None:
        run.process.kill()
  return runs[0].output()


@pytest.mark.slow
def test_two_processes_train_into_one_gs_workdir_and_resume(tmp_path,
                                                            environment):
  workdir = 'gs://test-bucket/two-processes'
  train_two_processes(workdir, tmp_path, environment, 10, 'first')
  assert committed_steps(workdir) == [10]
  state = paths.join(workdir, 'checkpoints', '10', 'state')
  assert {'ocdbt.process_0', 'ocdbt.process_1'} <= set(paths.list_dir(state))
  assert paths.list_dir(paths.join(workdir, 'tokenizer')) == [
      'joint.model', 'token_cache']
  cached = paths.list_dir(paths.join(workdir, 'tokenizer', 'token_cache'))
  assert [name.split('-')[0] for name in cached] == ['dev', 'train'], cached

  output = train_two_processes(workdir, tmp_path, environment, 12, 'second')
  assert 'Resuming from the checkpoint of step 10' in output
  steps = [r['step'] for r in read_metrics(workdir) if 'loss' in r]
  assert steps == list(range(1, 13))
  no_gs_folder(tmp_path)


# ----------------------------------------------------------- storage faults

EXIT_SECONDS = 180  # a fatal storage error must end the run this soon


@contextlib.contextmanager
def private_emulator():
  """An emulator of gs://test-bucket for one test (which may kill it):
  yields (its process, its port)."""
  server = subprocess.Popen([sys.executable, emulator.__file__, 'test-bucket'],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
  try:
    yield server, int(server.stdout.readline().strip().split('=')[1])
  finally:
    if server.poll() is None:
      server.terminate()
      server.wait(30)


def assert_ends_with_one_error(runs, started: float, *expected: str) -> None:
  """Every process of `runs` exits non-zero within EXIT_SECONDS of
  `started`, process 0 with one error line (containing `expected`), and no
  process prints a traceback or a storage client's log line."""
  try:
    for run in runs:
      run.process.wait(max(started + EXIT_SECONDS - time.monotonic(), 1))
  except subprocess.TimeoutExpired:
    pytest.fail(f'still running {EXIT_SECONDS} s after the fault:\n'
                + runs[0].output()[-3000:])
  finally:
    for run in runs:
      if run.process.poll() is None:
        run.process.kill()
  for run in runs:
    assert run.process.returncode != 0, run.output()[-3000:]
    output = run.output()
    for noise in ('Traceback', 'gcsfs', 'out of retries', 'bucket type'):
      assert noise not in output, output[-3000:]
  errors = [line for line in runs[0].output().splitlines() if 'error' in line]
  assert len(errors) == 1, runs[0].output()[-3000:]
  assert errors[0].startswith('jaxformer train: error: '), errors
  for text in expected:
    assert text in errors[0], errors


def start_runs(workdir, tmp_path, environment, port, processes=1):
  """`processes` processes of one run on the emulator at `port`."""
  variables = emulator.environment(port)
  if processes > 1:
    coordinator = f'127.0.0.1:{free_port()}'
    return [Training(workdir, tmp_path / f'p{i}', environment,
                     'train.num_steps=400', 'distributed.heartbeat_timeout=20',
                     process_env=dict(variables,
                                      JAX_COORDINATOR_ADDRESS=coordinator,
                                      JAX_NUM_PROCESSES=str(processes),
                                      JAX_PROCESS_ID=str(i)))
            for i in range(processes)]
  return [Training(workdir, tmp_path, environment, 'train.num_steps=400',
                   process_env=variables)]


def wait_for_step(run, step: int) -> None:
  run.wait_until(lambda: f'step {step}/' in run.output(), f'step {step}')


BROKEN_READ_CHILD = """
import os
import sys
from jaxformer.storage import paths
paths.write_bytes('gs://test-bucket/big', os.urandom(8 << 20))
reader = paths.open_bytes('gs://test-bucket/big')
reader.read(1 << 20)  # fsspec's background prefetcher now reads ahead.
print('read', flush=True)
sys.stdin.readline()  # The emulator is killed.
try:
  while reader.read(1 << 20):
    pass
except Exception as error:
  assert paths.is_storage_error(error), repr(error)
  sys.exit(3)
"""


@pytest.mark.slow
def test_a_read_broken_mid_file_logs_nothing(tmp_path):
  """The storage clients' own fault lines (gcsfs's retries, fsspec's
  prefetcher's traceback) stay off stderr; the error reaches the caller."""
  with private_emulator() as (server, port):
    env = {**os.environ, **emulator.environment(port)}
    env.pop('JAXFORMER_DEBUG', None)
    child = subprocess.Popen([sys.executable, '-c', BROKEN_READ_CHILD],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env,
                             cwd=tmp_path)
    assert child.stdout.readline() == 'read\n'
    server.kill()
    server.wait()
    _, stderr = child.communicate('\n', timeout=TIMEOUT)
  assert child.returncode == 3, stderr[-3000:]
  assert stderr == ''


@pytest.mark.slow
def test_storage_gone_mid_run_ends_the_run(tmp_path, environment):
  with private_emulator() as (server, port):
    (run,) = start_runs('gs://test-bucket/outage', tmp_path, environment, port)
    wait_for_step(run, 12)  # The checkpoint of step 10 is written or on its way.
    server.kill()
    started = time.monotonic()
    assert_ends_with_one_error([run], started)
  print(f'exited {time.monotonic() - started:.0f} s after the emulator died')


@pytest.mark.slow
def test_a_failed_save_ends_both_processes_of_a_run(tmp_path, environment):
  """Process 0 reports the failed save; process 1 stops at its next
  collective or heartbeat (a 1-process run takes process 0's path)."""
  processes = 2
  with private_emulator() as (server, port):
    runs = start_runs(f'gs://test-bucket/read-only-{processes}', tmp_path,
                      environment, port, processes)
    wait_for_step(runs[0], 5)
    emulator.reject_writes(port, containing='/checkpoints/')
    started = time.monotonic()
    assert_ends_with_one_error(runs, started, 'Writing the checkpoint of step')
  print(f'{processes} processes exited {time.monotonic() - started:.0f} s '
        'after checkpoint writes began to be rejected')
