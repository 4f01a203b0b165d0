"""Every test process sees 8 fake CPU devices, so sharded layouts can be
compared with the single-device result in one process; it compiles as the
`jaxformer` processes it starts do (tests/cpu_devices.py)."""
import os
import tempfile

import cpu_devices
import pytest

os.environ.setdefault('XLA_FLAGS', cpu_devices.xla_flags(8))
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# With libtpu installed (the tpu extra), every test process loads it; let
# them all, and the compile-only client of test_compile, load it at once.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
# The tests run on CPU devices: without this, JAX with libtpu installed
# tries a TPU backend in every process and libtpu prints its failure to
# stderr (the compile-only client of test_compile needs no TPU backend).
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Tests compare float32 results to 1e-5 or so. On a GPU, XLA runs float32
# matmuls in TF32 (a 10-bit mantissa) by default, and two orders of the same
# sums differ by 1e-3 (fused against einsum attention on an H100): where
# JAX_PLATFORMS names an accelerator, the tests ask for full float32.
if os.environ['JAX_PLATFORMS'] != 'cpu':
  os.environ.setdefault('JAX_DEFAULT_MATMUL_PRECISION', 'highest')
# etils.epath decides once per process whether gs:// goes through
# TensorFlow, at its first remote path; the emulator (gcs_emulator below)
# needs fsspec/gcsfs, so the choice is made here, before any test runs.
os.environ.setdefault('EPATH_USE_TF', 'false')
# The commands' persistent compilation cache
# (jaxformer/runtime/compilation_cache.py) stays out of the user's ~/.cache;
# test_compilation_cache turns it on.
os.environ.setdefault('JAXFORMER_COMPILATION_CACHE', 'off')


@pytest.fixture(scope='session')
def quickstart_workdir(tmp_path_factory) -> str:
  """The runlocal quick start trained once per test run, for the modules
  that use a trained translator (tests/trained_runs.py): read-only; a test
  that writes to it takes `trained_runs.copy` of it."""
  import trained_runs
  return str(trained_runs.shared(tmp_path_factory, 'quickstart',
                                 trained_runs.quickstart_run))


@pytest.fixture(scope='session')
def process_environment(tmp_path_factory) -> dict:
  """The environment of the `jaxformer` processes that tests start: two
  CPU devices and this test run's shared compilation cache
  (trained_runs.process_environment)."""
  import trained_runs
  return trained_runs.process_environment(tmp_path_factory)


@pytest.fixture(scope='session')
def lm_export(tmp_path_factory):
  """(export directory, tokenizer, config, params) of a random language
  model (test_generate.random_lm_export), for the modules that generate."""
  from test_generate import random_lm_export
  return random_lm_export(tmp_path_factory.mktemp('lm'))


@pytest.fixture
def tfds_scratch_in_tmp_path(tmp_path, monkeypatch):
  """Keeps the scratch directories tfds makes under mock_data (it looks for
  dataset metadata online with tempfile.mkdtemp and never removes them) in
  the test's tmp_path instead of /tmp."""
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))


@pytest.fixture(scope='session')
def gcs_emulator():
  """A GCS emulator on 127.0.0.1 holding the bucket gs://test-bucket
  (tests/gcs_emulator.py). Yields the variables that point the
  storage libraries at it; they are also set in this process meanwhile."""
  import logging
  import subprocess
  import sys
  import gcs_emulator as emulator
  process = subprocess.Popen(
      [sys.executable, emulator.__file__, 'test-bucket'],
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = process.stdout.readline()
  if not line.startswith('port='):
    process.kill()
    raise RuntimeError('The GCS emulator did not start (is '
                       'gcp-storage-emulator installed? pip install -e '
                       '".[test]").')
  variables = emulator.environment(int(line.strip().split('=')[1]))
  # Without credentials gcsfs warns at every bucket it meets.
  logging.getLogger('gcsfs').setLevel(logging.ERROR)
  saved = {name: os.environ.get(name) for name in variables}
  os.environ.update(variables)
  try:
    yield variables
  finally:
    for name, value in saved.items():
      if value is None:
        os.environ.pop(name, None)
      else:
        os.environ[name] = value
    process.terminate()
    process.wait(timeout=30)
