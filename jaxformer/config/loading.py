"""Loading a run config: a Python file returning an
`ml_collections.ConfigDict`, with `--config.key=value` overrides, its paths
made absolute and its values checked; and the config saved with a trained
model, taken as a command's.

A config file defines `get_config()` (optionally `get_config(arg)`, called
with the text after a colon: `configs/quickstart.py:runlocal`).
"""
import importlib.util
import os
import traceback
from collections.abc import Sequence

import ml_collections

from jaxformer.config.overrides import with_overrides
from jaxformer.config.path_keys import resolve_paths, without_paths
from jaxformer.config.run_defaults import default_config
from jaxformer.config.validation import validate
from jaxformer.storage.errors import ConfigError


def load_config(path_and_arg: str,
                overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path[:arg]` and applies `key=value` overrides; the paths it
  names (path_keys.PATH_KEYS) are made absolute."""
  path, _, arg = path_and_arg.partition(':')
  path = os.path.expanduser(path)
  if not os.path.isfile(path):
    raise ConfigError(f'Config file {path!r} does not exist; configs live in '
                      'configs/, e.g. configs/quickstart.py.')
  module = _import_config_file(path)
  if not hasattr(module, 'get_config'):
    raise ConfigError(f'Config file {path} defines no get_config().')
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:
    raise _error_in_file(path, e) from None
  config = resolve_paths(with_overrides(config, overrides))
  validate(config)
  return config


def _import_config_file(path: str):
  """The config file as a module; a syntax error names its file and line."""
  spec = importlib.util.spec_from_file_location('jaxformer_user_config', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    where = f'{e.filename or path}:{e.lineno}' + (
        f':{e.offset}' if e.offset else '')
    code = f'\n  {e.text.rstrip()}' if e.text else ''
    raise ConfigError(f'{where}: syntax error in the config file: '
                      f'{e.msg}.{code}') from None
  except Exception as e:
    raise _error_in_file(path, e) from None
  return module


def _error_in_file(path: str, error: Exception) -> ConfigError:
  """`error`, raised while running the config file, at its line there."""
  lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
           if os.path.abspath(frame.filename) == os.path.abspath(path)]
  where = f'{path}:{lines[-1]}' if lines else path
  return ConfigError(f'{where}: the config file raised '
                     f'{type(error).__name__}: {error}')


def trained_model_config(saved: ml_collections.ConfigDict
                         ) -> ml_collections.ConfigDict:
  """The config a command uses for a trained model, from the one saved with
  it (which may come from anyone: a downloaded export): checked like a
  config file, the defaults standing in for keys it predates, and with no
  file path of its own (`path_keys.without_paths`), so that the data a
  command reads and where it writes come from the command's user."""
  config = default_config()
  _merge_saved(config, saved, 'the saved config')
  validate(config)
  return without_paths(config)


def _merge_saved(config: ml_collections.ConfigDict, saved, where: str):
  for key, value in saved.items():
    if key not in config:
      raise ConfigError(f'Unknown key {where}.{key}: not a model jaxformer '
                        'saved, or saved by a newer jaxformer.')
    if isinstance(config[key], ml_collections.ConfigDict) and key != 'model':
      if not isinstance(value, (dict, ml_collections.ConfigDict)):
        raise ConfigError(f'{where}.{key} is {value!r}, not a group of keys.')
      _merge_saved(config[key], value, f'{where}.{key}')
    else:
      config[key] = value
