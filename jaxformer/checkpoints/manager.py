"""Checkpoints with Orbax: DIR/checkpoints/<step>/{state, extra}.

`state` is the TrainState (all of it but a LoRA fine-tune's frozen base:
`saved_state.py`), restored into whatever mesh the restoring run uses.
`extra` is JSON: the resolved config, the tokenizers (serialized
SentencePiece models), the metrics of that step and, for a LoRA fine-tune,
its base export. The data stream is addressed by step (its position).
Orbax writes each step into a temporary directory and renames it when
complete, so a half-written step is never taken for a good one.

Exports (parameters only) are `exports.py`'s. What the arrays are (the
model, its shapes and shardings) is `trained.py`'s; which config changes a
run may resume with is `config/resume.py`'s.
"""
import base64
import json
import os
import sys
import threading
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint.checkpoint_managers import preservation_policy

from jaxformer.storage import paths


# A checkpoint that cannot be written or used as asked (the package's
# checkpoint kind of error, `storage/errors.py`).
CheckpointError = paths.CheckpointError


def _blocking_file(path: str) -> str | None:
  """The first existing component of `path` that is not a directory."""
  path = os.path.abspath(path)
  parts = path.split(os.sep)
  for end in range(2, len(parts) + 1):
    prefix = os.sep.join(parts[:end])
    if not os.path.exists(prefix):
      return None
    if not os.path.isdir(prefix):
      return prefix
  return None


def make_workdir(directory: str) -> None:
  """Creates `directory` (local or gs://) and checks that files can be
  written there, so a run fails before any work rather than at its first
  checkpoint."""
  blocking = None if paths.is_remote(directory) else _blocking_file(directory)
  if blocking is not None:
    raise CheckpointError(
        f'Cannot use {directory} as a directory: {blocking} is a file. '
        'Choose another --workdir.')
  try:
    paths.check_writable(directory)
  except paths.StorageError as e:
    raise CheckpointError(str(e)) from e


def short_error(error: Exception, limit: int = 300) -> str:
  text = f'{type(error).__name__}: {error}'.splitlines()[0]
  return text if len(text) <= limit else text[:limit] + '...'


def transient(error: BaseException) -> bool:
  """Whether a read error may pass when tried again (a timeout, a dropped
  connection, storage that is briefly unavailable) rather than mean that
  the files are damaged or missing."""
  if isinstance(error, (TimeoutError, ConnectionError)):
    return True
  if isinstance(error, (FileNotFoundError, IsADirectoryError,
                        NotADirectoryError, PermissionError)):
    return False
  if isinstance(error, OSError):  # EIO, ESTALE (network file systems).
    return True
  # TensorStore and gRPC name the status in the message.
  return any(status in str(error) for status in (
      'UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED'))


def _processes_failing(failed: bool) -> list[int]:
  """The processes for which `failed` is true (each gives its own)."""
  if jax.process_count() == 1:
    return [0] if failed else []
  flags = multihost_utils.process_allgather(np.int32(failed))
  return [p for p, flag in enumerate(np.asarray(flags).reshape(-1)) if flag]


def _with_shardings(abstract, shardings):
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abstract, shardings)


def _wait_for_failed_writes(directory: str, started_before: set[int],
                            quiet_seconds: float = 0.5,
                            timeout_seconds: float = 120.0) -> None:
  """Waits until a failed save has stopped writing: Orbax reports the first
  failing write while the step's other writes still run (its threads, and
  TensorStore's below them), and they would keep changing the step's
  temporary directory after the error is reported. Done when those threads
  have ended and the temporary directories have not changed for
  `quiet_seconds`."""
  def orbax_threads_running() -> bool:
    return any(t.ident not in started_before and t.is_alive()
               and (type(t).__module__.startswith('orbax.')
                    or t.name.startswith('asyncio_'))
               for t in threading.enumerate())

  def temporary_files() -> dict[str, tuple[int, int]]:
    files = {}
    for tmp in epath.Path(directory).glob('*.orbax-checkpoint-tmp*'):
      for root, _, names in tmp.walk():
        for name in names:
          path = os.fspath(root / name)
          try:
            files[path] = paths.stat(path)
          except OSError:  # Removed while listed: not quiet yet.
            files[path] = (-1, -1)
    return files

  deadline = time.monotonic() + timeout_seconds
  seen, quiet_since = temporary_files(), time.monotonic()
  while time.monotonic() < deadline:
    time.sleep(0.02)
    now = temporary_files()
    if now != seen or orbax_threads_running():
      seen, quiet_since = now, time.monotonic()
    elif time.monotonic() - quiet_since >= quiet_seconds:
      return


class Checkpointer:
  """Saves every `every` steps (asynchronously) and restores the latest good
  step. Keeps the last `keep` steps plus the best by `best_metric`."""

  def __init__(self, workdir: str, options: ml_collections.ConfigDict,
               read_only: bool = False):
    self.directory = paths.join(paths.absolute(workdir), 'checkpoints')
    self.options = options
    self.read_only = read_only
    if jax.process_index() == 0 and not read_only:
      make_workdir(self.directory)
    self.best_key = (f'eval_{options.best_metric}' if options.best_metric
                     else None)
    policies = [preservation_policy.LatestN(n=options.keep)]
    if self.best_key:
      # Only steps saved with the metric carry metrics (see `save`); older
      # steps without it rank last (NaN would break the sort).
      worst = float('inf') if options.best_mode == 'min' else float('-inf')
      policies.append(preservation_policy.BestN(
          get_metric_fn=lambda metrics: metrics.get(self.best_key, worst),
          reverse=options.best_mode == 'min', n=1,
          keep_checkpoints_without_metrics=False))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            preservation_policy=preservation_policy.AnyPreservationPolicy(
                policies),
            enable_async_checkpointing=options.async_save,
            cleanup_tmp_directories=not read_only, read_only=read_only,
            create=not read_only),
        item_names=('state', 'extra'))
    self.extra: dict = {}
    self._pending_step = None
    self._threads_before_save: set[int] = set()
    self._save_failed_already = False

  @classmethod
  def reader(cls, workdir: str) -> 'Checkpointer':
    """Read-only access to the checkpoints of a training workdir."""
    if not paths.is_dir(paths.join(workdir, 'checkpoints')):
      raise CheckpointError(
          f'No checkpoints in {workdir}: pass the --workdir of a training '
          'run (it holds a checkpoints/ directory).')
    options = ml_collections.ConfigDict(dict(
        every=0, keep=1, best_metric='', best_mode='max', async_save=False))
    return cls(workdir, options, read_only=True)

  def due(self, step: int) -> bool:
    """A regular (every `every` steps) checkpoint; preemption is separate."""
    every = self.options.every
    return bool(every) and step % every == 0

  def reached_preemption(self, step: int) -> bool:
    """With the distributed runtime up (any process count): whether all
    processes agreed to stop after `step` (JAX's preemption service, which
    owns SIGTERM then). Every process must call this once at every step.
    Always False without the runtime."""
    return self.manager.reached_preemption(step)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def step_directory(self, step: int) -> str:
    return paths.join(self.directory, str(step))

  def set_extra(self, config: ml_collections.ConfigDict, tokenizers) -> None:
    """What every step saves beside the state: config and tokenizers."""
    self.extra = {
        'config': json.loads(config.to_json_best_effort()),
        'tokenizers': [base64.b64encode(t.serialized_model_proto()).decode()
                       for t in tokenizers],
    }

  def save(self, step: int, state, metrics: dict, force: bool = False) -> None:
    """Starts writing `state` of `step` (returns before the write ends)."""
    if step in self.manager.all_steps():
      return
    self.wait()
    clean = {k: float(v) for k, v in metrics.items()
             if np.isscalar(v) and np.isfinite(v)}
    extra = dict(self.extra, metrics=clean, step=int(step))
    ranked = clean if self.best_key in clean else None
    self._threads_before_save = {t.ident for t in threading.enumerate()}
    try:
      self.manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        extra=ocp.args.JsonSave(extra)),
          metrics=ranked, force=force)
    except Exception as e:  # Orbax reports I/O errors as several types.
      raise self._save_failed(step, e) from e
    self._pending_step = step

  def wait(self) -> None:
    """Blocks until the last save is complete; raises if it failed."""
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._save_failed(self._pending_step, e) from e
    finally:
      self._pending_step = None

  def _save_failed(self, step, error: Exception) -> CheckpointError:
    self._save_failed_already = True
    _wait_for_failed_writes(self.directory, self._threads_before_save)
    return CheckpointError(
        f'Writing the checkpoint of step {step} to {self.directory} failed '
        f'({short_error(error)}). The previous checkpoints '
        f'{self.all_steps()} are kept; fix the cause (disk space, '
        'permissions) and run the same command again to resume.')

  def restore_extra(self, step: int) -> dict:
    return self.manager.restore(
        step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))['extra']

  def restore(self, step: int, abstract_state, shardings):
    """The state of `step`, each array placed by `shardings`. Reads `extra`
    as well, so a step missing either item counts as damaged."""
    restored = self.manager.restore(
        step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(
                _with_shardings(abstract_state, shardings)),
            extra=ocp.args.JsonRestore()))
    return restored['state']

  def restore_params(self, step: int, abstract_params, item: str = 'params'):
    """Only the parameters of `step` (no optimizer state is read), or the
    state's other tree `item` of their shapes ('ema': their moving
    average); `abstract_params` holds ShapeDtypeStructs with shardings."""
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item={item: abstract_params},
            restore_args=ocp.checkpoint_utils.construct_restore_args(
                {item: abstract_params}),
            partial_restore=True)))
    return restored['state'][item]

  def restore_latest(self, abstract_state, shardings):
    """The newest step that every process restores, or None when there are
    no steps.

    Every process tries the steps that process 0 lists, newest first, each
    reading its own shards; an error that may pass (`transient`) is retried
    before the step counts as damaged. The processes then tell each other
    whether they read it, and all take the newest step that all of them
    read, so no two restore different steps. A damaged step is reported by
    name and skipped. Unless read-only, process 0 then renames it to
    <step>.damaged-<time> (kept for inspection, nothing is deleted), after
    all processes agreed, so that the run can write that step again. When
    no step restores, which suggests a cause other than damage, this raises
    and moves nothing.
    """
    failures = {}
    for step in reversed(self._steps_of_process_0()):
      try:
        restored, error = self._read_retrying(
            step, abstract_state, shardings), None
      except Exception as e:  # Orbax raises many types for damaged files.
        restored, error = None, short_error(e)
      unreadable = _processes_failing(error is not None)
      if not unreadable:
        if failures and not self.read_only:
          self._move_aside(list(failures))
        return restored
      failures[step] = error or (
          f'process {", ".join(map(str, unreadable))} cannot read it; see '
          'its log')
      print(f'WARNING: checkpoint {self.step_directory(step)} cannot be '
            f'restored ({failures[step]}); trying the one before.',
            file=sys.stderr, flush=True)
    if failures:
      raise CheckpointError(
          f'No checkpoint in {self.directory} can be restored ('
          + '; '.join(f'step {s}: {e}' for s, e in failures.items())
          + '). If they are damaged, move them elsewhere to start afresh; '
          'if the config changed, undo the change.')
    return None

  def _steps_of_process_0(self) -> list[int]:
    """Process 0's `all_steps` on every process (a host whose view of the
    directory lags would else try other steps)."""
    steps = self.all_steps()
    if jax.process_count() == 1:
      return steps
    count = int(multihost_utils.broadcast_one_to_all(np.int64(len(steps))))
    if not count:
      return []
    padded = np.zeros(count, np.int64)
    padded[:min(count, len(steps))] = steps[:count]
    return [int(s) for s in multihost_utils.broadcast_one_to_all(padded)]

  def _read_retrying(self, step: int, abstract_state, shardings,
                     tries: int = 4, first_wait: float = 1.0):
    """`_read`, retried with waits of 1, 2, 4 s while the error is
    transient."""
    for attempt in range(tries):
      try:
        return self._read(step, abstract_state, shardings)
      except Exception as e:
        if attempt + 1 == tries or not transient(e):
          raise
        wait = first_wait * 2 ** attempt
        print(f'WARNING: reading checkpoint {self.step_directory(step)} '
              f'failed ({short_error(e)}); trying again in {wait:g}s.',
              file=sys.stderr, flush=True)
        time.sleep(wait)

  def _read(self, step: int, abstract_state, shardings):
    """This process's shards of `step` (both items), without the barrier
    that ends Orbax's restore: a process whose read fails never reaches it,
    and the others would wait there while it goes on to another step."""
    handler = ocp.CompositeCheckpointHandler()
    try:
      restored = handler.restore(
          epath.Path(self.step_directory(step)), args=ocp.args.Composite(
              state=ocp.args.StandardRestore(
                  _with_shardings(abstract_state, shardings)),
              extra=ocp.args.JsonRestore()))
    finally:
      handler.close()
    return restored['state']

  def _move_aside(self, steps: list[int]) -> None:
    stamp = time.strftime('%Y%m%d-%H%M%S')
    if jax.process_index() == 0:
      for step in steps:
        target = f'{self.step_directory(step)}.damaged-{stamp}'
        paths.rename(self.step_directory(step), target)
        print(f'WARNING: moved the damaged checkpoint aside to {target}.',
              file=sys.stderr, flush=True)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('jaxformer_moved_damaged_steps')
    self.manager.reload()

  def newest_extra(self) -> dict | None:
    """The `extra` of the newest step whose `extra` reads, if any (which
    config and data order a resumed run continues: `config/resume.py`)."""
    for step in reversed(self.all_steps()):
      try:
        return self.restore_extra(step)
      except Exception:  # A damaged step: restore_latest reports it.
        continue
    return None

  def close(self) -> None:
    """Waits for pending writes, and for the clean-up of unfinished steps
    the manager starts in a thread (which else may outlive an early error
    and fail noisily at exit: Orbax waits for it only before a save)."""
    await_cleanup = getattr(self.manager, '_maybe_await_cleanup_tmp_directory',
                            None)
    try:
      if await_cleanup is not None:
        await_cleanup()
      self.manager.close()
    except Exception:
      if not self._save_failed_already:
        raise  # Else Orbax raises the failure that was reported again.
