"""The config keys that name files or directories, and their resolution:
a relative path or `~/...` becomes absolute once, when a config is loaded
(or a command's overrides applied), so that the run saves, and every layer
below reads, one spelling that does not depend on the working directory
(Orbax, for one, refuses relative paths). gs://... and '' (unset) stay."""
import ml_collections

from jaxformer.storage import paths

SPLITS = ('train', 'dev', 'test')
PATH_KEYS = (
    ('init.pretrained',)
    + tuple(f'data.text.{split}' for split in SPLITS)
    + tuple(f'data.tsv.{split}' for split in SPLITS)
    + tuple(f'data.files.{split}_{side}' for split in SPLITS
            for side in ('source', 'target'))
    + ('data.tfds.data_dir', 'data.tokenizer.model_path',
       'data.tokenizer.source_model_path', 'data.tokenizer.target_model_path',
       'data.token_cache_dir'))


def resolve_paths(config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """A copy of `config` whose PATH_KEYS that are set are absolute."""
  config = ml_collections.ConfigDict(config.to_dict())
  for dotted in PATH_KEYS:
    *parents, leaf = dotted.split('.')
    node = config
    for name in parents:
      node = node.get(name)
      if node is None:  # A config saved before the key existed.
        break
    if node is not None and node.get(leaf):
      node[leaf] = paths.absolute(node[leaf])
  return config
