"""`train.max_minutes`: a wall-clock budget for training, and the step
count it allows when the learning-rate schedule is to end with the budget.

The clock starts when the run starts (tokenizer training and compilation
count). With several processes, process 0's clock decides, at log
boundaries only, so that all processes stop after the same step.
"""
import json
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.storage import paths

STEPS_FILE = 'budget_steps.json'


class Budget:
  """`max_minutes` of wall-clock time from construction; 0: no budget."""

  def __init__(self, max_minutes: float, sync_every: int = 1,
               clock=time.monotonic):
    self.max_seconds = 60.0 * max_minutes
    self.sync_every = max(sync_every, 1)
    self._clock = clock
    self.start = clock()
    self._wall_start = time.monotonic()

  def elapsed(self) -> float:
    return self._clock() - self.start

  def remaining(self) -> float:
    return self.max_seconds - self.elapsed()

  def wall_seconds_left(self) -> float:
    """`remaining` by time.monotonic, for progress lines: it leaves the
    budget's own clock unread, so that only steps decide when it is spent."""
    return self._wall_start + self.max_seconds - time.monotonic()

  def spent(self, step: int) -> bool:
    """Whether to stop after `step`; call once at every step."""
    if not self.max_seconds:
      return False
    if jax.process_count() == 1:
      return self.remaining() <= 0
    if step % self.sync_every:
      return False
    over = np.int32(self.remaining() <= 0)
    return bool(multihost_utils.broadcast_one_to_all(over))


def estimate_steps(step: int, seconds_per_step: float,
                   remaining: float) -> int:
  """The last step the budget reaches: `step` plus the steps of
  `seconds_per_step` that fit in `remaining` seconds."""
  return step + int(max(remaining, 0.0) // max(seconds_per_step, 1e-9))


def read_steps(workdir: str) -> int | None:
  """The step count fixed by an earlier run in `workdir`, if any."""
  path = paths.join(workdir, STEPS_FILE)
  if not paths.exists(path):
    return None
  return int(json.loads(paths.read_text(path))['num_steps'])


def write_steps(workdir: str, num_steps: int, seconds_per_step: float,
                max_minutes: float) -> None:
  paths.write_text(paths.join(workdir, STEPS_FILE), json.dumps(
      {'num_steps': num_steps, 'seconds_per_step': seconds_per_step,
       'max_minutes': max_minutes}, indent=2))
