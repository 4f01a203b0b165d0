"""Every test process sees 8 fake CPU devices, so sharded layouts can be
compared with the single-device result in one process."""
import os
import tempfile

import pytest

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# With libtpu installed (the tpu extra), every test process loads it; let
# them all, and the compile-only client of test_compile, load it at once.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


@pytest.fixture
def tfds_scratch_in_tmp_path(tmp_path, monkeypatch):
  """Keeps the scratch directories tfds makes under mock_data (it looks for
  dataset metadata online with tempfile.mkdtemp and never removes them) in
  the test's tmp_path instead of /tmp."""
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
