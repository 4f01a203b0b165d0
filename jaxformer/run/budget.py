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


class ScheduleOverBudget:
  """`train.schedule_over_budget`: the step count that the budget allows,
  measured from the first log boundary to the end of warm-up (where the
  schedules before and after agree) and fixed there, written to the workdir
  for a resumed run. Recompiling is not allowed for: the budget stops the
  run a little early, where the schedule is near 0."""

  def __init__(self, budget: Budget, train, workdir: str, log):
    """train: the `train.*` config; log: prints a line (process 0)."""
    self.budget, self.train = budget, train
    self.workdir, self.log = workdir, log
    self.measure_at = None  # The step at which to fix the count.
    self._mark = None  # (step, budget time) the measurement starts from.

  def start(self, start_step: int) -> int | None:
    """The step count fixed by an earlier run, if any; else sets the step
    at which to fix it (None when it is not wanted, or when the run resumes
    past warm-up)."""
    train = self.train
    if not (train.max_minutes and train.schedule_over_budget):
      return None
    fixed = read_steps(self.workdir)
    if fixed is not None:
      self.log(f'Training to step {fixed}, the count fixed for the '
               f'{train.max_minutes:g}-minute budget in '
               f'{paths.join(self.workdir, STEPS_FILE)}.')
      return fixed
    if start_step + train.log_every >= train.warmup_steps:
      self.log('WARNING: resumed after warm-up without '
               f'{STEPS_FILE}; the schedule stays over '
               f'train.num_steps={train.num_steps}.')
      return None
    self.measure_at = train.warmup_steps
    return None

  def at_boundary(self, step: int, last: bool) -> int | None:
    """Call at every log boundary: the step count, when fixed at `step`."""
    if self.measure_at and self._mark is None:
      self._mark = (step, self.budget.elapsed())
      return None
    if step != self.measure_at or last:
      return None
    return self._fix(step)

  def _fix(self, step: int) -> int:
    """Fixes (and writes) the step count from the time per step since the
    mark."""
    seconds = (self.budget.elapsed() - self._mark[1]) / (step - self._mark[0])
    num_steps = estimate_steps(step, seconds, self.budget.remaining())
    num_steps = max(num_steps, step + 1)
    if jax.process_count() > 1:
      num_steps = int(multihost_utils.broadcast_one_to_all(
          np.int32(num_steps)))
    max_minutes = self.train.max_minutes
    if jax.process_index() == 0:
      write_steps(self.workdir, num_steps, seconds, max_minutes)
    self.log(f'step {step}: {seconds:.3g} s per step; the '
             f'{max_minutes:g}-minute budget allows '
             f'{num_steps} steps, the schedule now ends there.')
    return num_steps
