"""The config keys that name files or directories, and their resolution:
a relative path or `~/...` becomes absolute once, when a config is loaded
(or a command's overrides applied), so that the run saves, and every layer
below reads, one spelling that does not depend on the working directory
(Orbax, for one, refuses relative paths). gs://... and '' (unset) stay.

A trained model's saved config keeps none of them for a command
(`without_paths`): what a command reads and writes comes from its user,
never from a model someone else trained."""
import copy

import ml_collections

from jaxformer.storage import paths

SPLITS = ('train', 'dev', 'test')
PATH_KEYS = (
    ('init.pretrained', 'eval.comet')
    + tuple(f'data.text.{split}' for split in SPLITS)
    + tuple(f'data.tsv.{split}' for split in SPLITS)
    + tuple(f'data.{kind}.{split}' for kind in ('jsonl', 'parquet')
            for split in SPLITS)
    + tuple(f'data.files.{split}_{side}' for split in SPLITS
            for side in ('source', 'target'))
    + ('data.tfds.data_dir', 'data.tokenizer.model_path',
       'data.tokenizer.source_model_path', 'data.tokenizer.target_model_path',
       'data.token_cache_dir'))


def _change_set_paths(config, keys, change) -> None:
  """change(value) for each of `keys` that is set in `config`, in place."""
  for dotted in keys:
    *parents, leaf = dotted.split('.')
    node = config
    for name in parents:
      node = node.get(name)
      if not hasattr(node, 'get'):  # A config saved before the key existed.
        break
    if hasattr(node, 'get') and node.get(leaf):
      node[leaf] = change(node[leaf])


def _with_set_paths(config: ml_collections.ConfigDict, change
                    ) -> ml_collections.ConfigDict:
  """A copy of `config` with change(value) for each PATH_KEY that is set,
  in `data` and in each source of `data.mixture` (its groups as data's)."""
  config = ml_collections.ConfigDict(copy.deepcopy(config.to_dict()))
  _change_set_paths(config, PATH_KEYS, change)
  data_keys = [key for key in PATH_KEYS if key.startswith('data.')]
  mixture = config.get('data', {}).get('mixture', {})
  for source in (mixture.get('sources') or []) if mixture else []:
    if isinstance(source, dict):
      _change_set_paths({'data': source}, data_keys, change)
  return config


def resolve_paths(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """A copy of `config` whose PATH_KEYS that are set are absolute."""
  return _with_set_paths(config, paths.absolute)


def without_paths(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """A copy of `config` whose PATH_KEYS are all unset ('')."""
  return _with_set_paths(config, lambda _: '')
