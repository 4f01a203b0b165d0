"""An export's parameters laid out for a run that starts from it
(`init.pretrained`): the parameters the run's model shares with the export
are the export's, placed as the run wants them; a task's head the export
lacks and the adapters are the run's fresh ones; a quantized frozen base
(model.lora.base_dtype int8 or nf4) is the export's floats quantized.

The run layer starts a fine-tune from these (`run/pretrained.py`); a
fine-tune's adapter checkpoints rebuild their frozen base from them
(`saved_state.py`).
"""
import dataclasses
from typing import Any

import jax

from jaxformer.checkpoints import exports
from jaxformer.model import frozen_kernels, lora
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train.run_spec import RunSpec


# The encoder-only heads (model/transformer.py): a pretrained model without
# labels (an encoder imported without a head) gets a fresh one.
HEADS = ('classifier', 'regressor')


def pretrained_params(directory: str, run: RunSpec, fresh=None):
  """The parameters of the export `directory`, placed as the model of
  `run` wants them; a head the export lacks, or has of another width (its
  labels came from the data), and adapters are `fresh`'s (the run's
  initial parameters). An int8 or nf4 base (model.lora.base_dtype) is
  read as the export's floats and quantized."""
  if frozen_kernels.base_dtype(run.model_config) in ('int8', 'nf4'):
    return _quantized_pretrained(directory, run, fresh)
  target = run.abstract_params()
  mine = _by_path(target)
  saved = exports.param_shapes(directory)
  new = {path for path, leaf in mine.items() if path not in saved
         or saved[path].shape != leaf.shape}
  if not new:
    return exports.restore_export(directory, lambda extra: target)[1]
  # Heads and adapters the export lacks start fresh; nothing else may.
  missing = sorted(path for path in new if fresh is None or (
      path[0] not in HEADS and not lora.is_adapter(path)))
  if missing:
    path = missing[0]
    raise ValueError(
        f'--config.init.pretrained={directory}: parameter {"/".join(path)} '
        f'is {saved[path].shape if path in saved else "missing"} there, '
        f'{mine[path].shape} in this model; fine-tune with the export\'s own '
        'model settings.')
  replicated = mesh_lib.replicated(run.mesh)
  _, old = exports.restore_export(directory, lambda extra: _tree({
      path: mine[path] if path in mine and path not in new else
      jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)
      for path, leaf in saved.items()}))
  old = _by_path(old)
  return jax.tree_util.tree_map_with_path(
      lambda path, leaf: leaf if _names(path) in new else old[_names(path)],
      fresh)


def _quantized_pretrained(directory: str, run: RunSpec, fresh):
  """`pretrained_params` of a run whose projections are quantized: read as
  float32 (the run's model with a float32 base), then quantized and
  placed."""
  config = run.model_config
  float_run = dataclasses.replace(run, model_config=config.replace(
      lora=dataclasses.replace(config.lora, base_dtype='float32')))
  float_target = _by_path(float_run.abstract_params())
  given = _by_path(fresh) if fresh is not None else {}
  fresh_float = None if fresh is None else _tree({
      path: given[path] if given[path].dtype == leaf.dtype else leaf
      for path, leaf in float_target.items()})
  floats = pretrained_params(directory, float_run, fresh_float)
  target = run.abstract_params()
  return jax.device_put(frozen_kernels.quantize(floats, target),
                        jax.tree.map(lambda leaf: leaf.sharding, target))


def _names(path) -> tuple[str, ...]:
  return tuple(key.key for key in path)


def _by_path(tree) -> dict:
  """The leaves of nested dicts by their paths of names."""
  return {_names(path): leaf
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def _tree(leaves: dict[tuple[str, ...], Any]) -> dict:
  """Nested dicts of `leaves` by their paths of names."""
  tree = {}
  for path, leaf in leaves.items():
    node = tree
    for name in path[:-1]:
      node = node.setdefault(name, {})
    node[path[-1]] = leaf
  return tree
