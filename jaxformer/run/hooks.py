"""What the training loop does at its boundaries, as named hooks.

A boundary is a step after which the loop stops to look around: a multiple
of some hook's `every`, a multiple of `train.log_every`, the step where the
time budget measures the speed, the run's last step, or a step after which
a signal stops it. At every boundary the trainer writes the log window's
metrics and lets the budget re-plan, then runs the hooks that are due, in
the order they were added:

    trainer.hooks.add('ema_eval', evaluate_ema, every=config.ema.eval_every)

`fn(boundary)` runs at each multiple of `every` and at the run's last step
(`every=0`: at the last step only), as Levanter's `add_hook(fn, every=n)`.
"""
import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Boundary:
  """The step the loop has just taken, as hooks see it.

  state: the train state after `step` (on the devices).
  metrics: the metrics logged at this boundary; a hook may add its own
    (`eval_*`), which the run returns and checkpoints carry.
  last: the run's last step (`train.num_steps`, or the budget's end).
  stopping: a signal stops the run after this step.
  """
  step: int
  state: Any
  metrics: dict
  last: bool
  stopping: bool


@dataclasses.dataclass(frozen=True)
class Hook:
  """`fn` runs at every `every`-th step and at the run's last step."""
  name: str
  fn: Callable[[Boundary], None]
  every: int

  def wants(self, step: int) -> bool:
    """Whether `step` is one of this hook's (so a boundary)."""
    return bool(self.every) and step % self.every == 0

  def due(self, boundary: Boundary) -> bool:
    return boundary.last or self.wants(boundary.step)


class Hooks:
  """The named hooks of one run, in the order they run."""

  def __init__(self):
    self._hooks: list[Hook] = []

  def add(self, name: str, fn: Callable[[Boundary], None],
          every: int = 0) -> None:
    if every < 0:
      raise ValueError(f'hook {name!r}: every={every} is below 0.')
    if name in self.names():
      raise ValueError(f'A hook named {name!r} is already added.')
    self._hooks.append(Hook(name, fn, every))

  def names(self) -> list[str]:
    return [hook.name for hook in self._hooks]

  def wanted_at(self, step: int) -> bool:
    """Whether some hook makes `step` a boundary."""
    return any(hook.wants(step) for hook in self._hooks)

  def run(self, boundary: Boundary) -> list[str]:
    """Runs the hooks due at `boundary`; returns their names."""
    ran = []
    for hook in self._hooks:
      if hook.due(boundary):
        hook.fn(boundary)
        ran.append(hook.name)
    return ran
