"""Reading raw (source, target) sentence pairs for a split.

Kinds of source (`data.source`):
  'builtin'  generated English -> German sentences (see builtin.py);
  'tsv'      one file per split, lines 'source<TAB>target';
  'files'    a line-aligned pair of files per split (Moses style);
  'tfds'     a TensorFlow Datasets translation dataset, already prepared;
  'text'     one document per line (language modelling), paired with '';
  'jsonl', 'parquet'  records of named fields (records.py, source_pieces.py).
The same pairs serve the other tasks: 'tsv' lines 'text<TAB>label' (a class
name or number) or 'text<TAB>value' (numbers separated by spaces), and
`data.builtin.dataset` picks the built-in variant (see builtin.task_examples).
Files may be gzip-compressed (name ends in '.gz') and may live anywhere
jaxformer.storage.paths reads (local paths, gs://...).

Every problem with the input raises `DataError` (a ValueError) whose message
names the file, the line and the fix; a missing file raises `MissingFileError`,
which is also a FileNotFoundError.

Input is bounded: a line holds at most `max_line_bytes()` bytes, a file
read whole (a tokenizer model, vocab.json) MAX_FILE_BYTES once gunzipped.
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import itertools
import zlib
from collections.abc import Iterable, Iterator

import ml_collections

from jaxformer.storage import paths
from jaxformer.data import builtin, records, source_pieces
from jaxformer.data.input_errors import (DataError, Pair, max_line_bytes,
                                         storage_errors, too_long)

SPLITS = ('train', 'dev', 'test')

MAX_FILE_BYTES = 64 << 20
_BLOCK_BYTES = 1 << 24


# The fields of a record read as a (source, target) pair: the first kind a
# record has (a text alone is paired with '').
PAIR_FIELDS = (('source', 'target'), ('prompt', 'response'),
               ('text_a', 'text_b'), ('text', 'label'), ('text',))


def _read_records(data_config: ml_collections.ConfigDict, split: str
                  ) -> Iterator[Pair]:
  """The examples of a 'jsonl' or 'parquet' split as (source, target)
  pairs (PAIR_FIELDS)."""
  settings = data_config.get(data_config.source)
  for piece in source_pieces.plan(data_config, split):
    for number, record in read_piece(data_config, piece):
      names = next((names for names in PAIR_FIELDS if all(
          records.has_field(record, name, settings) for name in names)),
                   ('text',))
      texts = records.fields(record, names, settings,
                             lambda: piece.where(number))
      yield (texts + ('',))[:2]


def read_piece(data_config: ml_collections.ConfigDict,
               piece: source_pieces.Piece
               ) -> Iterator[tuple[int, tuple[str, ...] | dict]]:
  """(number, record) of each example of `piece`: a file's piece as
  `source_pieces.read_file_piece` reads it, a whole split (source_pieces.
  WHOLE) as `iter_split` does, numbered from 1."""
  if piece.path == source_pieces.WHOLE:
    return enumerate(iter_split(data_config, piece.split), start=1)
  return source_pieces.read_file_piece(data_config, piece)


def read_bytes(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
  """Contents of a local or gs:// file, gunzipped if its name ends in '.gz';
  raises DataError if there are more than `limit` bytes (once gunzipped)."""
  with _binary_stream(path) as stream, _gzip_errors(path):
    data = stream.read(limit + 1)
  if len(data) > limit:
    raise DataError(f'{path}: more than {limit} bytes'
                    f'{" once decompressed" if path.endswith(".gz") else ""}; '
                    'is this the right file?')
  return data


def _stream_lines(stream, name: str, limit: int) -> Iterator[bytes]:
  """The lines of a binary stream as its bytes come (read1: a pipe's line is
  not held back), up to an unended line over `limit` bytes: a DataError."""
  read = getattr(stream, 'read1', None) or stream.read
  line, number = bytearray(), 1
  while chunk := read(1 << 16):
    *ended, rest = chunk.split(b'\n')
    for piece in ended:
      yield bytes(line + piece)
      line.clear()
      number += 1
    line += rest
    if len(line) > limit:
      raise too_long(f'{name}:{number}', limit)
  if line:
    yield bytes(line)


def decode_lines(lines: Iterable[bytes], name: str, errors: str = 'strict',
                 fix: str = '') -> Iterator[str]:
  """`lines` (bytes, e.g. a binary stream) as text without line endings.

  Undecodable bytes become U+FFFD with errors='replace'; with 'strict' they
  raise a DataError naming `name`, the line and the byte (and `fix`), as
  does a line over `max_line_bytes()` (before it is read whole).
  """
  limit = max_line_bytes()
  if hasattr(lines, 'read'):
    lines = _stream_lines(lines, name, limit)
  for number, raw in enumerate(lines, start=1):
    if len(raw.rstrip(b'\r\n')) > limit:
      raise too_long(f'{name}:{number}', limit)
    if number == 1 and raw.startswith(codecs.BOM_UTF8):
      raw = raw[len(codecs.BOM_UTF8):]
    try:
      text = raw.decode('utf-8', errors)
    except UnicodeDecodeError as e:
      raise DataError(
          f'{name}:{number}: invalid UTF-8 ({e.reason} at byte {e.start + 1} '
          'of the line); re-encode the input as UTF-8, e.g. `iconv -f latin1 '
          f'-t utf-8`{fix}') from None
    yield text.rstrip('\r\n')


def _binary_stream(path: str):
  """An open binary stream of `path`, gunzipping if its name ends in '.gz'."""
  with storage_errors(path):
    stream = paths.open_bytes(path)
  return gzip.GzipFile(fileobj=stream, mode='rb') if path.endswith('.gz') else stream


@contextlib.contextmanager
def _gzip_errors(path: str):
  """Errors of reading `path` (a damaged .gz) as DataErrors that name it."""
  try:
    yield
  except (OSError, EOFError, zlib.error) as e:
    if not path.endswith('.gz'):
      raise DataError(f'{path}: cannot read it: {type(e).__name__}: '
                      f'{e}') from None
    raise DataError(f'{path}: not a valid gzip file ({e}); decompress it '
                    'or drop the .gz suffix if it is plain text') from None


def _long_line(data: bytes, limit: int) -> int | None:
  """Where the first line of `data` over `limit` bytes starts (the unended
  last one too), or None; one search per `limit` bytes, not per line."""
  start = 0
  while len(data) - start > limit:
    newline = data.rfind(b'\n', start, start + limit + 1)
    if newline == -1:
      return start
    start = newline + 1
  return None


def _blocks(path: str) -> Iterator[bytes]:
  """The bytes of `path` (gunzipped), in blocks that each end after a
  newline, except perhaps the last; a line longer than `max_line_bytes()`
  raises a DataError naming it, at most a block after its start."""
  limit = max_line_bytes()
  with _binary_stream(path) as stream:
    rest, lines = b'', 0
    while True:
      with _gzip_errors(path):
        block = stream.read(_BLOCK_BYTES)
      if not block:
        break
      data = rest + block
      del rest, block
      start = _long_line(data, limit)
      if start is not None:
        number = lines + data.count(b'\n', 0, start) + 1
        raise too_long(f'{path}:{number}', limit)
      end = data.rfind(b'\n') + 1
      if end:
        lines += data.count(b'\n', 0, end)
        yield data[:end]
      rest = data[end:]
    if rest:
      yield rest


def iter_lines(path: str) -> Iterator[str]:
  """The lines of a UTF-8 text file (plain or .gz), without line endings
  ('\\n' or '\\r\\n'), read block by block (the file is never whole in
  memory)."""
  offset = lines_before = 0
  blank = True
  for block in _blocks(path):
    start = len(codecs.BOM_UTF8) if offset == 0 and block.startswith(
        codecs.BOM_UTF8) else 0
    try:
      text = block[start:].decode('utf-8')
    except UnicodeDecodeError as e:
      line = lines_before + block.count(b'\n', 0, start + e.start) + 1
      raise DataError(
          f'{path}:{line}: invalid UTF-8 ({e.reason} at byte '
          f'{offset + start + e.start}); re-encode the file as UTF-8, e.g. '
          '`iconv -f latin1 -t utf-8`') from None
    offset += len(block)
    lines = text.split('\n')
    last = lines.pop()  # '' after a final newline, else the unended line.
    lines_before += len(lines)
    blank = blank and (not text or text.isspace())
    for line in lines:
      yield line[:-1] if line.endswith('\r') else line
    if last:
      yield last
  if blank:
    raise DataError(f'{path}: the file is empty; point the data config at a '
                    'file with one example per line')


def count_lines(path: str) -> int:
  """How many lines `iter_lines(path)` yields, counted in the raw blocks
  (nothing is decoded or checked)."""
  count = 0
  for block in _blocks(path):
    count += block.count(b'\n') + (not block.endswith(b'\n'))
  return count


def read_lines(path: str) -> list[str]:
  return list(iter_lines(path))


def _configured_path(paths: ml_collections.ConfigDict, group: str, key: str) -> str:
  path = paths.get(key)
  if not path:
    raise DataError(f'data.{group}.{key} is not set; give the path of the file')
  return path


def _read_builtin(data_config: ml_collections.ConfigDict, split: str) -> list[Pair]:
  settings = data_config.builtin
  dataset = settings.get('dataset', 'translation')
  if dataset == 'translation':
    return builtin.generate(settings[f'num_{split}'], settings.seed, split)
  return builtin.task_examples(dataset, settings[f'num_{split}'], settings.seed,
                               split)


def _read_text(data_config: ml_collections.ConfigDict, split: str) -> Iterator[Pair]:
  """One document per non-blank line, paired with '' (language modelling)."""
  path = _configured_path(data_config.text, 'text', split)
  return ((line, '') for line in iter_lines(path) if line.strip())


def _tsv_error(path: str, line_number: int, num_tabs: int) -> DataError:
  problem = 'no tab' if num_tabs == 0 else f'{num_tabs} tabs'
  return DataError(
      f'{path}:{line_number}: {problem}; each line must be '
      "'source<TAB>target' with exactly one tab (remove tabs inside "
      'sentences, and blank lines)')


def _read_tsv(data_config: ml_collections.ConfigDict, split: str) -> Iterator[Pair]:
  path = _configured_path(data_config.tsv, 'tsv', split)
  for line_number, line in enumerate(iter_lines(path), start=1):
    source, tab, target = line.partition('\t')
    if not tab or '\t' in target:
      raise _tsv_error(path, line_number, len(tab) + target.count('\t'))
    yield source, target


def _read_file_pair(data_config: ml_collections.ConfigDict, split: str
                    ) -> Iterator[Pair]:
  source_path = _configured_path(data_config.files, 'files', f'{split}_source')
  target_path = _configured_path(data_config.files, 'files', f'{split}_target')
  lines = itertools.zip_longest(iter_lines(source_path), iter_lines(target_path))
  for number, pair in enumerate(lines):
    if None in pair:
      longer = number + 1 + sum(1 for _ in lines)
      counts = (number, longer) if pair[0] is None else (longer, number)
      raise DataError(
          f'{source_path} has {counts[0]} lines but {target_path} has '
          f'{counts[1]}; the files must be line-aligned (line i of one '
          'translates line i of the other)')
    yield pair


def _read_tfds(data_config: ml_collections.ConfigDict, split: str
               ) -> Iterator[Pair]:
  from jaxformer.data import tfds_source  # pylint: disable=g-import-not-at-top
  return tfds_source.read(data_config, split)


_READERS = {
    'builtin': _read_builtin,
    'tsv': _read_tsv,
    'files': _read_file_pair,
    'tfds': _read_tfds,
    'text': _read_text, 'jsonl': _read_records, 'parquet': _read_records,
}


def iter_split(data_config: ml_collections.ConfigDict, split: str
               ) -> Iterator[Pair]:
  """The (source, target) pairs of `split` ('train', 'dev' or 'test') one by
  one; files are read block by block, never whole.  Raises DataError at the
  first bad line, or at the end if there was no pair."""
  if split not in SPLITS:
    raise DataError(f'split must be one of {SPLITS}, got {split!r}')
  if data_config.source not in _READERS:
    raise DataError(f'unknown data.source {data_config.source!r}; use one of '
                    f'{tuple(_READERS)}')
  empty = True
  for pair in _READERS[data_config.source](data_config, split):
    empty = False
    yield pair
  if empty:
    raise DataError(f'the {split} split of data.source={data_config.source!r} '
                    'has no examples; check its size or files')


def read_split(data_config: ml_collections.ConfigDict, split: str) -> list[Pair]:
  """All (source, target) sentence pairs of `split` ('train', 'dev' or 'test')."""
  return list(iter_split(data_config, split))


def count_pairs(data_config: ml_collections.ConfigDict, split: str) -> int:
  """How many pairs `iter_split` yields, if it yields without error: lines
  counted without decoding for 'tsv' and 'files', else the pairs read."""
  files = split_files(data_config, split)
  if data_config.source in ('tsv', 'files') and files:
    return count_lines(files[0])
  return sum(1 for _ in iter_split(data_config, split))


def split_files(data_config: ml_collections.ConfigDict, split: str) -> list[str]:
  """The files that `split` is read from ([] for 'builtin' and 'tfds')."""
  settings = data_config.get(data_config.source)
  keys = {'tsv': [split], 'text': [split], 'jsonl': [split], 'parquet': [split],
          'files': [f'{split}_source', f'{split}_target']}
  given = [settings[key] for key in keys.get(data_config.source, [])
           if settings.get(key)]
  if data_config.source in ('jsonl', 'parquet'):
    return [path for pattern in given for path in paths.matching_files(pattern)]
  return given
