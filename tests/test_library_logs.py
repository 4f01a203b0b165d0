"""What keeps the libraries' own lines off a command's stderr
(runtime/library_logs.py); tests/test_readme_commands.py checks the
commands' stderr end to end."""
import importlib.util
import logging
import os
import sys
import warnings

import pytest

from jaxformer.runtime import library_logs

LIBTPU_START = """\
Failed to find host bounds for accelerator type: WARNING: could not determine TPU accelerator type, please set env var `TPU_ACCELERATOR_TYPE` manually, otherwise libtpu.so may not properly initialize.
WARNING: Logging before InitGoogle() is written to STDERR
E0000 00:00:1796466478.167908   20607 common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname 'WARNING: could not determine TPU worker hostnames or IP addresses' from env var TPU_WORKER_HOSTNAMES.
=== Source Location Trace: ===
learning/45eac/tfrc/runtime/libtpu_init_utils.cc:327
"""


def test_libtpu_host_lines_are_dropped_and_the_rest_kept(capfd):
  with library_logs.without_libtpu_host_lines():
    os.write(2, LIBTPU_START.encode())
    os.write(2, b'F0000 something else broke\n')
  assert capfd.readouterr().err == 'F0000 something else broke\n'


def test_an_error_in_the_body_still_restores_stderr(capfd):
  with pytest.raises(RuntimeError):
    with library_logs.without_libtpu_host_lines():
      os.write(2, b'the reason\n')
      raise RuntimeError('no topology')
  os.write(2, b'after\n')
  assert capfd.readouterr().err == 'the reason\nafter\n'


@pytest.mark.skipif(not importlib.util.find_spec('libtpu'),
                    reason='only where libtpu is installed')
def test_jax_starts_on_the_cpu_only_where_no_tpu_is_attached(tmp_path):
  environ = {}
  assert library_logs.cpu_only_without_accelerators(environ, str(tmp_path))
  assert environ == {'JAX_PLATFORMS': 'cpu'}
  chosen = {'JAX_PLATFORMS': 'tpu'}
  assert not library_logs.cpu_only_without_accelerators(chosen, str(tmp_path))
  assert chosen == {'JAX_PLATFORMS': 'tpu'}
  (tmp_path / 'vfio').mkdir()
  (tmp_path / 'vfio' / '0').touch()  # A TPU v5e's device file.
  environ = {}
  assert not library_logs.cpu_only_without_accelerators(environ, str(tmp_path))
  assert environ == {}


def test_other_libraries_warnings_are_ignored_and_jaxformers_kept(
    monkeypatch):
  monkeypatch.setattr(sys, 'warnoptions', [])  # No -W given.
  absl = logging.getLogger('absl')
  monkeypatch.setattr(absl, 'level', absl.level)  # Restored after.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter('always')
    library_logs.quiet_python_logs()
    warnings.warn_explicit('theirs', UserWarning, 'a.py', 1,
                           module='orbax.checkpoint')
    warnings.warn_explicit('ours', UserWarning, 'b.py', 1,
                           module='jaxformer.data.sources')
  assert [str(w.message) for w in caught] == ['ours']
  assert absl.isEnabledFor(logging.ERROR)
  assert not absl.isEnabledFor(logging.WARNING)
