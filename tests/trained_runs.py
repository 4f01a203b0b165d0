"""How the tests train through the command line: in this process
(`train`) or in a process of their own (`train_process`, in the
`process_environment`); and the directories that several modules read
(`shared`): each made once per test run and, under pytest-xdist, once for
all the workers (the first worker to ask makes it under a file lock, the
others wait for it). A shared directory is read-only to its tests: one
that writes takes a `copy` of its own."""
import os
import pathlib
import shutil
import subprocess
import sys
import time
from collections.abc import Callable

import cpu_devices
import filelock

from jaxformer.cli import main as cli

REPO = pathlib.Path(__file__).resolve().parent.parent
QUICKSTART = 'configs/quickstart.py:runlocal'
# No measured CPU peak (train.peak_flops): it takes seconds and is tested
# on its own (test_goodput).
NO_PEAK = '--config.train.peak_flops=1e9'


def train(workdir, *flags: str, config: str = QUICKSTART) -> int:
  """`jaxformer train --config CONFIG --workdir WORKDIR FLAGS` in this
  process; its exit status. `config` is relative to the repository."""
  if not os.path.isabs(config.split(':')[0]):
    config = str(REPO / config)
  return cli.main(['train', '--config', config, '--workdir', str(workdir),
                   *flags])


def run_root(tmp_path_factory) -> pathlib.Path:
  """The folder of this test run that every xdist worker sees: the parent
  of a worker's base temporary folder, or the base folder itself."""
  base = tmp_path_factory.getbasetemp()
  return base.parent if os.environ.get('PYTEST_XDIST_WORKER') else base


def shared(tmp_path_factory, name: str,
           make: Callable[[pathlib.Path], None]) -> pathlib.Path:
  """The folder `name` of this test run, filled by `make(folder)` the first
  time any worker asks for it."""
  folder = run_root(tmp_path_factory) / 'shared' / name
  folder.parent.mkdir(parents=True, exist_ok=True)
  done = folder.parent / f'{name}.done'
  with filelock.FileLock(str(folder.parent / f'{name}.lock')):
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      make(folder)
      done.touch()
  return folder


def process_settings(tmp_path_factory) -> dict[str, str]:
  """The variables a `jaxformer` process of the tests gets: two CPU devices
  (tests/cpu_devices.py), and the compilation cache that every process of
  this test run shares (every program written, however quick its compile).
  Tests of compiling itself set their own (test_preemption,
  test_compilation_cache)."""
  cache = run_root(tmp_path_factory) / 'xla'
  cache.mkdir(mode=0o700, exist_ok=True)
  return dict(XLA_FLAGS=cpu_devices.xla_flags(2),
              JAXFORMER_COMPILATION_CACHE=str(cache),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
              TF_CPP_MIN_LOG_LEVEL='2')


def process_environment(tmp_path_factory, **extra: str) -> dict[str, str]:
  """The environment of a `jaxformer` process: this one's, with the
  `process_settings`."""
  return dict(os.environ, **process_settings(tmp_path_factory), **extra)


def train_process(workdir: pathlib.Path, config: str, flags, environment,
                  log: pathlib.Path | None = None) -> subprocess.Popen:
  """`jaxformer train --config CONFIG --workdir WORKDIR FLAGS` in a process
  of its own, its output in `log` (default: a new log_*.txt of the workdir,
  which `process_output` reads)."""
  workdir.mkdir(exist_ok=True)
  log = log or workdir / f'log_{time.time_ns()}.txt'
  with open(log, 'w') as out:
    return subprocess.Popen(
        [sys.executable, '-m', 'jaxformer', 'train', '--config', config,
         '--workdir', str(workdir), *flags],
        stdout=out, stderr=subprocess.STDOUT, env=environment)


def process_output(workdir: pathlib.Path) -> str:
  """The output of the workdir's `train_process` runs, oldest first."""
  return '\n'.join(p.read_text() for p in sorted(workdir.glob('log_*.txt')))


def copy(folder: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  """A copy of the shared `folder` that a test may change."""
  return pathlib.Path(shutil.copytree(folder, tmp_path / folder.name))


def quickstart_run(folder: pathlib.Path) -> None:
  """The runlocal quick start trained for 60 steps (a checkpoint every 30),
  then evaluated on its test split: its outputs differ from line to line
  and stop at different lengths, though it does not translate yet."""
  assert train(folder, '--config.train.num_steps=60',
               '--config.eval.every=0', '--config.eval.bleu_examples=8',
               '--config.checkpoint.every=30', NO_PEAK) == 0
