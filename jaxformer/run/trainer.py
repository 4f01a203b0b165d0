"""`jaxformer train`: the training loop around the jitted step.

Everything with side effects lives here: the workdir, tokenizers, the data
stream, checkpoints, metrics, evaluation and signals.
"""
import dataclasses
import functools
import signal
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.checkpoints import exports
from jaxformer.inference import evaluate as evaluate_lib
from jaxformer.run import host_plan
from jaxformer.parallel import peers
from jaxformer.parallel import cluster
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.storage import paths
from jaxformer.checkpoints import trained as trained_lib
from jaxformer.data import defaults as data_config_lib
from jaxformer.data import mixture
from jaxformer.data import task_batches
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.model import config as model_config_lib
from jaxformer.train.tasks import get_task
from jaxformer.run import budget as budget_lib
from jaxformer.train import flops as flops_lib
from jaxformer.train import loss as losses
from jaxformer.train import schedule as schedules
from jaxformer.run.metrics import MetricsWriter, Progress
from jaxformer.train.state import TrainState, create_train_state
from jaxformer.train.step import compile_eval_step, compile_train_step


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN or Inf."""


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
      self.signal_name, self._agreed = 'Preemption notice (SIGTERM)', True
    return self._agreed or self.signalled()

  def signalled(self) -> bool:
    """Whether a signal came in this process (no cross-process agreement:
    for a stop between two calls of `at`, such as during an evaluation)."""
    return jax.process_count() == 1 and self.signal_name is not None

  def _handle(self, signum, frame):
    del frame
    self.signal_name = signal.Signals(signum).name

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)


def with_vocabulary(config: ml_collections.ConfigDict, source_tok,
                    target_tok) -> ml_collections.ConfigDict:
  """The model's vocabulary sizes and special ids (padding, end of
  sentence) follow the tokenizers."""
  if source_tok.pad_id != target_tok.pad_id:
    raise tokenizer_lib.sources.DataError(
        f'the source vocabulary pads with id {source_tok.pad_id}, the '
        f'target one with {target_tok.pad_id}; the model has one pad id')
  config = ml_collections.ConfigDict(config.to_dict())
  config.model.vocab_size = source_tok.vocab_size
  config.model.target_vocab_size = (
      0 if target_tok.vocab_size == source_tok.vocab_size
      else target_tok.vocab_size)
  config.model.pad_id = source_tok.pad_id
  config.model.eos_id = target_tok.eos_id
  return config


def write_tokenizers(data_config: ml_collections.ConfigDict, workdir: str,
                     tokenizers) -> None:
  """Process 0 writes a pretrained model's tokenizers [source, target]
  where the run keeps its own (unless there already)."""
  models = tokenizer_lib.model_paths(data_config, workdir)
  if jax.process_index() != 0 or all(map(paths.exists, models)):
    return
  for path, tokenizer in zip(models, tokenizers):
    paths.write_bytes(path, tokenizer.serialized_model_proto())


def with_labels(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Classification: `data.labels` (the train split's sorted labels unless
  given) and `model.num_classes` to match; other tasks are unchanged."""
  if not get_task(config.task).labels_from_data:
    return config
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.labels = task_batches.labels_of(config.data)
  config.model.num_classes = len(config.data.labels)
  return config


def measure_peak_flops(seconds: float = 0.5) -> float:
  """FLOP/s of one device on a large float32 matmul (bf16 on accelerators)."""
  device = jax.devices()[0]
  dtype = jnp.float32 if device.platform == 'cpu' else jnp.bfloat16
  n = 1024 if device.platform == 'cpu' else 8192
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  count, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    matmul(a).block_until_ready()
    count += 1
  return 2 * n ** 3 * count / (time.perf_counter() - start)


class Trainer:
  """Holds what a run needs between steps; `run()` trains to num_steps."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str,
               devices=None):
    """`devices`: the mesh's devices in order (default: all, as
    `jax.make_mesh` orders them)."""
    cluster.initialize_distributed(config.distributed)
    self.devices = devices
    # Seconds, not the hour that the others would wait for process 0's files.
    peers.check_shared_workdir(workdir)
    peers.watch_peers(config.distributed.heartbeat_timeout)
    self.budget = budget_lib.Budget(config.train.max_minutes,
                                    sync_every=config.train.log_every)
    self.finished = False
    self.workdir = workdir
    self.is_main = jax.process_index() == 0
    self._eval_fn = None
    self.checkpoints = checkpoint_lib.Checkpointer(workdir, config.checkpoint)
    try:
      self._set_up(config)
    except BaseException:
      self.checkpoints.close()  # Or its threads outlive the error.
      raise

  def _set_up(self, config: ml_collections.ConfigDict) -> None:
    workdir = self.workdir
    config, pretrained_tokenizers = trained_lib.pretrained_start(config)
    if pretrained_tokenizers:
      write_tokenizers(config.data, workdir, pretrained_tokenizers)
    # Process 0's tokenizer hash and token-cache keys are every process's.
    agree = (functools.partial(
        peers.from_process_0,
        timeout_seconds=config.data.tokenizer.get('wait_seconds', 3600))
             if jax.process_count() > 1 else None)
    self.source_tok, self.target_tok = tokenizer_lib.get_or_train(
        config.data, workdir, agree=agree)
    self.config = with_labels(
        with_vocabulary(config, self.source_tok, self.target_tok))
    self.checkpoints.check_compatible(self.config, defaults=dict(
        model=dataclasses.asdict(model_config_lib.ModelConfig()),
        data=data_config_lib.default_data_config().to_dict()))
    self.checkpoints.set_extra(self.config, (self.source_tok, self.target_tok))
    if self.is_main:
      paths.write_text(paths.join(workdir, 'config.json'),
                       self.config.to_json_best_effort(indent=2))
    self.model_config = model_config_lib.from_config_dict(self.config.model)
    self.task = get_task(self.config.task)
    self.rules = self.config.mesh.axis_rules
    # Layout and batch shapes are checked now, not hours in at a first use,
    # by the code `jaxformer compile` runs for every host of a pod.
    self.plan = host_plan.plan_host(self.config,
                                    host_plan.run_mesh(self.config,
                                                       self.devices),
                                    jax.process_index())
    self.mesh, self.share = self.plan.mesh, self.plan.share
    self.checkpoints.use_data_order(self.plan.data_order,
                                    self.config.data.allow_new_data_order)
    self._set_num_steps(self.config.train.num_steps)
    self.example_batch = self.task.example_batch(self.config)
    self.token_cache = token_cache_lib.directory(self.config.data, workdir)
    if agree and self.token_cache:
      self.token_cache = token_cache_lib.SharedCache(self.token_cache, agree)
    self._check_splits()

  def _check_splits(self) -> None:
    """Reads the splits evaluated during and after training now, so that a
    missing or bad file is reported before any training time is spent."""
    task_batches.check_train_files(self.config, jax.process_index(),
                                   self.token_cache)
    splits = {self.config.eval.split}
    if self.task.translates and self.config.eval.final_split:
      splits.add(self.config.eval.final_split)
    for split in sorted(splits):
      next(iter(task_batches.eval_batches(
          self.config, self.source_tok, self.target_tok, split,
          process_index=jax.process_index(), share=self.share,
          token_cache=self.token_cache)), None)

  def _set_num_steps(self, num_steps: int) -> None:
    """The step count, and the schedule and optimizer that follow it."""
    self.config.train.num_steps = num_steps
    self.schedule = schedules.make_schedule(self.config.train,
                                            self.model_config.d_model)
    self.tx = schedules.make_optimizer(self.config.train, self.schedule)

  def _compile_step(self, shardings):
    train = self.config.train
    return compile_train_step(
        self.mesh, shardings, task=self.task,
        model=self.task.model(self.model_config, deterministic=False),
        tx=self.tx, schedule=self.schedule,
        label_smoothing=train.label_smoothing,
        grad_accum_steps=train.grad_accum_steps, prng_impl=train.prng_impl)

  def _budget_measure_step(self, start_step: int) -> int | None:
    """The step at which to fix the step count the budget allows (the end
    of warm-up, where the schedules before and after agree), or None when
    it is fixed already (read from the workdir) or not wanted."""
    train = self.config.train
    if not (train.max_minutes and train.schedule_over_budget):
      return None
    fixed = budget_lib.read_steps(self.workdir)
    if fixed is not None:
      self._set_num_steps(fixed)
      self.log(f'Training to step {fixed}, the count fixed for the '
               f'{train.max_minutes:g}-minute budget in '
               f'{paths.join(self.workdir, budget_lib.STEPS_FILE)}.')
      return None
    if start_step + train.log_every >= train.warmup_steps:
      self.log('WARNING: resumed after warm-up without '
               f'{budget_lib.STEPS_FILE}; the schedule stays over '
               f'train.num_steps={train.num_steps}.')
      return None
    return train.warmup_steps

  def _fix_budget_steps(self, step: int, mark: tuple[int, float]) -> int:
    """Fixes (and writes) the step count from the time per step since
    `mark` = (step, budget time). Recompiling is not allowed for: the
    budget stops the run a little early, where the schedule is near 0."""
    seconds = (self.budget.elapsed() - mark[1]) / (step - mark[0])
    num_steps = budget_lib.estimate_steps(step, seconds,
                                          self.budget.remaining())
    num_steps = max(num_steps, step + 1)
    if jax.process_count() > 1:
      num_steps = int(multihost_utils.broadcast_one_to_all(
          np.int32(num_steps)))
    if self.is_main:
      budget_lib.write_steps(self.workdir, num_steps, seconds,
                             self.config.train.max_minutes)
    self._set_num_steps(num_steps)
    self.log(f'step {step}: {seconds:.3g} s per step; the '
             f'{self.config.train.max_minutes:g}-minute budget allows '
             f'{num_steps} steps, the schedule now ends there.')
    return num_steps

  def initial_state(self) -> TrainState:
    """The latest good checkpoint's state, or a fresh one."""
    model = self.task.model(self.model_config)
    abstract, shardings = trained_lib.train_state_layout(
        self.config, self.mesh, self.tx)
    restored = self.checkpoints.restore_latest(abstract, shardings)
    if restored is not None:
      self.log(f'Resuming from the checkpoint of step {int(restored.step)} '
               f'in {self.checkpoints.directory}.')
      return restored
    state = create_train_state(self.task, model, self.tx, self.example_batch,
                               self.mesh, self.rules, self.config.seed,
                               self.config.train.prng_impl)
    start = self.config.init.pretrained
    if start:
      self.log(f'Starting from the parameters of {start}.')
      state = state.replace(params=trained_lib.pretrained_params(
          start, self.config, self.mesh))
    return state

  def log(self, text: str) -> None:
    if self.is_main:
      print(text, flush=True)

  def run(self, stop: StopRequested | None = None) -> dict:
    """Trains to num_steps, or until a signal (caught by `stop`, entered by
    the caller, or else here) or an error; checkpointing is shut down on
    every way out (a pending save completes first)."""
    try:
      if stop is None:
        with StopRequested() as stop:
          final = self._run(stop)
      else:
        final = self._run(stop)
    except BaseException:
      # With several processes, closing waits on the others: not on error.
      if jax.process_count() == 1:
        self.checkpoints.close()
      raise
    self.checkpoints.close()
    return final

  def _run(self, stop: StopRequested) -> dict:
    stop.join_processes()
    config, train = self.config, self.config.train
    state = self.initial_state()
    start_step = int(state.step)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batches = task_batches.train_batches(
        config, self.source_tok, self.target_tok, start_step=start_step,
        process_index=jax.process_index(), share=self.share,
        row_multiple=task_batches.row_multiple(config, self.share.num_shards),
        token_cache=self.token_cache)
    writer = MetricsWriter(self.workdir, enabled=self.is_main)
    drawn = mixture.Tally(config.data)  # Examples per source of a mixture.
    measure_at = self._budget_measure_step(start_step)
    seconds_left = (self.budget.wall_seconds_left if train.max_minutes
                    else None)
    progress = Progress(train.num_steps, start_step, enabled=self.is_main,
                        seconds_left=seconds_left)
    peak_flops = train.peak_flops or measure_peak_flops()
    final = {}
    if stop.signalled():
      progress.close()
      writer.close()
      self.state = state
      latest = self.checkpoints.latest_step()
      self.log(f'{stop.signal_name} received before the first step: nothing '
               'was trained and no checkpoint written (' + (
                   f'the latest is step {latest}' if latest is not None
                   else 'there is none yet') + f') in '
               f'{self.checkpoints.directory}.')
      return final
    if start_step >= train.num_steps:
      self.log(f'The checkpoint of step {start_step} is already at '
               f'train.num_steps={train.num_steps}: nothing to train (raise '
               'train.num_steps to train further).')
    else:
      self.log(f'Training steps {start_step + 1}-{train.num_steps} in '
               f'{self.workdir} (the first step compiles first).')
    with mesh_lib.activate(self.mesh, self.rules):
      step_fn = self._compile_step(shardings)
      # Steps run ahead of the host by at most one: before step n + 1 is
      # dispatched, step n - 1 has finished (its metrics are fetched). So a
      # stop is acted on within two steps, not after a whole log window.
      pending, records = [], []
      window_start, window_tokens, window_flops = time.perf_counter(), 0, 0.0
      step, mark = start_step, None
      while step < train.num_steps:
        local = next(batches)
        drawn.add(local)
        state, metrics = step_fn(state, mesh_lib.global_batch(local, self.mesh))
        step += 1
        out_of_time = self.budget.spent(step)
        last = step == train.num_steps or out_of_time
        pending.append((step, metrics))
        records += self._fetch(pending[:-1])
        del pending[:-1]
        stopping = stop.at(step, self.checkpoints)
        window_tokens += self._tokens(local) * jax.process_count()
        window_flops += self._flops(local)
        boundary = (step % train.log_every == 0 or last or step == measure_at
                    or self._eval_due(step) or self.checkpoints.due(step)
                    or stopping)
        if not boundary:
          continue
        records += self._fetch(pending)
        pending = []
        elapsed = time.perf_counter() - window_start
        final = dict(records[-1][1])
        final.update(tokens_per_second=window_tokens / elapsed,
                     step_time=elapsed / len(records),
                     mfu=window_flops / elapsed / (peak_flops * jax.device_count()))
        final['skipped_steps'] = float(sum(1 - r['finite'] for _, r in records))
        final.update(drawn.take())
        records = []
        writer.write(step, final)
        progress.update(step, final)
        if measure_at and mark is None:
          mark = (step, self.budget.elapsed())
        elif step == measure_at and not last:
          progress.close()
          progress = Progress(self._fix_budget_steps(step, mark), step,
                              enabled=self.is_main, seconds_left=seconds_left)
          step_fn = self._compile_step(shardings)
        if self._eval_due(step) or last:
          eval_metrics = self.evaluate(state)
          writer.write(step, eval_metrics, prefix='eval_')
          progress.log(f'step {step}: ' + ' '.join(
              f'eval_{k}={v:.4g}' for k, v in eval_metrics.items()))
          final.update({f'eval_{k}': v for k, v in eval_metrics.items()})
          self.checkpoints.save(step, state, final, force=True)
          # A signal during the evaluation stops here, at the saved step.
          stopping = stopping or stop.signalled()
        elif self.checkpoints.due(step) or stopping:
          self.checkpoints.save(step, state, final, force=stopping)
        if out_of_time and not stopping:
          progress.log(f'step {step}: the {train.max_minutes:g}-minute '
                       'budget is spent; training ends here.')
        if last and not stopping:
          self.finished = True
          break
        if stopping:
          self.checkpoints.wait()
          progress.close()
          self.log(f'{stop.signal_name} received: saved the checkpoint of step '
                   f'{step} in {self.checkpoints.directory}; run the same '
                   'command again to resume.')
          break
        window_start, window_tokens, window_flops = time.perf_counter(), 0, 0.0
      self.checkpoints.wait()
      self.finished = self.finished or step >= train.num_steps
      if self.finished and self.config.eval.average_last > 1:
        state = self._averaged(state, step, writer)
    progress.close()
    writer.close()
    self.state = state
    return final

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

  def _tokens(self, local) -> int:
    """Real (not padding) tokens of a batch: segment ids are 0 at padding
    (token 0 may be a real one, Marian's EOS)."""
    return int(sum(np.count_nonzero(local.get(f'{k}_segment_ids', local[k]))
                   for k in ('inputs', 'targets') if k in local))

  def _flops(self, local) -> float:
    rows = next(iter(local.values())).shape[0] * jax.process_count()
    return flops_lib.training_flops_per_step(
        self.model_config, self.task, rows,
        local['inputs'].shape[1] if 'inputs' in local else 0,
        local['targets'].shape[1] if 'targets' in local else 0)

  def _eval_due(self, step: int) -> bool:
    every = self.config.eval.every
    return bool(every) and step % every == 0

  def _fetch(self, pending):
    """Fetches the metrics of `pending` steps (waiting for them to finish);
    a non-finite step stops the run (or is counted, with nan_policy='skip').
    Bad updates were never applied."""
    records = [(s, jax.device_get(m)) for s, m in pending]
    for s, metrics in records:
      if metrics['finite'] < 1 and self.config.train.nan_policy == 'stop':
        self.checkpoints.wait()
        last = self.checkpoints.latest_step()
        raise NonFiniteLossError(
            f'Non-finite loss or gradient at step {s} (loss='
            f'{float(metrics["loss"])}, grad_norm='
            f'{float(metrics["grad_norm"])}). The last good checkpoint is '
            f'step {last} in {self.checkpoints.directory}; nothing newer was '
            'saved. Lower train.learning_rate or set '
            'train.grad_clip_norm, or --config.train.nan_policy=skip to skip '
            'such steps.')
    return [(s, {k: float(np.asarray(v)) for k, v in m.items()
                 if np.ndim(v) == 0}) for s, m in records]

  def evaluate(self, state: TrainState) -> dict[str, float]:
    """Loss metrics on the eval split (and BLEU for translation)."""
    eval_config = self.config.eval
    if self._eval_fn is None:  # Compiled once per run, not once per eval.
      self._eval_fn = compile_eval_step(
          self.mesh, jax.tree.map(lambda x: x.sharding, state.params),
          task=self.task, model=self.task.model(self.model_config))
    totals = None
    batches = task_batches.eval_batches(
        self.config, self.source_tok, self.target_tok, eval_config.split,
        process_index=jax.process_index(), share=self.share,
        token_cache=self.token_cache)
    for index, local in enumerate(batches):
      if eval_config.num_batches and index >= eval_config.num_batches:
        break
      local = {k: v for k, v in local.items() if k != 'example_index'}
      sums = self._eval_fn(state.params,
                           mesh_lib.global_batch(local, self.mesh))
      totals = sums if totals is None else jax.tree.map(jnp.add, totals, sums)
    metrics = {k: float(np.asarray(v))
               for k, v in jax.device_get(losses.summarise(totals)).items()
               if np.ndim(v) == 0 and k != 'weight'}
    if self.task.translates and eval_config.bleu_examples:
      metrics.update(evaluate_lib.evaluate_translation(
          state.params, self.model_config, self.config, self.source_tok,
          self.target_tok, eval_config.split, self.mesh,
          max_examples=eval_config.bleu_examples, beam_size=1))
    return metrics


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Trains (or resumes) in `workdir`; returns the last logged metrics."""
  checkpoint_lib.make_workdir(workdir)
  return Trainer(config, workdir).run()
