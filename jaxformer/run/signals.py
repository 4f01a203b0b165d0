"""Stopping a run cleanly: SIGTERM (preemption, schedulers) or Ctrl-C ends
training with a checkpoint of the current step."""
import signal

import jax

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.parallel import cluster
from jaxformer.runtime import stop_clock


class StopRequested:
  """Set by SIGTERM (preemption, schedulers) or Ctrl-C; the loop saves a
  checkpoint at the current step and exits cleanly.

  Enter it before the run's setup, so a signal then ends the run cleanly
  too. Once the distributed runtime is up (with any process count, one
  included, as on a single-host TPU VM), JAX's preemption service owns
  SIGTERM (it replaces this handler when the runtime starts) and picks one
  step at which all processes stop, so all save the same step.
  """

  def __init__(self):
    self.signal_name = None
    self._agreed = False
    self._at_logged = False
    self._previous = {}

  def __enter__(self):
    # Entered after the runtime started, SIGTERM stays with JAX's service.
    ours = ((signal.SIGINT,) if cluster.runtime_started()
            else (signal.SIGTERM, signal.SIGINT))
    for sig in ours:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def join_processes(self) -> None:
    """Call once the distributed runtime is up. With several processes,
    Ctrl-C goes back to its default (a stop needs all processes to agree)."""
    if jax.process_count() > 1:
      signal.signal(signal.SIGINT, self._previous[signal.SIGINT])
      if self.signal_name == 'SIGINT':
        raise KeyboardInterrupt

  def at(self, step: int, checkpoints: checkpoint_lib.Checkpointer) -> bool:
    """Whether to save and stop after `step`; call once at every step."""
    if cluster.runtime_started() and checkpoints.reached_preemption(step):
      if not self._agreed:
        stop_clock.signalled('SIGTERM')  # JAX's service took it earlier.
      self.signal_name, self._agreed = 'Preemption notice (SIGTERM)', True
    stopping = self._agreed or self._here()
    if stopping:
      self._note(f'step {step} finished; saving it')
    return stopping

  def signalled(self) -> bool:
    """Whether a signal came in this process (no cross-process agreement:
    for a stop between two calls of `at`, such as during an evaluation)."""
    if self._here():
      self._note('the evaluation in progress finished; saving its step')
    return self._here()

  def _here(self) -> bool:
    return jax.process_count() == 1 and self.signal_name is not None

  def _note(self, phase: str) -> None:
    """The first phase of the stop, timed (runtime/stop_clock.py)."""
    if not self._at_logged:
      self._at_logged = True
      stop_clock.phase(phase)

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name
    stop_clock.signalled(self.signal_name)

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def stopped_before_training(signal_name: str,
                            checkpoints: checkpoint_lib.Checkpointer) -> str:
  """What a run stopped by `signal_name` before its first step says: what
  was (not) written, and the latest checkpoint."""
  latest = checkpoints.latest_step()
  return (f'{signal_name} received before the first step: nothing was '
          'trained and no checkpoint written (' + (
              f'the latest is step {latest}' if latest is not None
              else 'there is none yet') + f') in {checkpoints.directory}.')
