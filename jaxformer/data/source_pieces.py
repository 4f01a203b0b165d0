"""A split's input cut into pieces that processes read apart: a file's byte
range (of whole lines), a Parquet row group, or the whole split.

  'text', 'tsv', 'jsonl'  each file (a glob names several) in ranges of
                          about `piece_bytes`; a piece holds the lines that
                          start inside its range. A .gz file is one piece
                          (it cannot be entered in the middle).
  'parquet'               one piece per row group of each file.
  others                  one piece: the split as `sources.iter_split`
                          reads it ('builtin', 'tfds', 'files').

The pieces depend only on the files' names and sizes and `piece_bytes`, so
every process plans the same pieces, and the examples of the split are the
pieces' examples in plan order, however many processes read them.

`read_file_piece` yields each example as (its number in the piece, a record): a
tuple of texts for positional sources (a 'text' line, a 'tsv' line's
columns, a pair), or a dict of fields ('jsonl', 'parquet'; records.py).
`Piece.where(number)` names the file and line (or row group and row) of an
example for an error message; the line count before a range is only read
then.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
from collections.abc import Iterator

import ml_collections

from jaxformer.data import records
from jaxformer.data.input_errors import (DataError, MissingFileError,
                                         max_line_bytes, storage_errors,
                                         too_long)
from jaxformer.storage import paths

PIECE_BYTES = 64 << 20
LINE_SOURCES = ('text', 'tsv', 'jsonl')
FILE_SOURCES = LINE_SOURCES + ('parquet',)
WHOLE = ''  # Piece.path of a split read whole by `sources.read_piece`.


@dataclasses.dataclass(frozen=True)
class Piece:
  """Lines starting in bytes [start, end) of `path` (end -1: to its end), or
  row group `row_group` of a Parquet file, or the whole split (path '')."""
  path: str
  start: int = 0
  end: int = -1
  row_group: int = -1
  split: str = ''  # of a whole split

  def where(self, number: int) -> str:
    """'path:line' (or 'path, row group g, row r') of example `number`
    (1-based) of the piece."""
    if self.row_group >= 0:
      return f'{self.path}, {self.line(number)}'
    if self.path == WHOLE:
      return self.line(number)
    return f'{self.path}:{_lines_before(self.path, self.start) + number}'

  def line(self, number: int) -> str:
    """'line n' (or 'row group g, row r', 'example n') of example `number`."""
    if self.row_group >= 0:
      return f'row group {self.row_group}, row {number}'
    if self.path == WHOLE:
      return f'example {number}'
    return f'line {_lines_before(self.path, self.start) + number}'


def split_paths(data_config: ml_collections.ConfigDict, split: str
                ) -> list[str]:
  """The files of `split` of a file source, globs expanded, in order."""
  pattern = data_config.get(data_config.source, {}).get(split, '')
  if not pattern:
    raise DataError(
        f'data.{data_config.source}.{split} is not set; give the path (or a '
        'glob) of the files')
  files = paths.matching_files(pattern)
  if not files:
    raise MissingFileError(
        f'{pattern}: no file matches; check data.{data_config.source}.{split}')
  return files


def plan(data_config: ml_collections.ConfigDict, split: str,
         piece_bytes: int = 0) -> list[Piece]:
  """The pieces of `split`, in the order of its examples."""
  if data_config.source not in FILE_SOURCES:
    return [Piece(WHOLE, split=split)]
  piece_bytes = piece_bytes or PIECE_BYTES
  pieces = []
  for path in split_paths(data_config, split):
    if data_config.source == 'parquet':
      groups = records.parquet_row_groups(path)
      pieces += [Piece(path, row_group=group) for group in range(groups)]
      continue
    size = _size(path)
    if path.endswith('.gz') or size <= piece_bytes:
      pieces.append(Piece(path))
      continue
    starts = list(range(0, size, piece_bytes))
    pieces += [Piece(path, start, min(start + piece_bytes, size))
               for start in starts]
  return pieces


def _size(path: str) -> int:
  try:
    return paths.stat(path)[0]
  except FileNotFoundError:
    raise MissingFileError(
        f'{path}: no such file; check the path in the data config') from None


def _lines_before(path: str, start: int) -> int:
  """How many lines of `path` start before the first line that starts at
  or after byte `start` (the lines ending before byte start - 1, and the
  one ending at or after it)."""
  if start <= 0:
    return 0
  count, read = 1, 0
  with paths.open_bytes(path) as stream:
    while read < start - 1:
      block = stream.read(min(1 << 24, start - 1 - read))
      if not block:
        break
      count += block.count(b'\n')
      read += len(block)
  return count


def _raw_lines(piece: Piece) -> Iterator[bytes]:
  """The lines (bytes, with their ending) that start in `piece`'s range."""
  stream = paths.open_bytes(piece.path)
  if piece.path.endswith('.gz'):
    stream = gzip.GzipFile(fileobj=stream, mode='rb')
  limit = max_line_bytes()
  with stream:
    if piece.start > 0:
      stream.seek(piece.start - 1)
      stream.readline()  # The end of the line that began before the range.
    position = stream.tell() if piece.end >= 0 else 0
    while piece.end < 0 or position < piece.end:
      line = stream.readline(limit + 2)
      if not line:
        return
      position += len(line)
      yield line


def _text_lines(piece: Piece) -> Iterator[tuple[int, str]]:
  """(number, text) of each line of `piece`, decoded (UTF-8, strict)."""
  limit = max_line_bytes()
  for number, raw in enumerate(_raw_lines(piece), start=1):
    if len(raw.rstrip(b'\r\n')) > limit:
      raise too_long(piece.where(number), limit)
    if number == 1 and piece.start == 0 and raw.startswith(codecs.BOM_UTF8):
      raw = raw[len(codecs.BOM_UTF8):]
    try:
      text = raw.decode('utf-8')
    except UnicodeDecodeError as e:
      raise DataError(
          f'{piece.where(number)}: invalid UTF-8 ({e.reason} at byte '
          f'{e.start + 1} of the line); re-encode the file as UTF-8, e.g. '
          '`iconv -f latin1 -t utf-8`') from None
    yield number, text.rstrip('\r\n')


def read_file_piece(data_config: ml_collections.ConfigDict, piece: Piece
                    ) -> Iterator[tuple[int, tuple[str, ...] | dict]]:
  """(number, record) of each example of a file's `piece` (module
  docstring); `sources.read_piece` reads any piece."""
  source = data_config.source
  with storage_errors(piece.path):
    paths.stat(piece.path)
  if source == 'parquet':
    yield from records.parquet_rows(piece.path, piece.row_group)
    return
  for number, line in _text_lines(piece):
    if source == 'text':
      if line.strip():
        yield number, (line,)
    elif source == 'tsv':
      yield number, tuple(line.split('\t'))
    elif line.strip():
      yield number, records.json_record(line, piece.where, number)
