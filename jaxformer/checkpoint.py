"""Checkpoints with Orbax: DIR/checkpoints/<step>/{state, extra}.

`state` is the TrainState (params, optimizer state, step, RNG), restored into
whatever mesh the restoring run uses. `extra` is JSON: the resolved config,
the tokenizers (serialized SentencePiece models) and the metrics of that
step. The data stream is addressed by step, so the step is its position.
Orbax writes each step into a temporary directory and renames it when
complete, so a half-written step is never taken for a good one.
"""
import base64
import errno
import json
import logging
import os

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

# Keys that may change when a run resumes; everything else must match.
RESUMABLE_CHANGES = ('train.', 'eval.', 'checkpoint.', 'decode.',
                     'distributed.', 'mesh.', 'data.tokenizer.wait_seconds',
                     'data.tsv.', 'data.files.', 'data.tfds.data_dir',
                     'seed')


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be written or used as asked."""


def _flatten(config: dict, prefix: str = '') -> dict[str, object]:
  flat = {}
  for key, value in config.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def incompatible_keys(saved: dict, current: dict) -> list[str]:
  """Config keys whose change would make the saved state unusable."""
  a, b = _flatten(saved), _flatten(current)
  changed = [k for k in sorted(set(a) | set(b))
             if json.dumps(a.get(k)) != json.dumps(b.get(k))]
  return [k for k in changed if not k.startswith(RESUMABLE_CHANGES)]


def _check_writable(directory: str) -> None:
  try:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, '.write_test')
    with open(probe, 'wb') as f:
      f.write(b'0' * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    raise CheckpointError(
        f'Cannot write checkpoints to {directory}: {e.strerror or e}. Free '
        'some disk space or choose another --workdir.') from e


class Checkpointer:
  """Saves every `every` steps (asynchronously) and restores the latest good
  step. Keeps the last `keep` steps plus the best by `best_metric`."""

  def __init__(self, workdir: str, options: ml_collections.ConfigDict,
               read_only: bool = False):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    self.options = options
    if jax.process_index() == 0 and not read_only:
      _check_writable(self.directory)
    best_key = f'eval_{options.best_metric}' if options.best_metric else None
    policies = [preservation_policy.LatestN(n=options.keep)]
    if best_key:
      policies.append(preservation_policy.BestN(
          get_metric_fn=lambda metrics: metrics.get(best_key, float('nan')),
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

  def due(self, step: int) -> bool:
    every = self.options.every
    return (bool(every) and step % every == 0) or self.manager.reached_preemption(step)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

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
    clean = {k: float(v) for k, v in metrics.items()
             if np.isscalar(v) and np.isfinite(v)}
    extra = dict(self.extra, metrics=clean, step=int(step))
    try:
      self.manager.save(
          step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        extra=ocp.args.JsonSave(extra)),
          metrics=clean, force=force)
    except OSError as e:
      raise CheckpointError(
          f'Writing the checkpoint of step {step} to {self.directory} failed: '
          f'{e}. The previous checkpoints {self.manager.all_steps()} are '
          'kept; free disk space and resume.') from e

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except OSError as e:
      if e.errno == errno.ENOSPC:
        raise CheckpointError(f'Disk full while writing to {self.directory}; '
                              'the previous checkpoints are kept.') from e
      raise

  def restore_extra(self, step: int) -> dict:
    return self.manager.restore(
        step, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))['extra']

  def restore(self, step: int, abstract_state, shardings):
    """The state of `step`, each array placed by `shardings`."""
    target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract_state, shardings)
    restored = self.manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
    return restored['state']

  def restore_latest(self, abstract_state, shardings):
    """The newest step that restores; a corrupt one is reported by name and
    skipped (left on disk for inspection). None when there is none."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        return self.restore(step, abstract_state, shardings)
      except Exception as e:  # Orbax raises many types for damaged files.
        logging.warning('Checkpoint %s is damaged (%s: %s); trying the one '
                        'before.', os.path.join(self.directory, str(step)),
                        type(e).__name__, e)
        print(f'WARNING: checkpoint {os.path.join(self.directory, str(step))}'
              f' cannot be restored ({type(e).__name__}); using an older one.',
              flush=True)
    return None

  def check_compatible(self, config: ml_collections.ConfigDict) -> None:
    """Raises if the latest checkpoint was made with an incompatible config."""
    step = self.latest_step()
    if step is None:
      return
    try:
      saved = self.restore_extra(step)['config']
    except Exception:  # A damaged latest step: restore_latest reports it.
      return
    current = json.loads(config.to_json_best_effort())
    keys = incompatible_keys(saved, current)
    if keys:
      details = '; '.join(f'{k}: saved {_flatten(saved).get(k)!r}, now '
                          f'{_flatten(current).get(k)!r}' for k in keys)
      raise CheckpointError(
          f'The checkpoints in {self.directory} were made with a different '
          f'config ({details}). Use another --workdir, or undo these changes '
          '(train.*, eval.*, checkpoint.* and decode.* may change on resume).')

  def close(self) -> None:
    self.manager.close()


def tokenizers_from_extra(extra: dict):
  from jaxformer.data.tokenizer import Tokenizer
  return [Tokenizer.from_serialized(base64.b64decode(t))
          for t in extra['tokenizers']]
