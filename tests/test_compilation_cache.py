"""The persistent compilation cache of the commands: where it is, and a
restart that loads its programs from it instead of compiling them."""
import os
import re
import subprocess
import sys

import pytest

from jaxformer.runtime import compilation_cache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_directory_is_local_by_default_and_can_be_moved_or_turned_off():
  home = os.path.expanduser('~')
  assert compilation_cache.directory({}) == f'{home}/.cache/jaxformer/xla'
  assert compilation_cache.directory(
      {'XDG_CACHE_HOME': '/c'}) == '/c/jaxformer/xla'
  assert compilation_cache.directory(
      {'JAX_COMPILATION_CACHE_DIR': '/j'}) == '/j'
  chosen = {'JAXFORMER_COMPILATION_CACHE': 'gs://b/xla',
            'JAX_COMPILATION_CACHE_DIR': '/j'}
  assert compilation_cache.directory(chosen) == 'gs://b/xla'
  for off in ('off', 'OFF', '', '0'):
    assert compilation_cache.directory(
        {'JAXFORMER_COMPILATION_CACHE': off}) is None


def train(workdir, cache, steps: int) -> str:
  """`jaxformer train` of the runlocal quick start to `steps`, in a process
  of its own; its output."""
  env = dict(os.environ, JAXFORMER_COMPILATION_CACHE=str(cache),
             PYTHONPATH=REPO)
  result = subprocess.run(
      [sys.executable, '-m', 'jaxformer', 'train', '--config',
       'configs/quickstart.py:runlocal', '--workdir', str(workdir),
       f'--config.train.num_steps={steps}', '--config.checkpoint.every=1',
       '--config.eval.every=0', '--config.eval.num_batches=1',
       '--config.eval.bleu_examples=0', '--config.eval.final_split='],
      env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


def loaded_and_compiled(output: str) -> tuple[int, int]:
  match = re.search(r'compilation cache: (\d+) programs? loaded .*, (\d+) '
                    'compiled', output)
  assert match, output
  return int(match.group(1)), int(match.group(2))


@pytest.mark.slow
def test_a_restart_loads_its_train_step_from_the_cache(tmp_path):
  cache = tmp_path / 'xla'
  first = train(tmp_path / 'run', cache, steps=1)
  assert f'compilation cache: {cache}' in first
  loaded, compiled = loaded_and_compiled(first)
  assert loaded == 0 and compiled > 0
  written = [f for f in os.listdir(cache) if f.endswith('-cache')]
  step, = [f for f in written if f.startswith('jit_train_step-')]
  # JAX stamps an entry's last read in KEY-atime (the capped local cache).
  last_read = cache / step.replace('-cache', '-atime')
  read_at = lambda: int.from_bytes(last_read.read_bytes(), 'little')  # noqa: E731
  stamp = read_at()
  loaded, _ = loaded_and_compiled(train(tmp_path / 'run', cache, steps=2))
  assert 0 < loaded <= len(written)
  assert read_at() > stamp


def test_a_second_compile_loads_each_report_from_the_cache(tmp_path,
                                                           monkeypatch):
  import jax
  import jax.numpy as jnp
  from jaxformer.aot import programs
  from jaxformer.aot import topology as topology_lib
  from jaxformer.aot import report_cache
  monkeypatch.setenv('JAXFORMER_COMPILATION_CACHE', str(tmp_path))
  topo = topology_lib.topology('v5e-8')
  measured = []

  def measure(program, topo, num_devices):
    measured.append(program.name)
    program.lower().compile()
    return {'program': program.name, 'devices': num_devices}

  def program(scale):
    x = jax.ShapeDtypeStruct((4, 4), jnp.float32)
    return programs.Program('double', 'train',
                       lambda: jax.jit(lambda a: a * scale).lower(x))

  assert report_cache.report(program(2), topo, 8, measure) == {
      'program': 'double', 'devices': 8}
  assert report_cache.report(program(2), topo, 8, measure) == {
      'program': 'double', 'devices': 8, 'from_cache': True}
  report_cache.report(program(3), topo, 8, measure)  # Another program.
  assert measured == ['double', 'double']
  monkeypatch.setenv('JAXFORMER_COMPILATION_CACHE', 'off')
  report_cache.report(program(2), topo, 8, measure)
  assert len(measured) == 3

