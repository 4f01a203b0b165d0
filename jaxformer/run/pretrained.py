"""A run that starts from an export (`init.pretrained`, fine-tuning): its
config takes the export's task, model and tokenizer settings, and its
first state the export's parameters (a head the export lacks is fresh).

This is run assembly: the config is rewritten here, in the run layer;
`checkpoints/` only reads the export.
"""
import dataclasses
from typing import Any

import jax
import ml_collections

from jaxformer.checkpoints import exports
from jaxformer.checkpoints import trained
from jaxformer.data.tokenizer import model_paths
from jaxformer.model import frozen_kernels, lora
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.storage import paths
from jaxformer.train.run_spec import RunSpec
from jaxformer.train.tasks import get_task


# What fine-tuning may set in the model of the export it starts from: how
# it computes and regularises, never its parameters' shapes or layout.
# Its adapters (model.lora) are the fine-tune's own, added fresh.
FINETUNE_MODEL_KEYS = ('embedding_dropout', 'residual_dropout',
                       'attention_dropout', 'ffn_dropout', 'dtype',
                       'attention_impl', 'remat_policy', 'lora')


def pretrained_start(config: ml_collections.ConfigDict):
  """For `config.init.pretrained` (an export): (the run config with the export's
  task, model (but FINETUNE_MODEL_KEYS from `config`) and tokenizer
  settings, the export's tokenizers [source, target]); (config, None)
  without one."""
  directory = config.get('init', {}).get('pretrained', '')
  if not directory:
    return config, None
  if not exports.is_export(directory):
    raise FileNotFoundError(
        f'--config.init.pretrained={directory} is not a jaxformer export; make '
        'one with `jaxformer import --from HF_FOLDER --out DIR` or '
        '`jaxformer export`.')
  extra, _ = exports.restore_export(directory)
  saved = ml_collections.ConfigDict(extra['config'])
  config = ml_collections.ConfigDict(config.to_dict())
  if saved.task != config.task:
    raise ValueError(f'--config.init.pretrained={directory} is a {saved.task!r} '
                     f'model; this config trains task={config.task!r}.')
  _take_labels(config, saved.data.get('labels', []), directory)
  model = saved.model.to_dict()
  model.update({k: config.model[k] for k in FINETUNE_MODEL_KEYS})
  config.model = ml_collections.ConfigDict(model)
  for key in get_task(config.task).length_keys():
    if config.data[key] > config.model.max_len:
      raise ValueError(
          f'data.{key}={config.data[key]} is above the max_len='
          f'{config.model.max_len} positions of --config.init.pretrained='
          f'{directory}; lower data.{key}.')
  tokenizer = saved.data.tokenizer
  config.data.tokenizer.update(
      joint=tokenizer.joint, vocab_size=tokenizer.vocab_size,
      target_vocab_size=tokenizer.get('target_vocab_size', 0),
      model_path='', source_model_path='', target_model_path='')
  return config, trained.tokenizers_from_extra(extra)


def _take_labels(config: ml_collections.ConfigDict, labels, directory: str
                 ) -> None:
  """A classifier's labels are those of its head (in its order); a model
  without them (a fresh head) takes data.labels or the train split's."""
  if not labels:
    return
  if config.data.labels and list(config.data.labels) != list(labels):
    raise ValueError(
        f'data.labels={list(config.data.labels)} differs from the labels '
        f'{list(labels)} of --config.init.pretrained={directory}, whose head '
        'predicts them in that order; leave data.labels empty.')
  config.data.labels = list(labels)


def write_tokenizers(data_config: ml_collections.ConfigDict, workdir: str,
                     tokenizers) -> None:
  """Process 0 writes a pretrained model's tokenizers [source, target]
  where the run keeps its own (unless there already)."""
  models = model_paths(data_config, workdir)
  if jax.process_index() != 0 or all(map(paths.exists, models)):
    return
  for path, tokenizer in zip(models, tokenizers):
    paths.write_bytes(path, tokenizer.serialized_model_proto())


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
