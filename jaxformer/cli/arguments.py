"""What the commands' arguments share: the usage line of config overrides,
and argparse types for numbers in range and for paths."""
import argparse

from jaxformer.storage import paths

USAGE_OVERRIDES = ('Config overrides: --config.KEY=VALUE (e.g. '
                   '--config.train.num_steps=2000).')


def number(kind, allowed_name: str):
  """An argparse type: a `kind` number in config_ranges' `allowed_name`."""
  def parse(text: str):
    from jaxformer.config import ranges as config_ranges
    allowed = getattr(config_ranges, allowed_name)
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f'{text!r} is not a{"n integer" if kind is int else " number"}'
      ) from None
    if value != value or value not in allowed:
      raise argparse.ArgumentTypeError(f'{text} is out of range; it must be '
                                       f'{allowed}')
    return value
  return parse


POSITIVE_INT = number(int, 'POSITIVE')
NON_NEGATIVE_INT = number(int, 'NON_NEGATIVE')
NON_NEGATIVE_FLOAT = number(float, 'NON_NEGATIVE')


def path(text: str) -> str:
  """An argparse type: a file or directory as people type it (relative to
  the working directory, `~/...`, or gs://...), made absolute once here so
  that every layer below, Orbax included, gets one spelling of it."""
  if not text.strip():
    raise argparse.ArgumentTypeError('an empty path; name a file or '
                                     'directory')
  return paths.absolute(text)
