"""What the training loop keeps between steps besides the train state, and
how it opens at a run's first (or resumed) step."""
import dataclasses
from collections.abc import Callable, Iterator

import jax
import ml_collections
import numpy as np

from jaxformer.data import mixture
from jaxformer.data import task_batches
from jaxformer.parallel.row_share import RowShare
from jaxformer.run import budget as budget_lib
from jaxformer.run import log_window
from jaxformer.run.metrics import MetricsWriter, Progress


@dataclasses.dataclass
class Loop:
  """The loop's companions: the data stream, the metrics' writers, the
  budget, and the metrics last logged (`final`, what the run returns)."""
  start_step: int
  batches: Iterator[dict[str, np.ndarray]]  # This process's rows.
  writer: MetricsWriter
  progress: Progress
  peak_flops: float  # FLOP/s of all devices.
  seconds_left: object  # For the progress line's ETA; None: no budget.
  over_budget: budget_lib.ScheduleOverBudget
  drawn: mixture.Tally  # Examples per source of a mixture.
  # (step, num_steps), ...: the budget's plan recorded up to start_step,
  # which a resumed run follows; None: train.num_steps.
  plan: tuple | None
  final: dict = dataclasses.field(default_factory=dict)  # Last logged.

  def new_progress(self, num_steps: int, step: int, enabled: bool) -> None:
    """The progress bar to a new end (the budget re-planned it)."""
    self.progress.close()
    self.progress = Progress(num_steps, step, enabled=enabled,
                             seconds_left=self.seconds_left)

  def close(self) -> None:
    self.progress.close()
    self.writer.close()


def open_loop(config: ml_collections.ConfigDict, tokenizers, share: RowShare,
              token_cache, start_step: int, budget: budget_lib.Budget,
              workdir: str, log: Callable[[str], None]) -> Loop:
  """The data stream from `start_step`, the metrics' writers and the
  budget's measuring step and the plan a resumed run follows."""
  is_main = jax.process_index() == 0
  # Measured (on a CPU) before the input pipeline's threads start.
  peak_flops = log_window.peak_flops(config.train.peak_flops, log)
  batches = task_batches.train_batches(
      config, *tokenizers, start_step=start_step,
      process_index=jax.process_index(), share=share,
      row_multiple=task_batches.row_multiple(config, share.num_shards),
      token_cache=token_cache)
  writer = MetricsWriter(workdir, enabled=is_main)
  over_budget = budget_lib.ScheduleOverBudget(budget, config.train, workdir,
                                              log)
  plan = over_budget.start(start_step)
  train = config.train
  seconds_left = budget.wall_seconds_left if train.max_minutes else None
  progress = Progress(plan[-1][1] if plan else train.num_steps, start_step,
                      enabled=is_main, seconds_left=seconds_left)
  return Loop(start_step, batches, writer, progress,
              peak_flops * jax.device_count(), seconds_left, over_budget,
              mixture.Tally(config.data), plan)
