"""What every reader of the input raises, and the one limit they share.

Every problem with the input raises `DataError` (a ValueError) whose message
names the file, the line and the fix; a missing file raises
`MissingFileError`, which is also a FileNotFoundError. A line holds at most
`max_line_bytes()` bytes.
"""
from __future__ import annotations

import contextlib
import os

from jaxformer.storage import paths

# A (source, target) pair of texts; a text alone is paired with ''.
Pair = tuple[str, str]

# The configured data cannot be read; the message says how to fix it.
DataError = paths.DataError

MAX_LINE_BYTES = 8 << 20
LINE_BYTES_ENV = 'JAXFORMER_MAX_LINE_BYTES'


class MissingFileError(DataError, FileNotFoundError):
  """A configured data file does not exist."""


@contextlib.contextmanager
def storage_errors(path: str):
  """Errors of opening or reading `path` as DataErrors that name it."""
  try:
    yield
  except FileNotFoundError:
    raise MissingFileError(
        f'{path}: no such file; check the path in the data config') from None
  except IsADirectoryError:
    raise DataError(f'{path}: is a directory; name a file in the data '
                    'config') from None
  except Exception as e:  # Storage clients raise many types.
    raise DataError(f'{path}: cannot read it: {type(e).__name__}: '
                    f'{str(e).splitlines()[0] if str(e) else ""}') from None


def max_line_bytes(environ=os.environ) -> int:
  """The longest line read: $JAXFORMER_MAX_LINE_BYTES, else MAX_LINE_BYTES."""
  text = environ.get(LINE_BYTES_ENV, '').strip() or str(MAX_LINE_BYTES)
  if not text.isdigit() or not int(text):
    raise DataError(f'{LINE_BYTES_ENV}={text!r} is not a positive number of '
                    'bytes; unset it or give one, e.g. 16777216')
  return int(text)


def too_long(where: str, limit: int) -> DataError:
  """The error of a line at `where` ('file:line') longer than `limit`."""
  return DataError(
      f'{where}: the line is longer than {limit} bytes; split it (is this '
      f'the right file?), or raise the limit with {LINE_BYTES_ENV}=BYTES')
