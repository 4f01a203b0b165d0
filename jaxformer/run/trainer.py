"""`jaxformer train`: the training loop around the jitted step.

Everything with side effects lives here: the workdir, tokenizers, the data
stream, checkpoints, metrics, evaluation and signals. What is trained (the
model, task, mesh, schedule and optimizer) is one `RunSpec`, built at
set-up as `jaxformer compile` builds it.

The loop, in steps: `_set_up` (tokenizers, the run, what a resume must
match, the host's share of the data), `initial_state`, then for each step
`_step` (dispatch, and the bookkeeping of the step before) and, at a log
boundary, `_log`, `_measure_budget`, `_evaluate_and_save` and `_ends`.
"""
import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np

from jaxformer.checkpoints import exports
from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.checkpoints import trained as trained_lib
from jaxformer.config import resume
from jaxformer.data import language_tokenizer
from jaxformer.data import mixture
from jaxformer.data import task_batches
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.parallel import cluster
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.parallel import peers
from jaxformer.run import budget as budget_lib
from jaxformer.run import goodput as goodput_lib
from jaxformer.run import host_plan
from jaxformer.run import log_window
from jaxformer.run import tracing
from jaxformer.run.evaluation import Evaluator
from jaxformer.run.metrics import MetricsWriter, Progress
from jaxformer.run.signals import StopRequested
from jaxformer.storage import paths
from jaxformer.train import run_spec
from jaxformer.train.state import TrainState
from jaxformer.train.tasks import get_task


@dataclasses.dataclass
class Loop:
  """What the loop keeps between steps besides the train state."""
  start_step: int
  batches: Iterator[dict[str, np.ndarray]]  # This process's rows.
  writer: MetricsWriter
  progress: Progress
  peak_flops: float  # FLOP/s of all devices.
  seconds_left: object  # For the progress line's ETA; None: no budget.
  over_budget: budget_lib.ScheduleOverBudget
  drawn: mixture.Tally  # Examples per source of a mixture.
  final: dict = dataclasses.field(default_factory=dict)  # Last logged.

  def close(self) -> None:
    self.progress.close()
    self.writer.close()


class Trainer:
  """Holds what a run needs between steps; `run()` trains to num_steps."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               devices=None):
    """`devices`: the mesh's devices in order (default: all, as
    `jax.make_mesh` orders them)."""
    start = time.monotonic()
    cluster.initialize_distributed(config.distributed)
    self.goodput = goodput_lib.Goodput(workdir, start)
    self.devices = devices
    # Seconds, not the hour that the others would wait for process 0's files.
    peers.check_shared_workdir(workdir)
    peers.watch_peers(config.distributed.heartbeat_timeout)
    self.budget = budget_lib.Budget(config.train.max_minutes,
                                    sync_every=config.train.log_every)
    self.finished = False
    self.workdir = workdir
    self.is_main = jax.process_index() == 0
    self.checkpoints = checkpoint_lib.Checkpointer(workdir, config.checkpoint)
    self.goodput.watch(self.checkpoints)
    self.trace = tracing.StepTrace(config.train, workdir)
    try:
      self._set_up(config)
    except BaseException:
      self.checkpoints.close()  # Or its threads outlive the error.
      raise

  # What a command reads of the run (`cli`'s report after training).
  config = property(lambda self: self.spec.config)
  model_config = property(lambda self: self.spec.model_config)
  task = property(lambda self: self.spec.task)
  mesh = property(lambda self: self.spec.mesh)

  def _set_up(self, config: ml_collections.ConfigDict) -> None:
    config, pretrained_tokenizers = trained_lib.pretrained_start(config)
    if pretrained_tokenizers:
      trained_lib.write_tokenizers(config.data, self.workdir,
                                   pretrained_tokenizers)
    # Process 0's tokenizer hash and token-cache keys are every process's.
    agree = (functools.partial(
        peers.from_process_0,
        timeout_seconds=config.data.tokenizer.get('wait_seconds', 3600))
             if jax.process_count() > 1 else None)
    tokenizers = language_tokenizer.bind_pair(*tokenizer_lib.get_or_train(
        config.data, self.workdir, agree=agree,
        with_labels=get_task(config.task).label is not None), config.data)
    self.source_tok, self.target_tok = tokenizers
    self.spec = run_spec.RunSpec.build(
        config, run_spec.run_mesh(config, self.devices), tokenizers)
    self._resume_and_plan()
    self.token_cache = token_cache_lib.directory(self.config.data,
                                                 self.workdir)
    if agree and self.token_cache:
      self.token_cache = token_cache_lib.SharedCache(self.token_cache, agree)
    self.evaluator = Evaluator(self.spec, tokenizers, self.share,
                               self.token_cache)
    self._check_splits()

  def _resume_and_plan(self) -> None:
    """Checks that the newest checkpoint's config and data order may be
    resumed with (`config/resume.py`), writes the run's config, and lays
    out this host's part of the run: layout and batch shapes are checked
    now, not hours in at a first use, by the code `jaxformer compile` runs
    for every host of a pod."""
    resume.check_compatible(self.checkpoints, self.config,
                            resume.option_defaults())
    self.checkpoints.set_extra(self.config, (self.source_tok, self.target_tok))
    if self.is_main:
      paths.write_text(paths.join(self.workdir, 'config.json'),
                       self.config.to_json_best_effort(indent=2))
    self.plan = host_plan.plan_host(self.config, self.mesh,
                                    jax.process_index())
    self.share = self.plan.share
    resume.use_data_order(self.checkpoints, self.plan.data_order,
                          self.config.data.allow_new_data_order)

  def _check_splits(self) -> None:
    """Reads the splits evaluated during and after training now, so that a
    missing or bad file is reported before any training time is spent."""
    task_batches.check_train_files(self.config, jax.process_index(),
                                   self.token_cache)
    splits = {self.config.eval.split}
    if self.task.translates and self.config.eval.final_split:
      splits.add(self.config.eval.final_split)
    for split in sorted(splits):
      next(iter(self.evaluator.batches(split)), None)

  def initial_state(self) -> TrainState:
    """The latest good checkpoint's state, or a fresh one."""
    restored = self.checkpoints.restore_latest(*self.spec.state_layout)
    if restored is not None:
      self.log(f'Resuming from the checkpoint of step {int(restored.step)} '
               f'in {self.checkpoints.directory}.')
      return restored
    state = self.spec.init_state()
    start = self.config.init.pretrained
    if start:
      self.log(f'Starting from the parameters of {start}.')
      state = state.started_from(trained_lib.pretrained_params(
          start, self.spec, state.params))
    return state

  def log(self, text: str) -> None:
    if self.is_main:
      print(text, flush=True)

  def run(self, stop: StopRequested | None = None) -> dict:
    """Trains to num_steps, or until a signal (caught by `stop`, entered by
    the caller, or else here) or an error; checkpointing is shut down on
    every way out (a pending save completes first)."""
    try:
      scope = contextlib.nullcontext(stop) if stop else StopRequested()
      with scope as stop:
        final = self._run(stop)
    except BaseException:
      # With several processes, closing waits on the others: not on error.
      if jax.process_count() == 1:
        self.checkpoints.close()
      raise
    self.checkpoints.close()
    final.update(self.goodput.end(self.finished))
    self.log(goodput_lib.summary(final))
    return final

  def _run(self, stop: StopRequested) -> dict:
    stop.join_processes()
    state = self.initial_state()
    loop = self._open_loop(int(state.step))
    if stop.signalled():
      loop.close()
      self.state = state
      latest = self.checkpoints.latest_step()
      self.log(f'{stop.signal_name} received before the first step: nothing '
               'was trained and no checkpoint written (' + (
                   f'the latest is step {latest}' if latest is not None
                   else 'there is none yet') + f') in '
               f'{self.checkpoints.directory}.')
      return loop.final
    num_steps = self.config.train.num_steps
    if loop.start_step >= num_steps:
      self.log(f'The checkpoint of step {loop.start_step} is already at '
               f'train.num_steps={num_steps}: nothing to train (raise '
               'train.num_steps to train further).')
    else:
      self.log(f'Training steps {loop.start_step + 1}-{num_steps} in '
               f'{self.workdir} (the first step compiles first).')
    with mesh_lib.activate(self.mesh, self.spec.rules):
      state, step = self._train(state, loop, stop)
      self.trace.stop(state)
      self.checkpoints.wait()
      self.finished = self.finished or step >= self.config.train.num_steps
      if self.finished and self.config.eval.average_last > 1:
        state = self._averaged(state, step, loop.writer)
    loop.close()
    self.state = state
    return loop.final

  def _open_loop(self, start_step: int) -> Loop:
    """The data stream from `start_step`, the metrics' writers and the
    budget's measuring step (which may fix the step count)."""
    peak_flops = log_window.peak_flops(self.config.train.peak_flops, self.log)
    batches = task_batches.train_batches(
        self.config, self.source_tok, self.target_tok, start_step=start_step,
        process_index=jax.process_index(), share=self.share,
        row_multiple=task_batches.row_multiple(self.config,
                                               self.share.num_shards),
        token_cache=self.token_cache)
    writer = MetricsWriter(self.workdir, enabled=self.is_main)
    over_budget = budget_lib.ScheduleOverBudget(
        self.budget, self.config.train, self.workdir, self.log)
    plan = over_budget.start(start_step)
    if plan:
      self.spec = self.spec.with_plan(plan)
    train = self.config.train
    seconds_left = (self.budget.wall_seconds_left if train.max_minutes
                    else None)
    progress = Progress(train.num_steps, start_step, enabled=self.is_main,
                        seconds_left=seconds_left)
    return Loop(start_step, batches, writer, progress,
                peak_flops * jax.device_count(), seconds_left, over_budget,
                mixture.Tally(self.config.data))

  def _train(self, state: TrainState, loop: Loop, stop: StopRequested
             ) -> tuple[TrainState, int]:
    """Steps from `loop.start_step` until the last, the budget's end or a
    stop; returns the state and its step."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step_fn = self.goodput.first_call_timed(self.spec.train_step(shardings))
    window = self._window()
    step = loop.start_step
    self.goodput.begin(step)
    while step < self.config.train.num_steps:
      step += 1
      state, out_of_time, stopping = self._step(step_fn, state, step, loop,
                                                window, stop)
      last = step == self.config.train.num_steps or out_of_time
      if not (step % self.config.train.log_every == 0 or last or stopping
              or step == loop.over_budget.measure_at or self._eval_due(step)
              or self.checkpoints.due(step)):
        continue
      self._log(step, window, loop)
      if self._measure_budget(step, last, loop):
        step_fn = self.goodput.first_call_timed(
            self.spec.train_step(shardings))
      stopping = self._evaluate_and_save(state, step, last, stopping, stop,
                                         loop)
      if self._ends(step, last, out_of_time, stopping, stop, loop):
        break
      window = self._window()
    return state, step

  def _step(self, step_fn, state: TrainState, step: int, loop: Loop,
            window: log_window.Window, stop: StopRequested
            ) -> tuple[TrainState, bool, bool]:
    """Dispatches step `step` on the next batch and counts it in `window`
    (which fetches the metrics of the step before); returns the state,
    whether the budget is spent and whether to stop after it."""
    local = self.goodput.timed('input', next)(loop.batches)
    loop.drawn.add(local)
    self.trace.before(step)
    state, metrics = step_fn(state, mesh_lib.global_batch(local, self.mesh))
    self.trace.after(step, metrics)
    out_of_time = self.budget.spent(step)
    window.add(step, metrics,
               log_window.real_tokens(local) * jax.process_count(),
               log_window.batch_flops(self.spec, local))
    return state, out_of_time, stop.at(step, self.checkpoints)

  def _log(self, step: int, window: log_window.Window, loop: Loop) -> None:
    """Writes and shows the window's metrics as those of `step`."""
    loop.final = window.summary(loop.peak_flops)
    loop.final.update(loop.drawn.take(), **self.goodput.fields())
    loop.writer.write(step, loop.final)
    loop.progress.update(step, loop.final)

  def _measure_budget(self, step: int, last: bool, loop: Loop) -> bool:
    """At a log boundary: whether the budget (re-)planned the step count now
    (the schedule and optimizer follow it)."""
    plan = loop.over_budget.at_boundary(step, last)
    if plan is None:
      return False
    self.spec = self.spec.with_plan(plan)
    loop.progress.close()
    loop.progress = Progress(plan[-1][1], step, enabled=self.is_main,
                             seconds_left=loop.seconds_left)
    return True

  def _evaluate_and_save(self, state: TrainState, step: int, last: bool,
                         stopping: bool, stop: StopRequested,
                         loop: Loop) -> bool:
    """Evaluates when due (or last) and saves a checkpoint when due, at an
    evaluation or on a stop; returns whether to stop (a signal during the
    evaluation stops here, at the saved step)."""
    if self._eval_due(step) or last:
      metrics = self.evaluate(state)
      loop.writer.write(step, metrics, prefix='eval_')
      loop.progress.log(f'step {step}: ' + ' '.join(
          f'eval_{k}={v:.4g}' for k, v in metrics.items()))
      loop.final.update({f'eval_{k}': v for k, v in metrics.items()})
      self.checkpoints.save(step, state, loop.final, force=True)
      return stopping or stop.signalled()
    if self.checkpoints.due(step) or stopping:
      self.checkpoints.save(step, state, loop.final, force=stopping)
    return stopping

  def _ends(self, step: int, last: bool, out_of_time: bool, stopping: bool,
            stop: StopRequested, loop: Loop) -> bool:
    """Whether training ends after `step`, saying why."""
    if out_of_time and not stopping:
      loop.progress.log(f'step {step}: the '
                        f'{self.config.train.max_minutes:g}-minute budget '
                        'is spent; training ends here.')
    if last and not stopping:
      self.finished = True
      return True
    if stopping:
      self.checkpoints.wait()
      loop.progress.close()
      self.log(f'{stop.signal_name} received: saved the checkpoint of step '
               f'{step} in {self.checkpoints.directory}; run the same '
               'command again to resume.')
    return stopping

  def _averaged(self, state: TrainState, step: int,
                writer: MetricsWriter) -> TrainState:
    """`state` with the mean parameters of the last `eval.average_last`
    checkpoints (the final one included), evaluated, logged and exported to
    WORKDIR/average_<first>-<last> for `jaxformer translate`."""
    steps = self.checkpoints.all_steps()[-self.config.eval.average_last:]
    if len(steps) < 2:
      self.log(f'Only the checkpoint of step {steps} exists: nothing to '
               'average.')
      return state
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        state.params)
    reader = checkpoint_lib.Checkpointer.reader(self.workdir)
    state = state.replace(
        params=exports.mean_params(reader, steps, abstract))
    metrics = self.evaluate(state)
    writer.write(step, metrics, prefix='eval_average_')
    out = paths.join(self.workdir, f'average_{steps[0]}-{steps[-1]}')
    if not paths.exists(out):
      exports.export_params(out, state.params, dict(
          self.checkpoints.extra, steps=steps,
          source=self.checkpoints.directory))
    self.log(f'Averaged the checkpoints of steps {steps} (exported to {out}): '
             + ' '.join(f'eval_{k}={v:.4g}' for k, v in metrics.items()))
    return state

  def _eval_due(self, step: int) -> bool:
    every = self.config.eval.every
    return bool(every) and step % every == 0

  def _window(self) -> log_window.Window:
    return log_window.Window(self.config.train.nan_policy, self._last_good)

  def _last_good(self) -> str:
    """The last good checkpoint, once pending saves are done."""
    self.checkpoints.wait()
    return (f'step {self.checkpoints.latest_step()} in '
            f'{self.checkpoints.directory}')

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Eval metrics of the parameters (and of their average: ema_*)."""
    with self.goodput.timing('eval'):
      return self.evaluator.of_state(state)


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) in `workdir`; returns the last logged metrics."""
  checkpoint_lib.make_workdir(workdir)
  return Trainer(config, workdir).run()
