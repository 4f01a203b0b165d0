"""`--config.key=value` overrides from the command line, each parsed by
the type of the key's current value (ml_collections' `config_flags`)."""
import ast
import difflib
import functools
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags

from jaxformer.storage.errors import ConfigError


def _literal(text: str):
  """A Python literal, or else the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


class _ListParser(flags.ArgumentParser):
  """Lists (`mesh.axis_rules`, `data.labels`) given as Python literals."""

  def parse(self, argument):
    value = _literal(argument) if isinstance(argument, str) else argument
    if not isinstance(value, (list, tuple)):
      raise ValueError(f'expected a list such as [1, 2], got {argument!r}')
    return list(value)


class _UnsetParser(flags.ArgumentParser):
  """Keys whose default is None (`data.tfds.data_dir`): a literal or text."""

  def parse(self, argument):
    return _literal(argument) if isinstance(argument, str) else argument


@functools.cache
def _register_parsers() -> None:
  """ml_collections parses scalars and tuples by the default's type; these
  two kinds of default it does not know. Registered (once, process-wide)
  when overrides are first parsed, not at import."""
  config_flags.register_flag_parser_for_type(list, _ListParser())
  config_flags.register_flag_parser_for_type(type(None), _UnsetParser())


def _check_key(config: ml_collections.ConfigDict, dotted: str) -> None:
  """Raises for a key `config` does not have, naming the closest known."""
  *parents, leaf = dotted.split('.')
  node = config
  for depth, name in enumerate(parents + [leaf]):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      prefix = '.'.join(parents[:depth])
      known = sorted(node.keys()) if hasattr(node, 'keys') else []
      close = difflib.get_close_matches(name, known, n=3)
      hint = f' Did you mean {close}?' if close else f' Known keys: {known}.'
      raise ConfigError(
          f'Unknown config key {dotted!r}: {prefix or "config"} has no '
          f'{name!r}.{hint}')
    node = node[name]


def _as_flag(override: str) -> str:
  """`--config.a.b=v`, from that or `config.a.b=v` or `a.b=v`."""
  override = override.removeprefix('--').removeprefix('config.')
  if '=' not in override:
    raise ConfigError(f'Override {override!r} is not of the form key=value.')
  return f'--config.{override}'


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with `--config.a.b=value` overrides applied (the
  `--config.` is optional), each parsed by the type of its current value.

  The parsing is ml_collections' `config_flags` (Flax's and big_vision's
  convention), on flag values of our own: `DEFINE_config_dict` rather
  than `DEFINE_config_file`, because the file is loaded here (so that an
  error in it names its file and line) and absl must not parse the whole
  command line (argparse serves the subcommands). An unknown key is an
  error that names the closest known keys."""
  _register_parsers()
  flags_argv = [_as_flag(o) for o in overrides]
  for flag in flags_argv:
    _check_key(config, flag[len('--config.'):].split('=', 1)[0])
  values = flags.FlagValues()
  argv = ['jaxformer'] + flags_argv
  try:
    config_flags.DEFINE_config_dict(
        'config', ml_collections.ConfigDict(config.to_dict()),
        flag_values=values, lock_config=False, sys_argv=argv)
    values(argv)
  except (flags.Error, TypeError, ValueError) as e:
    raise ConfigError(_flag_error(e)) from None
  return values['config'].value


def _flag_error(error: Exception) -> str:
  """absl's 'flag --config.a.b=v: reason' as '--config.a.b: reason'."""
  text = str(error).splitlines()[0]
  if text.startswith('flag --config.') and ': ' in text:
    flag, reason = text.removeprefix('flag ').split(': ', 1)
    return f'{flag.split("=", 1)[0]}: {reason}'
  return text
