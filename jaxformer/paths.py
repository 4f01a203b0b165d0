"""Paths of workdirs and data files, local or on cloud storage (gs://...).

Everything jaxformer reads or writes goes through these helpers, which use
`etils.epath` as Orbax does: a local path behaves as with `open` and `os`; a
`gs://bucket/...` path goes through `tf.io.gfile`, or through fsspec/gcsfs
when `EPATH_USE_TF=false` (which is how the tests reach a GCS emulator at
`STORAGE_EMULATOR_HOST`). Cloud storage has objects, not directories: a
remote "directory" exists once an object lies below it, and nothing here
creates buckets.
"""
from __future__ import annotations

import logging
import os
import time

import fsspec
import numpy as np
from etils import epath

# Other processes write to the same bucket (the tokenizer, checkpoints,
# Orbax's step markers): gcsfs must not answer from a listing it made before.
for _protocol in ('gs', 'gcs'):
  fsspec.config.conf.setdefault(_protocol, {})['use_listings_cache'] = False


class StorageError(OSError):
  """A path that cannot be read or written as asked; says which and why."""


def is_remote(path: str | os.PathLike) -> bool:
  return '://' in os.fspath(path)


def absolute(path: str | os.PathLike) -> str:
  """`path` as given when remote, made absolute when local."""
  path = os.fspath(path)
  return path if is_remote(path) else os.path.abspath(path)


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


def read_ranges(path: str | os.PathLike, starts, ends) -> list[bytes]:
  """Bytes [start, end) of a file for each pair of `starts` and `ends`; a
  remote file's ranges are fetched concurrently (fsspec's cat_ranges)."""
  path = os.fspath(path)
  if not is_remote(path):
    with open(path, 'rb') as f:
      return [os.pread(f.fileno(), int(end) - int(start), int(start))
              for start, end in zip(starts, ends)]
  filesystem, name = fsspec.core.url_to_fs(path)
  return filesystem.cat_ranges([name] * len(starts), [int(s) for s in starts],
                               [int(e) for e in ends])


def memory_map_npy(path: str | os.PathLike):
  """A local .npy file as a read-only memory-mapped array."""
  return np.load(os.fspath(path), mmap_mode='r')


def rename(source: str | os.PathLike, target: str | os.PathLike) -> None:
  epath.Path(source).rename(target)


class AppendableFile:
  """A file that grows by appends and is readable after each `append`.

  Local files are appended to. Object stores cannot append, so a remote file
  is kept in memory (with what it held before) and rewritten as a whole."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    if is_remote(self.path):
      self._contents = bytearray(read_bytes(self.path) if exists(self.path)
                                 else b'')
      self._file = None
    else:
      make_dirs(parent(self.path))
      self._file = open(self.path, 'ab')

  def append(self, data: bytes) -> None:
    if self._file is not None:
      self._file.write(data)
      self._file.flush()
    else:
      self._contents += data
      epath.Path(self.path).write_bytes(bytes(self._contents))

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def check_writable(directory: str | os.PathLike) -> None:
  """Writes and removes a small object in `directory`, so that a missing,
  unreachable or read-only bucket (or directory) fails before any work,
  naming it. Raises StorageError."""
  directory = absolute(directory)
  probe = join(directory, f'.write_test_{os.getpid()}_{time.time_ns()}')
  # gcsfs logs each failed request with a traceback; the error says it all.
  client_log = logging.getLogger('gcsfs')
  level = client_log.level
  client_log.setLevel(logging.CRITICAL)
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
  finally:
    client_log.setLevel(level)


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
