"""The time from a stop signal to the process's exit, phase by phase, and
a bound on the part after the stop's checkpoint is committed.

A scheduler gives a preempted job a grace period (30 s on TPU VMs and GKE)
before it kills it. Between SIGTERM and exit a run finishes its step (or
evaluation), saves, waits for the save to commit, reports (goodput), then
Python's exit hooks run: those of the distributed runtime, Orbax, tf.data
and others' threads. With `JAXFORMER_DEBUG` set, each phase is a line on
stderr (`jaxformer: SIGTERM +1.23 s: saved step 111`). Once the checkpoint
is committed nothing is left to lose: `bound_exit` ends the process with 0
if the rest takes over EXIT_SECONDS, naming the phase it was in, and
`leave_without_exit_hooks` skips Python's exit hooks and finalization,
which measured (test_stop_clock.py, a loaded 2-core machine) 19-30 s
after a stop at a log boundary or in an evaluation: the slow phase.
"""
from __future__ import annotations

import os
import sys
import threading
import time

EXIT_SECONDS = 10.0

_signal: tuple[str, float] | None = None  # (name, monotonic time)
_phase = 'before the signal'
_armed = False


def signalled(name: str) -> None:
  """Notes a stop signal's arrival (safe in a signal handler: no I/O)."""
  global _signal
  if _signal is None:
    _signal = (name, time.monotonic())


def phase(name: str) -> None:
  """Marks the start of phase `name`; logged with the time since the
  signal under JAXFORMER_DEBUG (nothing before a signal)."""
  global _phase
  _phase = name
  if _signal is not None and os.environ.get('JAXFORMER_DEBUG'):
    print(f'jaxformer: {_signal[0]} +{since_signal():.2f} s: {name}',
          file=sys.stderr, flush=True)


def since_signal() -> float:
  return time.monotonic() - _signal[1] if _signal else 0.0


def bounded() -> bool:
  """Whether `bound_exit` was called: a stop's checkpoint is committed."""
  return _armed


def leave_without_exit_hooks() -> None:
  """Ends the process with 0 once its checkpoint is committed: leaves the
  distributed runtime (a barrier with the other processes, so that none
  sees the coordinator vanish), then skips Python's exit hooks and the
  interpreter's finalization, where the C++ libraries' teardown (XLA's
  clients, tf.data's and Orbax's thread pools) took from 0 to 30 s on a
  busy machine; `bound_exit`'s watchdog still bounds the barrier."""
  jax = sys.modules.get('jax')
  if jax is not None:
    from jax._src import distributed
    if distributed.global_state.client is not None:
      phase('leaving the distributed runtime')
      jax.distributed.shutdown()
  phase('exit (the checkpoint is committed: no exit hooks)')
  _end_now()


def _end_now() -> None:
  """Ends the process with 0 at once, its output flushed."""
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):
      pass
  os._exit(0)


def bound_exit(seconds: float = EXIT_SECONDS) -> None:
  """After a stop's checkpoint is committed: the process ends with 0 at
  the latest `seconds` from now, saying which phase held it."""
  global _armed
  if _armed:
    return
  _armed = True

  def watch():
    time.sleep(seconds)
    print(f'jaxformer: exiting took over {seconds:.0f} s after the '
          f'checkpoint was committed (in: {_phase}); ending the process.',
          file=sys.stderr, flush=True)
    _end_now()
  threading.Thread(target=watch, daemon=True,
                   name='jaxformer-exit-bound').start()
