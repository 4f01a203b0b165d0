"""`train.max_minutes`: a wall-clock budget for training, and the step
count it allows when the learning-rate schedule is to end with the budget.

The clock starts when the run starts (tokenizer training and compilation
count). With several processes, process 0's clock decides, at log
boundaries only, so that all processes stop after the same step.
"""
import json
import math
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.storage import paths
from jaxformer.train import schedule as schedules

STEPS_FILE = 'budget_steps.json'


class Budget:
  """`max_minutes` of wall-clock time from construction; 0: no budget."""

  def __init__(self, max_minutes: float, sync_every: int = 1,
               clock=time.monotonic):
    self.max_seconds = 60.0 * max_minutes
    self.sync_every = max(sync_every, 1)
    self._clock = clock
    self.start = clock()
    self.seconds = 0.0  # Elapsed at the latest `spent`.
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
    """Whether to stop after `step`; call once at every step (it reads the
    clock once, into `seconds`)."""
    if not self.max_seconds:
      return False
    self.seconds = self.elapsed()
    over = self.seconds >= self.max_seconds
    if jax.process_count() == 1:
      return over
    if step % self.sync_every:
      return False
    return bool(multihost_utils.broadcast_one_to_all(np.int32(over)))


def estimate_steps(step: int, seconds_per_step: float,
                   remaining: float) -> int:
  """The last step the budget reaches: `step` plus the steps of
  `seconds_per_step` that fit in `remaining` seconds."""
  return step + int(max(remaining, 0.0) // max(seconds_per_step, 1e-9))


def read_plan(workdir: str, warmup_steps: int) -> list[dict]:
  """The plan recorded by earlier runs in `workdir` (`ScheduleOverBudget`):
  [{step, num_steps, seconds_per_step, at (the fraction passed)}, ...]; []
  if none. A file of a
  version without re-plans holds one count, fixed at the end of warm-up."""
  path = paths.join(workdir, STEPS_FILE)
  if not paths.exists(path):
    return []
  recorded = json.loads(paths.read_text(path))
  return recorded.get('plan') or [dict(
      step=warmup_steps, num_steps=int(recorded['num_steps']),
      seconds_per_step=recorded['seconds_per_step'], at=0.0)]


def write_plan(workdir: str, plan: list[dict], max_minutes: float) -> None:
  paths.write_text(paths.join(workdir, STEPS_FILE), json.dumps(
      {'num_steps': plan[-1]['num_steps'],
       'seconds_per_step': plan[-1]['seconds_per_step'],
       'max_minutes': max_minutes, 'plan': plan}, indent=2))


class ScheduleOverBudget:
  """`train.schedule_over_budget`: the step count that the budget allows,
  measured at the end of warm-up (where the schedules before and after
  agree), then re-planned at the first log boundary where the budget's time
  or the decay passes each of `REPLAN_AT`: the step time since the last
  plan gives the steps that fit in the budget left, and the decay's
  remaining part is stretched or shrunk to end there
  (`schedules.replanned_cosine_schedule`). Each plan is recorded in the
  workdir; a resumed run follows the plan recorded up to its step and
  re-plans only after it (over its own budget), so the schedule is a
  function of the step and the recorded plan.

  The plan is static in the train step, so a plan that moves the end
  recompiles it (a few times a run; each compile's time is measured and
  set aside in the next plan): passing it as traced values would change the
  step's signature and every program `jaxformer compile` checks. A re-plan
  within 1% of the steps left keeps the end, and the compiled step.
  """

  REPLAN_AT = (0.25, 0.5, 0.75, 0.9)  # Of the budget's time or the decay.

  def __init__(self, budget: Budget, train, workdir: str, log):
    """train: the `train.*` config; log: prints a line (process 0)."""
    self.budget, self.train = budget, train
    self.workdir, self.log = workdir, log
    self.measure_at = None  # A step at which to (re-)plan, if not sooner.
    self.entries = []  # The plan: [{step, num_steps, seconds_per_step, at}].
    self._mark = None  # (step, budget seconds) the measurement starts from.
    self._base = None  # (step, seconds) of the last plan or the start: the
    # steps from it to the mark hold a compile.

  def plan(self) -> tuple[tuple[int, int], ...]:
    return tuple((e['step'], e['num_steps']) for e in self.entries)

  def start(self, start_step: int) -> tuple[tuple[int, int], ...] | None:
    """The plan recorded up to `start_step`, if any (`RunSpec.with_plan`);
    arms the next plan (none when not wanted, or when the run resumes past
    warm-up without a plan)."""
    train = self.train
    if not (train.max_minutes and train.schedule_over_budget):
      return None
    self._base = (start_step, self.budget.seconds)
    self.entries = [e for e in read_plan(self.workdir, train.warmup_steps)
                    if e['step'] <= start_step]
    if self.entries:
      self.measure_at = self._next_point()
      self.log(f'Training to step {self.entries[-1]["num_steps"]}, the plan '
               f'for the {train.max_minutes:g}-minute budget in '
               f'{paths.join(self.workdir, STEPS_FILE)}.')
      return self.plan()
    if start_step + train.log_every >= train.warmup_steps:
      self.log('WARNING: resumed after warm-up without '
               f'{STEPS_FILE}; the schedule stays over '
               f'train.num_steps={train.num_steps}.')
      self._base = None
      return None
    self.measure_at = train.warmup_steps
    return None

  def at_boundary(self, step: int, last: bool
                  ) -> tuple[tuple[int, int], ...] | None:
    """Call at every log boundary: the new plan, when it moves the end at
    `step`."""
    if self._base is None or last:
      return None
    if self._mark is None:  # The first boundary since the last plan.
      self._mark = (step, self.budget.seconds)
      return None
    if not self.entries:
      return self._replan(step, 0.0) if step == self.measure_at else None
    passed = [f for f in self.REPLAN_AT
              if self.entries[-1]['at'] < f <= self._reached(step)]
    index = self.REPLAN_AT.index(passed[-1]) if passed else -1
    if jax.process_count() > 1:  # Process 0's clock decides, for all.
      index = int(multihost_utils.broadcast_one_to_all(np.int32(index)))
    return self._replan(step, self.REPLAN_AT[index]) if index >= 0 else None

  def _reached(self, step: int) -> float:
    """The larger of the budget's time and the decay's progress passed."""
    segments = schedules.decay_segments(self.plan())
    return max(self.budget.seconds / self.budget.max_seconds,
               schedules.decay_progress(segments, step))

  def _next_point(self) -> int | None:
    """The step where the decay passes the next of `REPLAN_AT`, unless the
    budget's time passes it sooner."""
    at = self.entries[-1].get('at', 0.0)
    fractions = [f for f in self.REPLAN_AT if f > at]
    if not fractions:
      return None
    start, progress, end = schedules.decay_segments(self.plan())[-1]
    return start + math.ceil(
        (fractions[0] - progress) / (1 - progress) * (end - start))

  def _replan(self, step: int, at: float
              ) -> tuple[tuple[int, int], ...] | None:
    """Plans (and records) the step count from the step time since the
    mark; returns the plan if it moved the end."""
    (mark, at_mark), now = self._mark, self.budget.seconds
    seconds = (now - at_mark) / (step - mark)
    compile_seconds = 0.0
    if self.entries:
      compile_seconds = max(0.0, at_mark - self._base[1]
                            - (mark - self._base[0]) * seconds)
    num_steps = max(estimate_steps(
        step, seconds, self.budget.max_seconds - now - compile_seconds),
        step + 1)
    if jax.process_count() > 1:
      num_steps = int(multihost_utils.broadcast_one_to_all(
          np.int32(num_steps)))
    old = self.entries[-1]['num_steps'] if self.entries else None
    if old is not None and abs(num_steps - old) <= max(1, (old - step) / 100):
      num_steps = old
    self.entries.append(dict(step=step, num_steps=num_steps,
                             seconds_per_step=seconds, at=at))
    max_minutes = self.train.max_minutes
    if jax.process_index() == 0:
      write_plan(self.workdir, self.entries, max_minutes)
    self._base, self._mark = (step, now), None
    self.measure_at = self._next_point()
    self.log(f'step {step}: {seconds:.3g} s per step; the '
             f'{max_minutes:g}-minute budget allows {num_steps} steps' + (
                 ', the schedule now ends there.' if num_steps != old
                 else ', as planned.'))
    return self.plan() if num_steps != old else None
