"""Paths of workdirs and data files, local or on cloud storage (gs://...).

Everything jaxformer reads or writes goes through these helpers, which use
`etils.epath` as Orbax does: a local path behaves as with `open` and `os`; a
`gs://bucket/...` path goes through fsspec and gcsfs (a core dependency),
here and in Orbax's epath alike: importing this module sets
`EPATH_USE_TF=false` unless it is set, so that TensorFlow's GCS client is
not a second way in (it also knows no emulator at `STORAGE_EMULATOR_HOST`).
Cloud storage has objects, not directories: a remote "directory" exists
once an object lies below it, and nothing here creates buckets.

A failed remote request is an exception that the caller reports; gcsfs's
own log lines (a warning per bucket it cannot classify, a traceback per
request out of retries) are silenced unless JAXFORMER_DEBUG is set.
"""
from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import tempfile
import time

import fsspec
import numpy as np
from etils import epath

# StorageError is what paths raises; the other kinds are re-exported for
# the modules that may import only paths (`data/`, `checkpoints/manager.py`).
from jaxformer.storage.errors import (  # noqa: F401
    CheckpointError, DataError, StorageError)

os.environ.setdefault('EPATH_USE_TF', 'false')
if not os.environ.get('JAXFORMER_DEBUG'):
  # gcsfs logs its retries, and fsspec's background prefetcher a failed
  # read with its traceback, before the error is raised; the command then
  # reports it once, in one line (StorageError).
  for _client in ('gcsfs', 'fsspec'):
    logging.getLogger(_client).setLevel(logging.CRITICAL + 1)

# Other processes write to the same bucket (the tokenizer, checkpoints,
# Orbax's step markers): gcsfs must not answer from a listing it made before.
for _protocol in ('gs', 'gcs'):
  fsspec.config.conf.setdefault(_protocol, {})['use_listings_cache'] = False


def is_storage_error(error: BaseException) -> bool:
  """An OSError, or an error of the cloud storage clients (gcsfs's HTTP
  errors and aiohttp's are not all OSErrors)."""
  return isinstance(error, OSError) or type(error).__module__.startswith(
      ('gcsfs.', 'aiohttp.', 'fsspec.', 'google.api_core.', 'google.auth.',
       'google.cloud.'))


def is_remote(path: str | os.PathLike) -> bool:
  return '://' in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
  """`path` as given when remote; when local, absolute, with `~` expanded
  (what a shell does not expand, as in `--out=~/model`)."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(os.path.expanduser(path))


def join(directory: str | os.PathLike, *names: str) -> str:
  return os.fspath(epath.Path(directory).joinpath(*names))


def parent(path: str | os.PathLike) -> str:
  return os.fspath(epath.Path(absolute(path)).parent)


def bucket(path: str | os.PathLike) -> str:
  """'gs://name' of a remote path."""
  scheme, _, rest = os.fspath(path).partition('://')
  return f'{scheme}://{rest.split("/", 1)[0]}'


def exists(path: str | os.PathLike) -> bool:
  return epath.Path(path).exists()


def is_dir(path: str | os.PathLike) -> bool:
  return epath.Path(path).is_dir()


def list_dir(path: str | os.PathLike) -> list[str]:
  """Names of the entries directly in `path` ([] when there is none)."""
  path = epath.Path(path)
  try:
    return sorted(child.name for child in path.iterdir())
  except (FileNotFoundError, NotADirectoryError):
    return []


def make_dirs(path: str | os.PathLike) -> None:
  """Creates a local directory and its parents; remote: nothing to do
  (object stores create prefixes with the objects below them, and fsspec's
  makedirs would create a missing bucket)."""
  if not is_remote(path):
    os.makedirs(path, exist_ok=True)


def read_bytes(path: str | os.PathLike) -> bytes:
  return epath.Path(path).read_bytes()


def read_text(path: str | os.PathLike) -> str:
  return read_bytes(path).decode('utf-8')


def write_bytes(path: str | os.PathLike, contents: bytes) -> None:
  """Replaces `path` as a whole: a reader sees the old or the new contents,
  never a part (local: a temporary file renamed; remote: one object write)."""
  path = os.fspath(path)
  make_dirs(parent(path))
  if is_remote(path):
    epath.Path(path).write_bytes(contents)
    return
  temporary = f'{path}.tmp-{os.getpid()}'
  with open(temporary, 'wb') as f:
    f.write(contents)
    f.flush()
    os.fsync(f.fileno())  # The bytes are on disk before the name is.
  os.replace(temporary, path)


def write_text(path: str | os.PathLike, text: str) -> None:
  write_bytes(path, text.encode('utf-8'))


def open_text(path: str | os.PathLike):
  """A text stream of a file (for reading line by line)."""
  return epath.Path(path).open('r')


def open_bytes(path: str | os.PathLike):
  """A binary stream of a file (for reading line by line)."""
  return epath.Path(path).open('rb')


def stat(path: str | os.PathLike) -> tuple[int, int]:
  """(size in bytes, modification time) of a file: in nanoseconds when
  local, in seconds (what epath reports) when remote."""
  if not is_remote(path):
    result = os.stat(path)
    return result.st_size, result.st_mtime_ns
  result = epath.Path(path).stat()
  return result.length, result.mtime


def copy_to_local(path: str | os.PathLike, local: str) -> None:
  """Copies the file `path` to the local file `local` (a remote file in one
  streamed download); `local` appears whole or not at all."""
  path = os.fspath(path)
  os.makedirs(os.path.dirname(local) or '.', exist_ok=True)
  temporary = f'{local}.tmp-{os.getpid()}'
  try:
    if is_remote(path):
      filesystem, name = fsspec.core.url_to_fs(path)
      filesystem.get_file(name, temporary)
    else:
      with open(path, 'rb') as source, open(temporary, 'wb') as target:
        while chunk := source.read(1 << 24):
          target.write(chunk)
    os.replace(temporary, local)
  finally:
    if os.path.exists(temporary):
      os.remove(temporary)


def memory_map_npy(path: str | os.PathLike):
  """A local .npy file as a read-only memory-mapped array."""
  return np.load(os.fspath(path), mmap_mode='r')


def rename(source: str | os.PathLike, target: str | os.PathLike) -> None:
  epath.Path(source).rename(target)


def remove(path: str | os.PathLike) -> None:
  """Removes the file `path` (nothing to do when there is none)."""
  epath.Path(path).unlink(missing_ok=True)


def remove_tree(path: str | os.PathLike) -> None:
  """Removes the directory `path` and everything below it, if it exists."""
  epath.Path(path).rmtree(missing_ok=True)


WILDCARDS = '*?['


def matching_files(pattern: str) -> list[str]:
  """The files `pattern` names, sorted: itself when it has no wildcard
  (*, ?, [...]) or exists as named, else the files it matches (local, or
  remote through the storage client's glob)."""
  if not any(c in pattern for c in WILDCARDS) or exists(pattern):
    return [pattern]
  if not is_remote(pattern):
    return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
  filesystem, name = fsspec.core.url_to_fs(pattern)
  scheme = pattern.split('://', 1)[0]
  return sorted(f'{scheme}://{match}' for match in filesystem.glob(name)
                if filesystem.isfile(match))


@contextlib.contextmanager
def replacing(path: str | os.PathLike):
  """A binary stream whose bytes replace `path` whole once the block ends
  without an error; after an error `path` is as it was. Written to a local
  temporary file first: renamed over `path` (local), or uploaded as one
  object (remote)."""
  path = os.fspath(path)
  remote = is_remote(path)
  if not remote:
    make_dirs(parent(path))
  handle, temporary = tempfile.mkstemp(
      prefix='.' + os.path.basename(path) + '.',
      dir=None if remote else parent(path))
  try:
    with os.fdopen(handle, 'wb') as f:
      yield f
      f.flush()
      os.fsync(f.fileno())
    if remote:
      filesystem, name = fsspec.core.url_to_fs(path)
      filesystem.put_file(temporary, name)
    else:
      os.chmod(temporary, 0o666 & ~_umask())  # mkstemp's is 0600.
      os.replace(temporary, path)
  finally:
    if os.path.exists(temporary):
      os.remove(temporary)


def _umask() -> int:
  """The process's umask (read by setting it, then set back)."""
  mask = os.umask(0o022)
  os.umask(mask)
  return mask


def readable_as_umask_allows(directory: str | os.PathLike) -> None:
  """Gives a local `directory` and everything in it the modes the umask
  allows (a temporary directory is made 0700, some writers' files 0600:
  unreadable to a team sharing the filesystem); nothing for remote."""
  if is_remote(directory):
    return
  mask = _umask()
  os.chmod(directory, 0o777 & ~mask)
  for root, folders, files in os.walk(directory):
    for name in folders:
      os.chmod(os.path.join(root, name), 0o777 & ~mask)
    for name in files:
      os.chmod(os.path.join(root, name), 0o666 & ~mask)


PART_RECORDS = 64  # appends per object of a remote appendable file


class AppendableFile:
  """A file that grows by appends and is readable after each `append`
  (`read_appended`).

  Local files are appended to. Object stores cannot append, so a remote
  file is a series of objects `<path>.00000`, `<path>.00001`, ... read as
  one stream in name order: each writer starts a new part after the last
  one there, and rewrites its current part (at most PART_RECORDS appends)
  at each append, so the bytes written grow linearly with what is
  appended, and every append is durable once it returns."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if is_remote(self.path):
      self._part = _next_part(self.path)
      self._contents, self._appends = bytearray(), 0
      self._file = None
    else:
      make_dirs(parent(self.path))
      self._file = open(self.path, 'ab')

  def append(self, data: bytes) -> None:
    if self._file is not None:
      self._file.write(data)
      self._file.flush()
      return
    if self._appends == PART_RECORDS:
      self._part, self._contents, self._appends = self._part + 1, bytearray(), 0
    self._contents += data
    self._appends += 1
    epath.Path(_part_name(self.path, self._part)).write_bytes(
        bytes(self._contents))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def _part_name(path: str, number: int) -> str:
  return f'{path}.{number:05d}'


def _parts(path: str) -> list[str]:
  """The parts of the appendable file `path`, in order."""
  pattern = re.compile(re.escape(os.path.basename(path)) + r'\.(\d{5,})')
  numbered = [(int(match.group(1)), name) for name in list_dir(parent(path))
              if (match := pattern.fullmatch(name))]
  return [join(parent(path), name) for _, name in sorted(numbered)]


def _next_part(path: str) -> int:
  parts = _parts(path)
  return int(parts[-1].rsplit('.', 1)[1]) + 1 if parts else 0


def appended_exists(path: str | os.PathLike) -> bool:
  path = absolute(path)
  return exists(path) or bool(_parts(path))


def read_appended(path: str | os.PathLike) -> bytes:
  """What was appended to `path` (an AppendableFile): the file itself,
  then its remote parts. FileNotFoundError when there is neither."""
  path = absolute(path)
  pieces = [read_bytes(path)] if exists(path) else []
  pieces += [read_bytes(part) for part in _parts(path)]
  if not pieces:
    raise FileNotFoundError(f'{path} does not exist')
  return b''.join(pieces)


def check_writable(directory: str | os.PathLike) -> None:
  """Writes and removes a small object in `directory`, so that a missing,
  unreachable or read-only bucket (or directory) fails before any work,
  naming it. Raises StorageError."""
  directory = absolute(directory)
  probe = join(directory, f'.write_test_{os.getpid()}_{time.time_ns()}')
  try:
    make_dirs(directory)
    if is_remote(directory):
      epath.Path(probe).write_bytes(b'0' * 4096)
      epath.Path(probe).unlink()
      return
    with open(probe, 'wb') as f:
      f.write(b'0' * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except Exception as e:  # gcsfs and TensorFlow raise many types.
    raise StorageError(_write_failure(directory, e)) from e


def _write_failure(directory: str, error: Exception) -> str:
  reason = getattr(error, 'strerror', None) or str(error).splitlines()[0]
  if not is_remote(directory):
    return (f'Cannot write to {directory}: {reason}. Check its permissions '
            'and free disk space, or choose another --workdir.')
  return (f'Cannot write to {directory} ({type(error).__name__}: '
          f'{reason[:300]}). Check that the bucket {bucket(directory)} exists '
          'and that this machine can reach it and may write to it (gcloud '
          'storage ls ' + bucket(directory) + '), or choose another '
          '--workdir.')
