"""A trained model: the one way from a training workdir (its latest or a
given checkpoint) or an export (`jaxformer export` / `average`) to
parameters with their configs, tokenizers and task, laid out by the saved
config's `RunSpec`.

`manager.py` reads and writes the arrays; what they are (the model of the
saved config, its shapes and their shardings) is decided here.
"""
import base64
import dataclasses
import sys
from typing import Any

import jax
import ml_collections

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.checkpoints import exports
from jaxformer.checkpoints import saved_state
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.storage import paths
from jaxformer.data.tokenizer import Tokenizer, from_serialized
from jaxformer.model import config as model_config_lib
from jaxformer.train import ema as ema_lib
from jaxformer.train import frozen_base
from jaxformer.train.run_spec import RunSpec
from jaxformer.train.tasks import Task


@dataclasses.dataclass(frozen=True)
class Trained:
  """What a command needs of a trained model."""
  params: Any  # On this process's devices.
  model_config: model_config_lib.ModelConfig
  config: ml_collections.ConfigDict  # The run's resolved config.
  source_tok: Tokenizer
  target_tok: Tokenizer
  step: int | None  # The checkpoint's; an export's newest (averaged) step.
  task: Task
  weights: str = 'raw'  # 'ema': the moving average of the parameters.


def local_mesh():
  """All of this process's devices on the data axis: how commands hold a
  trained model."""
  return mesh_lib.make_mesh({'data': -1}, jax.local_devices())


def tokenizers_from_extra(extra: dict) -> list[Tokenizer]:
  return [from_serialized(base64.b64decode(t)) for t in extra['tokenizers']]


def _run_of(extra: dict) -> RunSpec:
  """The run whose saved `extra` this is, on this process's devices."""
  return RunSpec.build(ml_collections.ConfigDict(extra['config']), local_mesh())


def _trained(params, extra: dict, step: int | None, weights: str) -> Trained:
  run = _run_of(extra)
  tokenizers = tokenizers_from_extra(extra)
  return Trained(params, run.model_config, run.config, tokenizers[0],
                 tokenizers[-1], step, run.task, weights)


def _abstract_params_of(extra: dict):
  """The abstract parameters of the run whose saved `extra` this is."""
  return _run_of(extra).abstract_params()


def weights_of(directory: str, extra: dict, weights: str | None) -> str:
  """Which weights of the checkpoints whose `extra` this is a command uses
  (`--weights`, else the moving average where they keep one)."""
  return ema_lib.choose(weights, ema_lib.kept_by(extra['config']),
                        f'{directory} (its config has train.ema_decay=0)')


def read_weights(reader, step: int, extra: dict, weights: str):
  """The parameters of `step` ('raw') or their moving average ('ema'), in
  the parameters' dtypes and layout; those of an adapter checkpoint over
  the frozen base of the export it names (`saved_state.py`)."""
  run = _run_of(extra)
  abstract = run.abstract_params()
  base = extra.get(saved_state.BASE_KEY)
  if base:
    abstract = frozen_base.split(abstract)[0]
  if weights == 'raw':
    params = reader.restore_params(step, abstract)
  else:
    as_float32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        x.shape, 'float32', sharding=x.sharding), abstract)
    params = ema_lib.as_params(
        reader.restore_params(step, as_float32, item='ema'), abstract)
  return saved_state.with_base(base, run, params) if base else params


def _export_weights(directory: str, extra: dict, weights: str | None) -> str:
  """The weights an export holds; --weights, if given, must name them."""
  held = extra.get('weights', 'raw')
  if weights is not None and weights != held:
    raise ValueError(f'--weights {weights}: the export {directory} holds '
                     f'only its {held} weights; leave out --weights.')
  return held


def load(directory: str, step: int | None = None,
         weights: str | None = None) -> Trained:
  """The model of the latest (or the given) checkpoint in the training
  workdir `directory`, or of the export there, on this process's devices.
  Only parameters are read: no optimizer is built or restored. `weights`
  (`--weights`): 'ema' or 'raw'; None: the moving average of the
  parameters where the run keeps one.

  A latest step that cannot be restored is reported (on stderr, naming
  both steps) and the one before used."""
  if exports.is_export(directory):
    if step is not None:
      raise ValueError(f'{directory} is an export with one set of '
                       'parameters (no steps); leave out --checkpoint.')
    extra, params = exports.restore_export(directory, _abstract_params_of)
    steps = extra.get('steps') or [None]
    return _trained(params, extra, steps[-1],
                    _export_weights(directory, extra, weights))
  if not paths.is_dir(paths.join(directory, 'checkpoints')):
    raise FileNotFoundError(
        f'No checkpoints in {directory}: train first with `jaxformer train '
        f'--config ... --workdir {directory}`, or pass the --workdir of a run.')
  reader = checkpoint_lib.Checkpointer.reader(directory)
  steps = reader.all_steps()
  if not steps:
    raise FileNotFoundError(f'{reader.directory} holds no checkpoint; '
                            'train first or check the --workdir.')
  if step is not None and step not in steps:
    raise FileNotFoundError(f'No checkpoint of step {step} in '
                            f'{reader.directory}; there are {steps}.')
  candidates = [step] if step is not None else steps[::-1]
  errors = []
  for candidate in candidates:
    try:
      extra = reader.restore_extra(candidate)
    except Exception as e:  # A damaged step: try the previous one.
      errors.append(f'step {candidate}: {type(e).__name__}: {e}')
      continue
    chosen = weights_of(directory, extra, weights)
    try:
      params = read_weights(reader, candidate, extra, chosen)
      model = _trained(params, extra, candidate, chosen)
    except saved_state.BaseExportError:
      raise  # Every step of the run names the same base.
    except Exception as e:  # A damaged step: try the previous one.
      errors.append(f'step {candidate}: {type(e).__name__}: {e}')
      continue
    if errors:
      print(f'WARNING: the latest checkpoint, step {candidates[0]}, cannot '
            f'be restored ({errors[0]}); using step {candidate} instead. '
            f'Pass --checkpoint {candidate} to choose it explicitly.',
            file=sys.stderr, flush=True)
    return model
  raise RuntimeError(f'No checkpoint in {reader.directory} could be '
                     'restored: ' + '; '.join(errors))


def export(workdir: str, out: str, step: int | None = None,
           keep_provenance: bool = False, weights: str | None = None) -> int:
  """Exports the parameters of `step` (default: the latest) of `workdir`
  to `out` (with `workdir` and the run's data paths if `keep_provenance`;
  `weights` as `load` takes them); returns the step."""
  reader = checkpoint_lib.Checkpointer.reader(workdir)
  step = exports.step_to_export(reader, step)
  extra = exports.read_step(reader, step, reader.restore_extra)
  chosen = weights_of(workdir, extra, weights)
  params = exports.read_step(
      reader, step, lambda s: read_weights(reader, s, extra, chosen))
  exports.export_params(out, params, dict(
      extra, steps=[step], source=reader.directory, weights=chosen),
      keep_provenance)
  return step


def average(workdir: str, last: int, out: str,
            keep_provenance: bool = False,
            weights: str | None = None) -> list[int]:
  """Exports the mean parameters of the newest `last` checkpoints of
  `workdir` to `out` (as the paper averages the last 5 or 20; paths and
  `weights` as `export`); returns the averaged steps."""
  reader = checkpoint_lib.Checkpointer.reader(workdir)
  steps = exports.steps_to_average(reader, last)
  extra = exports.read_step(reader, steps[-1], reader.restore_extra)
  chosen = weights_of(workdir, extra, weights)
  mean = exports.mean_params(
      reader, steps, None, lambda s: read_weights(reader, s, extra, chosen))
  exports.export_params(out, mean, dict(
      extra, steps=steps, source=reader.directory, weights=chosen),
      keep_provenance)
  return steps
