"""What the libraries below a command print on their own, kept off its
stderr, so that stderr holds jaxformer's lines and real errors only
(JAXFORMER_DEBUG=1 keeps everything).

- libtpu, where it is installed on a machine without TPU chips: every
  process that starts JAX's runtime loads it, and it prints that it cannot
  tell the host's TPU type and workers ("Failed to find host bounds ...",
  an `E0000 ... INVALID_ARGUMENT` line and a source-location trace).
  `cpu_only_without_accelerators` starts JAX on its CPU there (what it
  falls back to anyway), and `without_libtpu_host_lines` drops those lines
  where `jaxformer compile` loads libtpu on purpose, for a topology's
  compile-only devices.
- Python warnings of other libraries, and absl's warnings (Orbax logs one
  per read-only checkpoint manager a command opens): `quiet_python_logs`.
  Errors still come through.
"""
import contextlib
import glob
import importlib.metadata
import importlib.util
import logging
import os
import pkgutil
import re
import sys
import tempfile
import warnings

# Device files of TPUs (v2-v4: accel, v5 on: vfio); another device passed
# through VFIO also counts (JAX then starts as it would without us).
TPU_DEVICES = ('accel[0-9]*', 'vfio/[0-9]*')

# What libtpu prints when it starts on a host that is not a TPU VM.
LIBTPU_HOST_LINES = re.compile(
    r'Failed to find host bounds for accelerator type'
    r'|Logging before InitGoogle\(\) is written to STDERR'
    r'|could not determine TPU'
    r'|=== Source Location Trace: ==='
    r'|^\s*[\w./-]+\.cc:\d+\s*$')


def quiet(environ=os.environ) -> None:
  """All of the below for a command's process; call it before JAX starts."""
  cpu_only_without_accelerators(environ)
  quiet_python_logs()


def cpu_only_without_accelerators(environ=os.environ, dev: str = '/dev'
                                  ) -> bool:
  """Sets JAX_PLATFORMS=cpu where libtpu is installed, JAX knows no other
  platform (no GPU plugin) and no TPU is attached, unless JAX_PLATFORMS is
  set; True if it did."""
  if environ.get('JAX_PLATFORMS') or not importlib.util.find_spec('libtpu'):
    return False
  if _jax_plugins() or any(glob.glob(os.path.join(dev, pattern))
                           for pattern in TPU_DEVICES):
    return False
  environ['JAX_PLATFORMS'] = 'cpu'
  return True


def _jax_plugins() -> list[str]:
  """JAX's installed PJRT plugins (the GPU ones): modules of the
  `jax_plugins` namespace package and entry points of that group."""
  names = [entry.name for entry in
           importlib.metadata.entry_points(group='jax_plugins')]
  if importlib.util.find_spec('jax_plugins'):
    import jax_plugins
    names += [module.name
              for module in pkgutil.iter_modules(jax_plugins.__path__)]
  return names


def quiet_python_logs() -> None:
  """Other libraries' Python warnings ignored (unless -W or PYTHONWARNINGS
  choose otherwise; jaxformer's keep Python's defaults), absl's logger
  (Orbax's) from errors up."""
  if not sys.warnoptions:
    warnings.filterwarnings('ignore', module=r'(?!jaxformer(\.|$))')
  logging.getLogger('absl').setLevel(logging.ERROR)


@contextlib.contextmanager
def without_libtpu_host_lines():
  """Runs the body with the process's stderr (file descriptor 2, where
  libtpu writes) caught, then writes what it caught, less
  LIBTPU_HOST_LINES, to stderr (with JAXFORMER_DEBUG set: all of it)."""
  if os.environ.get('JAXFORMER_DEBUG'):
    yield
    return
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as caught:
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      kept = [line for line in caught.read().decode(errors='replace')
              .splitlines(keepends=True)
              if not LIBTPU_HOST_LINES.search(line)]
      sys.stderr.write(''.join(kept))
      sys.stderr.flush()
