"""One writer at a time: an exclusive lock on a path (a bulk command's
--output, a training workdir), local or on gs://.

A run that finds the lock held stops before it touches anything, with one
line naming the holder (host, pid, start time): `LockHeld`.

- Local: `filelock` (an flock on the lock file, which stays); the kernel
  releases it when its holder dies, however it dies, so a dead holder's
  lock is simply taken. The holder is described in `LOCK.holder` (JSON),
  removed at release.
- gs://: the lock object (JSON: the holder), removed at release,, created only if absent
  (an upload with `ifGenerationMatch=0`, which Cloud Storage applies
  atomically: of two runs, one creates it, the other is refused). The
  holder rewrites it every `REFRESH_SECONDS` (again under a generation
  precondition, so that a holder whose lock was taken over learns it).
  The stale-lock rule, for hosts that are preempted and never release: a
  lock not rewritten for `STALE_SECONDS`, or one naming this host and a
  process that is gone, is taken over by deleting exactly that generation
  (`ifGenerationMatch=G`: of two runs taking it over, one wins) and
  creating the object anew. A holder's clock does not matter: the age is
  the bucket's `updated` time against the bucket's own answer.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import threading
import time

from jaxformer.storage import paths

REFRESH_SECONDS = 60.0
STALE_SECONDS = 600.0


class LockHeld(RuntimeError):
  """Another run holds the lock; says which (one line)."""


def holder() -> dict:
  """This process, as a lock names its holder."""
  return dict(host=socket.gethostname(), pid=os.getpid(),
              start=datetime.datetime.now(datetime.timezone.utc).isoformat(
                  timespec='seconds'))


def held_line(what: str, path: str, by: dict | None) -> str:
  """The refusal: who holds `what`, and what to do."""
  if by:
    who = (f'host {by.get("host")}, pid {by.get("pid")}, started '
           f'{by.get("start")}')
  else:
    who = 'a run that has not yet said who it is'
  return (f'{what} is in use by another run ({who}; lock {path}); wait for '
          'it to end, or stop it, then run this again.')


def _process_is_gone(by: dict) -> bool:
  """Whether `by` names a process of this host that no longer runs."""
  if by.get('host') != socket.gethostname() or not isinstance(
      by.get('pid'), int):
    return False
  try:
    os.kill(by['pid'], 0)
  except ProcessLookupError:
    return True
  except PermissionError:
    return False
  return False


@contextlib.contextmanager
def exclusive(lock: str, what: str):
  """Holds the lock `lock` (the path of its file or object) for the block;
  `what` names the thing it guards in the refusal (e.g. '--output
  out.txt'). Raises `LockHeld` at once if another run holds it."""
  lock = os.fspath(lock)
  if paths.is_remote(lock):
    with _remote_lock(lock, what):
      yield
  else:
    with _local_lock(lock, what):
      yield


@contextlib.contextmanager
def _local_lock(lock: str, what: str):
  import filelock
  paths.make_dirs(paths.parent(lock))
  file_lock = filelock.FileLock(lock, timeout=0, thread_local=False)
  description = lock + '.holder'
  try:
    file_lock.acquire()
  except filelock.Timeout:
    try:
      by = json.loads(paths.read_text(description))
    except (OSError, ValueError):
      by = None
    raise LockHeld(held_line(what, lock, by)) from None
  try:
    paths.write_text(description, json.dumps(holder()))
    yield
  finally:
    with contextlib.suppress(OSError):
      paths.remove(description)
    file_lock.release()


def _filesystem(lock: str):
  import fsspec
  return fsspec.core.url_to_fs(lock)


def _create(filesystem, name: str, by: dict) -> bool:
  """Whether this run created the lock object (it was absent)."""
  try:
    filesystem.pipe_file(name, json.dumps(by).encode(), mode='create')
  except FileExistsError:
    return False
  return True


def _stale(filesystem, name: str) -> tuple[dict | None, int | None, bool]:
  """(the holder the lock object names, its generation, whether it is
  stale); (None, None, False) if it is gone."""
  try:
    info = filesystem.info(name)
    by = json.loads(filesystem.cat_file(name))
  except FileNotFoundError:
    return None, None, False
  except ValueError:
    by = {}
  updated = info.get('updated') or info.get('timeCreated')
  now = datetime.datetime.now(datetime.timezone.utc)
  age = (now - datetime.datetime.fromisoformat(
      updated.replace('Z', '+00:00'))).total_seconds() if updated else 0.0
  stale = age > STALE_SECONDS or _process_is_gone(by)
  return by, int(info.get('generation') or 0) or None, stale


def _delete_generation(filesystem, name: str, generation: int) -> None:
  bucket, key, _ = filesystem.split_path(name)
  with contextlib.suppress(FileNotFoundError, FileExistsError):
    filesystem.call('DELETE', 'b/{}/o/{}', bucket, key,
                    ifGenerationMatch=str(generation))


def _refresh(filesystem, name: str, generation: int) -> None:
  """Rewrites the lock's metadata (its `updated` time), if it is still
  this generation's."""
  bucket, key, _ = filesystem.split_path(name)
  filesystem.call('PATCH', 'b/{}/o/{}', bucket, key,
                  json={'metadata': {'refreshed': str(time.time())}},
                  ifGenerationMatch=str(generation))


def _acquire_remote(filesystem, name: str, lock: str, what: str,
                    by: dict) -> None:
  for _ in range(3):
    if _create(filesystem, name, by):
      return
    held_by, generation, stale = _stale(filesystem, name)
    if generation is not None and not stale:
      raise LockHeld(held_line(what, lock, held_by))
    if generation is not None:
      _delete_generation(filesystem, name, generation)
  raise LockHeld(held_line(what, lock, None))


@contextlib.contextmanager
def _remote_lock(lock: str, what: str):
  filesystem, name = _filesystem(lock)
  by = holder()
  _acquire_remote(filesystem, name, lock, what, by)
  released = threading.Event()

  generation = int(filesystem.info(name)['generation'])

  def refresh():
    while not released.wait(REFRESH_SECONDS):
      with contextlib.suppress(Exception):  # Best effort: a run that took
        _refresh(filesystem, name, generation)  # it over wins.

  thread = threading.Thread(target=refresh, daemon=True,
                            name='jaxformer-lock-refresh')
  thread.start()
  try:
    yield
  finally:
    released.set()
    thread.join(timeout=1.0)
    _delete_generation(filesystem, name, generation)
