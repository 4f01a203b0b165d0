"""What a run's checkpoints hold of its train state.

A run holds all of it, except a fine-tune with adapters (model.lora) that
starts from an export (init.pretrained): its checkpoints hold what trains
(the adapters, a task's head, their optimizer state and moving average)
and, in `extra`, a reference to the export the frozen base comes from:

  extra['base'] = {'export': DIR, 'sha256': the fingerprint of its files}

so that a checkpoint of an 8B LoRA fine-tune holds megabytes rather than
the base's 16 GB again, and is never resumed or read over another base.
The frozen base is read back from the export as the run's start read it
(`base_params.py`, quantized again where model.lora.base_dtype asks), so a
resume is bitwise. Checkpoints written before (the whole state, no
'base' in extra) keep resuming as they were written.
"""
import dataclasses
import hashlib

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.checkpoints import base_params
from jaxformer.checkpoints.manager import CheckpointError
from jaxformer.storage import paths
from jaxformer.train import ema as ema_lib
from jaxformer.train import frozen_base
from jaxformer.train.run_spec import RunSpec

BASE_KEY = 'base'
# Orbax's commit markers say where and that an export was written (and
# `export` rewrites them); the rest of its files are what it holds.
_NOT_CONTENT = ('commit_success.txt',)
_BLOCK_BYTES = 8 << 20


class BaseExportError(CheckpointError):
  """The base export of adapter checkpoints is missing or another one (not
  a damaged step: every step of the run names the same base)."""


def _files(directory: str, prefix: str = '') -> list[str]:
  """The files under `directory`, as sorted paths relative to it."""
  found = []
  for name in paths.list_dir(paths.join(directory, prefix) if prefix
                             else directory):
    relative = f'{prefix}/{name}' if prefix else name
    if paths.is_dir(paths.join(directory, relative)):
      found.extend(_files(directory, relative))
    elif name not in _NOT_CONTENT:
      found.append(relative)
  return found


def fingerprint(directory: str) -> str:
  """The sha256 of the export in `directory`: each file's relative path and
  bytes, in path order (every byte is read once: 1.6 s a GB on a 2-core
  machine)."""
  digest = hashlib.sha256()
  for relative in _files(directory):
    digest.update(relative.encode() + b'\0')
    with paths.open_bytes(paths.join(directory, relative)) as f:
      while block := f.read(_BLOCK_BYTES):
        digest.update(block)
    digest.update(b'\0')
  return digest.hexdigest()


def _fingerprint_of_process_0(directory: str) -> str:
  """Process 0's `fingerprint` of `directory`, on every process (one
  process reads the export's files for it, not every host)."""
  if jax.process_count() == 1:
    return fingerprint(directory)
  digest = np.zeros(32, np.uint8)
  if jax.process_index() == 0:
    digest = np.frombuffer(bytes.fromhex(fingerprint(directory)), np.uint8)
  return bytes(np.asarray(
      multihost_utils.broadcast_one_to_all(digest))).hex()


def check_base(reference: dict, directory: str) -> None:
  """Raises unless the export `directory` is the one `reference` names
  (its fingerprint is the same)."""
  if not paths.is_dir(directory):
    raise BaseExportError(
        f'The base export {directory} of these adapter checkpoints is '
        'missing: put the export the fine-tune started from back there, or '
        'pass its new place as --config.init.pretrained.')
  now = _fingerprint_of_process_0(directory)
  if now != reference['sha256']:
    raise BaseExportError(
        f'The base export {directory} is not the one these adapter '
        f'checkpoints were trained on (sha256 {now[:12]}..., they were '
        f'written over {reference["sha256"][:12]}...): put that export back, '
        'or start a new --workdir from this one.')


def _trimmed(state):
  """`state` (or its abstract or sharding tree) without the frozen base."""
  state = state.replace(params=frozen_base.split(state.params)[0])
  if ema_lib.of(state) is not None:
    state = state.replace(ema=frozen_base.split(state.ema)[0])
  return state


def base_of(run: RunSpec, trainable) -> dict:
  """The frozen parameters of `run` (nested dicts; none of `trainable`'s,
  the parameters restored beside them) read from its base export, placed
  as the run wants them."""
  frozen = frozen_base.split(run.abstract_params())[1]
  params = base_params.pretrained_params(
      run.config.init.pretrained, run,
      frozen_base.merge(trainable, frozen))
  return frozen_base.split(params)[1]


def with_base(reference: dict, run: RunSpec, trainable):
  """The parameters of an adapter checkpoint of `run` (a saved run, whose
  init.pretrained is the export `reference` names): its `trainable` ones
  and the frozen base from that export, checked first."""
  check_base(reference, run.config.init.pretrained)
  return frozen_base.merge(trainable, base_of(run, trainable))


@dataclasses.dataclass(frozen=True)
class SavedState:
  """How a run's train state goes into its checkpoints and comes back.

  base: the reference to the base export (an adapter fine-tune), or None
  (the whole state is saved)."""
  run: RunSpec
  base: dict | None

  @property
  def extra(self) -> dict:
    """What the checkpoints' `extra` says of the state."""
    return {BASE_KEY: self.base} if self.base else {}

  @property
  def layout(self):
    """(abstract state, shardings) of what a checkpoint holds."""
    abstract, shardings = self.run.state_layout
    if not self.base:
      return abstract, shardings
    return _trimmed(abstract), _trimmed(shardings)

  def saved(self, state):
    """What of `state` a checkpoint holds."""
    return _trimmed(state) if self.base else state

  def restored(self, saved):
    """The train state of a checkpoint's `saved` state."""
    if not self.base:
      return saved
    frozen = base_of(self.run, saved.params)
    state = saved.replace(params=frozen_base.merge(saved.params, frozen))
    if ema_lib.of(saved) is not None:
      state = state.replace(ema=frozen_base.merge(
          saved.ema, ema_lib.initial(frozen)))
    return state


def of_run(run: RunSpec, newest_extra: dict | None) -> SavedState:
  """How `run` saves its state: an adapter fine-tune from an export saves
  what trains and a reference to the export (checked against the one its
  newest checkpoint, `newest_extra`, was written over), unless its
  checkpoints were written whole before."""
  directory = run.config.get('init', {}).get('pretrained', '')
  if not directory or not run.model_config.lora_targets:
    return SavedState(run, None)
  if newest_extra is not None and BASE_KEY not in newest_extra:
    return SavedState(run, None)  # Whole checkpoints, written before.
  if newest_extra is not None:
    check_base(newest_extra[BASE_KEY], directory)
    return SavedState(run, dict(newest_extra[BASE_KEY], export=directory))
  return SavedState(run, {'export': directory,
                          'sha256': _fingerprint_of_process_0(directory)})
