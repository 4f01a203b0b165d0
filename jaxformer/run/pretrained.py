"""A run that starts from an export (`init.pretrained`, fine-tuning): its
config takes the export's task, model and tokenizer settings, and its
first state the export's parameters (`checkpoints/base_params.py`: a head
the export lacks is fresh).

This is run assembly: the config is rewritten here, in the run layer;
`checkpoints/` only reads the export.
"""
import jax
import ml_collections

from jaxformer.checkpoints import exports
from jaxformer.checkpoints import trained
from jaxformer.data.tokenizer import model_paths
from jaxformer.storage import paths
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
