"""`jaxformer train`: the training loop around the jitted step.

The loop is set-up, a step, and named hooks at its boundaries:
- set-up (`run/assembly.py`): tokenizers, the `RunSpec` (what is trained,
  built as `jaxformer compile` builds it), what a resume must match, this
  host's share of the data; then the first state (`initial_state`) and the
  loop's companions (`run/loop.py`);
- a step (`_step`): the next batch dispatched, the step before counted;
- at a boundary (`run/hooks.py`): the log window written, the budget's
  re-plan, then the hooks, 'eval' (every `eval.every`, and last) and
  'checkpoint' (every `checkpoint.every`); a stop saves and ends.

Another part of a run adds its own hook:
`trainer.hooks.add(name, fn, every=n)`, `fn(boundary)`.
"""
import contextlib
import dataclasses
import time

import jax
import ml_collections

from jaxformer.checkpoints import base_params
from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.parallel import cluster
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.parallel import peers
from jaxformer.run import assembly
from jaxformer.run import averaging
from jaxformer.run import budget as budget_lib
from jaxformer.run import goodput as goodput_lib
from jaxformer.run import log_window
from jaxformer.run import tracing
from jaxformer.run.hooks import Boundary, Hooks
from jaxformer.run.loop import Loop, open_loop
from jaxformer.run.signals import StopRequested, stopped_before_training
from jaxformer.train.state import TrainState


@dataclasses.dataclass(frozen=True)
class TrainResult:
  """What a run returns: the metrics last logged (eval and goodput
  included), the final state, and whether training reached its end (the
  last step or the budget's) rather than a stop."""
  metrics: dict
  state: TrainState
  finished: bool


class Trainer:
  """A run set up in `workdir`; `train()` trains it to num_steps."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               devices=None, scorer=None):
    """`devices`: the mesh's devices in order (default: all, as
    `jax.make_mesh` orders them); `scorer`: what scores the translations
    of each evaluation beside BLEU (`run/evaluation.py` `Scorer`; needed
    with eval.comet: the cli's `comet_scorer`)."""
    start = time.monotonic()
    cluster.initialize_distributed(config.distributed)
    self.goodput = goodput_lib.Goodput(workdir, start)
    # Seconds, not the hour that the others would wait for process 0's files.
    peers.check_shared_workdir(workdir)
    peers.watch_peers(config.distributed.heartbeat_timeout)
    self.budget = budget_lib.Budget(config.train.max_minutes,
                                    sync_every=config.train.log_every)
    self.workdir = workdir
    self.is_main = jax.process_index() == 0
    self.checkpoints = checkpoint_lib.Checkpointer(workdir, config.checkpoint)
    self.goodput.watch(self.checkpoints)
    self.trace = tracing.StepTrace(config.train, workdir)
    try:
      run = assembly.assemble(config, workdir, self.checkpoints, devices,
                              scorer)
    except BaseException:
      self.checkpoints.close()  # Or its threads outlive the error.
      raise
    self.spec, self.plan = run.spec, run.plan
    self.source_tok, self.target_tok = run.tokenizers
    self.share, self.token_cache = run.plan.share, run.token_cache
    self.evaluator = run.evaluator
    self.saved_state = run.saved_state
    self.result: TrainResult | None = None
    self.loop: Loop | None = None  # While `train()` runs.
    self.hooks = Hooks()
    self.hooks.add('eval', self._evaluate_and_save, every=config.eval.every)
    self.hooks.add('checkpoint', self._save, every=config.checkpoint.every)

  # What a command reads of the run.
  config = property(lambda self: self.spec.config)
  model_config = property(lambda self: self.spec.model_config)
  task = property(lambda self: self.spec.task)
  mesh = property(lambda self: self.spec.mesh)
  # The last `run()`'s, for the callers that read them after it.
  state = property(lambda self: self.result.state)
  finished = property(lambda self: bool(self.result and self.result.finished))

  def initial_state(self) -> TrainState:
    """The latest good checkpoint's state, or a fresh one."""
    restored = self.checkpoints.restore_latest(*self.saved_state.layout)
    if restored is not None:
      self.log(f'Resuming from the checkpoint of step {int(restored.step)} '
               f'in {self.checkpoints.directory}.')
      return self.saved_state.restored(restored)
    state = self.spec.init_state()
    start = self.config.init.pretrained
    if start:
      self.log(f'Starting from the parameters of {start}.')
      state = state.started_from(base_params.pretrained_params(
          start, self.spec, state.params))
    return state

  def log(self, text: str) -> None:
    if self.is_main:
      print(text, flush=True)

  def run(self, stop: StopRequested | None = None) -> dict:
    """`train(stop)`'s metrics (the result is kept as `self.result`)."""
    self.result = self.train(stop)
    return self.result.metrics

  def train(self, stop: StopRequested | None = None) -> TrainResult:
    """Trains to num_steps, or until a signal (caught by `stop`, entered by
    the caller, or else here) or an error; checkpointing is shut down on
    every way out (a pending save completes first)."""
    try:
      scope = contextlib.nullcontext(stop) if stop else StopRequested()
      with scope as stop:
        result = self._train(stop)
    except BaseException:
      # With several processes, closing waits on the others: not on error.
      if jax.process_count() == 1:
        self.checkpoints.close()
      raise
    self.checkpoints.close()
    result.metrics.update(self.goodput.end(result.finished))
    self.log(goodput_lib.summary(result.metrics))
    return result

  def _train(self, stop: StopRequested) -> TrainResult:
    stop.join_processes()
    state = self.initial_state()
    self.loop = open_loop(self.config, (self.source_tok, self.target_tok),
                          self.share, self.token_cache, int(state.step),
                          self.budget, self.workdir, self.log)
    if self.loop.plan:
      self.spec = self.spec.with_plan(self.loop.plan)
    if stop.signalled():
      self.loop.close()
      self.log(stopped_before_training(stop.signal_name, self.checkpoints))
      return TrainResult(self.loop.final, state, False)
    start, num_steps = self.loop.start_step, self.config.train.num_steps
    self.log(f'The checkpoint of step {start} is already at '
             f'train.num_steps={num_steps}: nothing to train (raise '
             'train.num_steps to train further).' if start >= num_steps else
             f'Training steps {start + 1}-{num_steps} in {self.workdir} '
             '(the first step compiles first).')
    with mesh_lib.activate(self.mesh, self.spec.rules):
      state, finished = self._steps(state, stop)
      self.trace.stop(state)
      self.checkpoints.wait()
      if finished and self.config.eval.average_last > 1:
        state = averaging.averaged(
            state, int(state.step), self.config.eval.average_last,
            self.checkpoints, self.workdir, self.evaluate, self.loop.writer,
            self.log)
    self.loop.close()
    return TrainResult(self.loop.final, state, finished)

  def _compiled_step(self, shardings):
    return self.goodput.first_call_timed(self.spec.train_step(shardings))

  def _steps(self, state: TrainState, stop: StopRequested
             ) -> tuple[TrainState, bool]:
    """Steps from the loop's start until the last, the budget's end or a
    stop; returns the state and whether training reached its end."""
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step_fn = self._compiled_step(shardings)
    window = self._window()
    step = self.loop.start_step
    self.goodput.begin(step)
    finished = step >= self.config.train.num_steps
    while step < self.config.train.num_steps:
      step += 1
      state, out_of_time = self._step(step_fn, state, step, window)
      boundary = Boundary(
          step, state, self.loop.final,
          last=step == self.config.train.num_steps or out_of_time,
          stopping=stop.at(step, self.checkpoints))
      if not self._is_boundary(boundary):
        continue
      self._log(boundary, window)
      if self._replanned(boundary):
        step_fn = self._compiled_step(shardings)
      ran = self.hooks.run(boundary)
      # A signal during the hooks (an evaluation) stops here, saved.
      stopping = boundary.stopping or (bool(ran) and stop.signalled())
      if out_of_time and not stopping:
        self.loop.progress.log(
            f'step {step}: the {self.config.train.max_minutes:g}-minute '
            'budget is spent; training ends here.')
      if stopping:
        self._stop(step, state, stop)
        return state, finished or step >= self.config.train.num_steps
      if boundary.last:
        return state, True
      window = self._window()
    return state, finished

  def _step(self, step_fn, state: TrainState, step: int,
            window: log_window.Window) -> tuple[TrainState, bool]:
    """Dispatches step `step` on the next batch and counts it in `window`
    (which fetches the metrics of the step before); returns the state and
    whether the budget is spent."""
    local = self.goodput.timed('input', next)(self.loop.batches)
    self.loop.drawn.add(local)
    self.trace.before(step)
    state, metrics = step_fn(state, mesh_lib.global_batch(local, self.mesh))
    self.trace.after(step, metrics)
    out_of_time = self.budget.spent(step)
    window.add(step, metrics,
               log_window.real_tokens(local) * jax.process_count(),
               log_window.batch_flops(self.spec, local))
    return state, out_of_time

  def _is_boundary(self, boundary: Boundary) -> bool:
    step = boundary.step
    return (step % self.config.train.log_every == 0 or boundary.last
            or boundary.stopping or self.hooks.wanted_at(step)
            or step == self.loop.over_budget.measure_at)

  def _log(self, boundary: Boundary, window: log_window.Window) -> None:
    """Writes and shows the window's metrics as those of the boundary."""
    final = boundary.metrics
    final.clear()
    final.update(window.summary(self.loop.peak_flops))
    final.update(self.loop.drawn.take(), **self.goodput.fields())
    self.loop.writer.write(boundary.step, final)
    self.loop.progress.update(boundary.step, final)

  def _replanned(self, boundary: Boundary) -> bool:
    """Whether the budget re-planned the step count at this boundary: the
    run then trains to the plan's end, its schedule following (which
    recompiles the step: `run/budget.py`)."""
    plan = self.loop.over_budget.at_boundary(boundary.step, boundary.last)
    if plan is None:
      return False
    self.spec = self.spec.with_plan(plan)
    self.loop.new_progress(plan[-1][1], boundary.step, self.is_main)
    return True

  def _evaluate_and_save(self, boundary: Boundary) -> None:
    """The 'eval' hook: the eval split's metrics, written, shown and
    carried by a checkpoint of the step (the best one is kept by them)."""
    metrics = self.evaluate(boundary.state)
    self.loop.writer.write(boundary.step, metrics, prefix='eval_')
    self.loop.progress.log(f'step {boundary.step}: ' + ' '.join(
        f'eval_{k}={v:.4g}' for k, v in metrics.items()))
    boundary.metrics.update({f'eval_{k}': v for k, v in metrics.items()})
    self._checkpoint(boundary.step, boundary.state, boundary.metrics,
                     force=True)

  def _save(self, boundary: Boundary) -> None:
    """The 'checkpoint' hook (a step saved already is left as it is)."""
    self._checkpoint(boundary.step, boundary.state, boundary.metrics)

  def _checkpoint(self, step: int, state: TrainState, metrics: dict,
                  force: bool = False) -> None:
    """Starts saving what a checkpoint holds of `state`."""
    self.checkpoints.save(step, self.saved_state.saved(state), metrics,
                          force=force)

  def _stop(self, step: int, state: TrainState, stop: StopRequested) -> None:
    """A signal ends the run: the step is saved, and the way on said."""
    self._checkpoint(step, state, self.loop.final, force=True)
    self.checkpoints.wait()
    self.loop.progress.close()
    self.log(f'{stop.signal_name} received: saved the checkpoint of step '
             f'{step} in {self.checkpoints.directory}; run the same '
             'command again to resume.')

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


def train(config: ml_collections.ConfigDict, workdir: str,
          scorer=None) -> dict:
  """Trains (or resumes) in `workdir`; returns the last logged metrics."""
  checkpoint_lib.make_workdir(workdir)
  return Trainer(config, workdir, scorer=scorer).run()
