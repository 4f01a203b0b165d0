"""Which data files `jaxformer evaluate` may take from the model it is
given: those of a training workdir (a run the user trained, whose saved
config names the files it trained and evaluated on), never those of an
export (`import`, `export`, `average`: a model that may come from anyone,
whose paths `config.settings.trained_model_config` drops as for every
command). docs/security.md states the rule."""
import json

from jaxformer.checkpoints import exports
from jaxformer.config import path_keys
from jaxformer.storage import paths

# The keys naming a split's files; the tokenizers travel with the model.
DATA_KEYS = tuple(key for key in path_keys.PATH_KEYS
                  if key.startswith(('data.text.', 'data.tsv.', 'data.files.',
                                     'data.tfds.')))


def _value(config, dotted: str):
  node = config
  for name in dotted.split('.'):
    if not hasattr(node, 'get'):
      return None
    node = node.get(name)
  return node


def workdir_data(workdir: str, overrides) -> dict[str, str]:
  """{key: path} of the data files the training workdir `workdir` names
  in its config.json (the run's, paths made absolute when it was loaded)
  that the command's `overrides` do not set; {} for an export."""
  config = paths.join(workdir, 'config.json')
  if exports.is_export(workdir) or not paths.exists(config):
    return {}
  saved = json.loads(paths.read_text(config))
  given = {o.removeprefix('--config.').split('=', 1)[0] for o in overrides}
  found = {}
  for key in DATA_KEYS:
    value = _value(saved, key)
    if isinstance(value, str) and value and key not in given:
      found[key] = value
  return found
