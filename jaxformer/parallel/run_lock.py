"""One run at a time on a workdir or an output: process 0 holds the lock
(storage/locks.py) for the run, and every process of the run learns
whether it got it, so that a refused run stops everywhere with the same
line before it touches anything."""
from __future__ import annotations

import contextlib

import jax

from jaxformer.parallel import peers
from jaxformer.storage import locks

WAIT_SECONDS = 600  # For process 0's answer (it may be reading storage).


@contextlib.contextmanager
def one_writer(lock: str, what: str):
  """Holds the lock `lock` (a path, local or gs://) in process 0 for the
  block; raises `locks.LockHeld` on every process if another run holds it.
  `what` names the thing locked in that line (e.g. '--workdir runs/a').
  Once per run: the processes agree on process 0's answer under one fixed
  name, since each may spell `lock` differently (a workdir they do not
  share is named by the probe after this, in seconds)."""
  with contextlib.ExitStack() as stack:
    if jax.process_count() == 1:
      stack.enter_context(locks.exclusive(lock, what))
      yield
      return

    def take() -> str:
      try:
        stack.enter_context(locks.exclusive(lock, what))
      except locks.LockHeld as held:
        return f'held:{held}'
      return 'ok'
    answer = peers.from_process_0('one_writer', take, WAIT_SECONDS,
                                  'ok|held:[^\n]{1,4000}')
    if answer != 'ok':
      raise locks.LockHeld(answer.removeprefix('held:'))
    yield
