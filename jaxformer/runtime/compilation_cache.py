"""JAX's persistent compilation cache, so that a restart loads its compiled
programs instead of compiling them (`jaxformer compile` keeps its reports
in the same directory: aot_cache.py).

One directory per host, local disk by default: `$XDG_CACHE_HOME/jaxformer/xla`
(`~/.cache/jaxformer/xla`). JAXFORMER_COMPILATION_CACHE names another (a
gs:// path too), or is `off`; JAX's own JAX_COMPILATION_CACHE_DIR, when set,
is kept. Entries are keyed by the program, the devices and the jax/XLA
versions, so runs of other configs or versions can share a directory; on
local disk it is capped (JAX_COMPILATION_CACHE_MAX_SIZE, default 8 GiB, the
least recently used entries go first), which makes JAX read and write it
under a file lock, so processes running at once can share it too. JAX
writes entries from process 0 only: on several hosts the others find them
only in a directory all of them read (e.g. a bucket).

JAX runs what it loads from the cache without checking it, so whoever can
write the directory runs code in every process that uses it
(docs/security.md): a local directory that others can write is refused.
"""
import collections
import importlib.util
import os
import stat

import jax

# Since `enable`: cache hits and misses (compiles that went through the
# cache; those under jax_persistent_cache_min_compile_time_secs, 1 s by
# default, are compiled every time and not written) and the compile seconds
# that hits saved.
counts = collections.Counter()
_listening = False

ENV = 'JAXFORMER_COMPILATION_CACHE'
OFF = ('off', 'none', 'false', '0')
LOCAL_MAX_BYTES = 8 * 1024 ** 3


def directory(environ=os.environ) -> str | None:
  """The cache directory the environment asks for; None when it is off."""
  chosen = environ.get(ENV)
  if chosen is not None:
    chosen = chosen.strip()
    if chosen.lower() in OFF or not chosen:
      return None
    return chosen if '://' in chosen else os.path.abspath(
        os.path.expanduser(chosen))
  if environ.get('JAX_COMPILATION_CACHE_DIR'):
    return environ['JAX_COMPILATION_CACHE_DIR']
  home = environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.path.join(home, 'jaxformer', 'xla')


class CacheError(ValueError):
  """The cache directory is not safe to load programs from."""


def _others_can_write(mode: int, itself: bool) -> bool:
  """Whether other users can add files to a directory of `mode`, or (for a
  folder above the cache, not `itself`) rename the cache: world-writable,
  and for a folder above without the sticky bit (/tmp's) that stops that."""
  return bool(mode & stat.S_IWOTH) and (itself or not mode & stat.S_ISVTX)


def check_private(path: str) -> None:
  """Raises CacheError if users other than this one (and root) can write
  the local directory `path` or replace it: it is world-writable or owned
  by another user, or a folder above it is world-writable (without the
  sticky bit)."""
  path = os.path.realpath(path)
  instead = (f'set {ENV}=DIR to a directory only the job\'s user can '
             f'write, or {ENV}=off')
  owner = os.stat(path).st_uid
  if owner not in (os.getuid(), 0):
    raise CacheError(
        f'the compilation cache {path} belongs to user {owner}, not to this '
        f'one ({os.getuid()}), and JAX runs the programs it loads from it '
        f'unchecked; {instead}')
  folder = path
  while True:
    if _others_can_write(os.stat(folder).st_mode, folder == path):
      where = '' if folder == path else f' is under {folder}, which'
      raise CacheError(
          f'the compilation cache {path}{where} is writable by every user, '
          'and JAX runs the programs it loads from it unchecked; run '
          f'`chmod o-w {folder}`, or {instead}')
    if folder == os.path.dirname(folder):
      return
    folder = os.path.dirname(folder)


def enable(environ=os.environ, jax_cache: bool = True) -> str | None:
  """Points JAX's persistent compilation cache at `directory(environ)` (or
  turns it off: also with jax_cache=False, for `jaxformer compile`, whose
  executables JAX cannot load back, see aot_cache.py); returns the
  directory. Call it before the first compile: JAX opens its cache once, at
  the first compile of the process."""
  path = directory(environ)
  if path is None or not jax_cache:
    jax.config.update('jax_enable_compilation_cache', False)
    return path
  if '://' not in path:
    os.makedirs(path, exist_ok=True)
    check_private(path)
    if (jax.config.jax_compilation_cache_max_size == -1  # Not set by the user.
        and importlib.util.find_spec('filelock')):  # JAX's lock needs it.
      jax.config.update('jax_compilation_cache_max_size', LOCAL_MAX_BYTES)
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', path)
  global _listening
  if not _listening:
    _listening = True
    jax.monitoring.register_event_listener(_count)
    jax.monitoring.register_event_duration_secs_listener(_count_seconds)
  return path


def _count(event: str, **_) -> None:
  if event.startswith('/jax/compilation_cache/cache_'):
    counts[event.rpartition('_')[2]] += 1  # 'hits', 'misses'


def _count_seconds(event: str, seconds: float, **_) -> None:
  if event == '/jax/compilation_cache/compile_time_saved_sec':
    counts['saved_seconds'] += seconds


def summary() -> str:
  """'compilation cache: N programs loaded (S s of compiling saved), M
  compiled' since `enable`."""
  hits = counts['hits']
  return (f'compilation cache: {hits} program{"s" * (hits != 1)} loaded '
          f'({max(0.0, counts["saved_seconds"]):.0f} s of compiling saved), '
          f'{counts["misses"]} compiled')
