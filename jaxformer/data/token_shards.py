"""A split tokenized once, in parallel, into shards that a manifest commits:
the token cache of every task that reads rows (`row_layouts.py`).

A split's folder of the cache directory (`token_cache.directory`):

  <split>-<key>/00000.<field>.npy          piece 0's [tokens] (uint16, or
                00000.<field>_lengths.npy  int32 over 65,535 ids) and
                00000.done.json            [examples] int32 lengths; its
                00001...                   record, written last
                manifest.json              the pieces' records: the commit

Each piece of the split (`source_pieces.plan`: a file's byte range, a row
group) is one shard. Process p of P tokenizes pieces p, p + P, ...
(`workers` > 1: in a pool of that many local processes), skipping those
whose record is already there, so a killed tokenization goes on from its
finished pieces; process 0 then waits for every record and writes the
manifest. A shard's bytes depend only on its piece, the task's layout and
the tokenizer, so 1 or N processes write the same cache.

The key (`token_cache.cache_key`) covers the layout, the tokenizer's bytes
and each file's path, size and modification time; the manifest holds it
whole and is compared at reading, as are the size of every file and the
largest id against the vocabulary, so a cache of other data, of another
tokenizer or cut short is refused in one line naming the fix.
"""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing
import os
from collections.abc import Callable, Sequence

import ml_collections
import numpy as np

from jaxformer.data import records
from jaxformer.data import source_pieces
from jaxformer.data import sources
from jaxformer.storage import paths

FORMAT = 2
MANIFEST = 'manifest.json'
ENCODE_CHUNK = 1 << 14  # examples per tokenizer call: bounds Python lists
# How a field is stored: ragged ids or numbers, or one string per example
# (an index into the piece's distinct strings).
KINDS = {'tokens': None, 'types': np.uint8, 'numbers': np.float32,
         'strings': np.int32}


@dataclasses.dataclass(frozen=True)
class Encoding:
  """What a task keeps of each example: `fields` {name: kind}, made by
  `encode(tokenizer, texts, data_config, where)` from the records' texts
  (tuples in the order of one of `columns`, `where(i)` naming record i)
  as {name: [a list per example (a string for 'strings')]}."""
  name: str
  columns: tuple[tuple[str, ...], ...]
  fields: dict[str, str]
  encode: Callable


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def _npy_bytes(array: np.ndarray) -> bytes:
  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  return buffer.getvalue()


def columns_of(record, encoding: Encoding, data_config,
               where: Callable[[], str]) -> tuple[int, tuple[str, ...]]:
  """(variant, texts) of a record: the `encoding.columns` entry it fits
  (`where()` names the record, asked only for an error)."""
  if isinstance(record, dict):
    settings = data_config.get(data_config.source)
    for variant, names in enumerate(encoding.columns):
      if all(records.has_field(record, n, settings) for n in names[:1]):
        return variant, records.fields(record, names, settings, where)
    return 0, records.fields(record, encoding.columns[0], settings, where)
  for variant, names in enumerate(encoding.columns):
    if len(record) == len(names):
      return variant, tuple(record)
  if len(encoding.columns) == 1 and len(encoding.columns[0]) == 1:
    return 0, tuple(record[:1])  # A one-text task reads the first column.
  wanted = ' or '.join("'" + '<TAB>'.join(names) + "'"
                       for names in encoding.columns)
  raise sources.DataError(
      f'{where()}: {len(record)} column(s); this task reads {wanted} lines, '
      'with tabs between the columns and none inside them')


def _ragged(values: list, dtype) -> tuple[np.ndarray, np.ndarray]:
  """(values end to end [total] dtype, lengths [examples] int32)."""
  lengths = np.fromiter(map(len, values), np.int32, len(values))
  return (np.fromiter((v for each in values for v in each), dtype,
                      int(lengths.sum())), lengths)


def encode_piece(data_config: ml_collections.ConfigDict,
                 piece: source_pieces.Piece, encoding: Encoding, tokenizer
                 ) -> tuple[dict[str, np.ndarray], dict]:
  """(shard files {name: array}, record) of one piece; each chunk of
  ENCODE_CHUNK examples becomes arrays at once (a piece's Python lists
  would take ~20 times its tokens' bytes)."""
  dtype = token_dtype(tokenizer.vocab_size)
  parts = {name: [] for name in encoding.fields}
  strings = {name: {} for name, kind in encoding.fields.items()
             if kind == 'strings'}  # {text: index in order of appearance}
  variant, chunk, numbers = None, [], []

  def flush():
    where = lambda i: piece.where(numbers[i])
    encoded = encoding.encode(tokenizer, chunk, data_config, where)
    for name, kind in encoding.fields.items():
      if kind == 'strings':
        index = strings[name]
        parts[name].append(np.array(
            [index.setdefault(text, len(index)) for text in encoded[name]],
            np.int32))
      else:
        parts[name].append(_ragged(encoded[name], KINDS[kind] or dtype))
    chunk.clear()
    numbers.clear()

  for number, record in sources.read_piece(data_config, piece):
    kind, texts = columns_of(record, encoding, data_config,
                             lambda: piece.where(number))
    if variant is None:
      variant, first = kind, number
    elif kind != variant:
      raise sources.DataError(
          f'{piece.where(number)}: {len(texts)} column(s), but '
          f'{piece.line(first)} has {len(encoding.columns[variant])}; a file '
          'holds one kind of lines (a text and its label, or a sentence pair '
          'and its label), not both (remove tabs inside texts)')
    chunk.append(texts)
    numbers.append(number)
    if len(chunk) == ENCODE_CHUNK:
      flush()
  if chunk:
    flush()
  files, record = {}, {'examples': 0, 'variant': variant, 'max_id': -1}
  for name, kind in encoding.fields.items():
    if kind == 'strings':
      distinct = sorted(strings[name])
      order = np.array([distinct.index(text) for text in strings[name]],
                       np.int32)
      files[name] = order[np.concatenate(parts[name] or [
          np.zeros(0, np.int32)])]
      record[f'{name}_strings'] = distinct
      record['examples'] = len(files[name])
      continue
    chunks = parts[name] or [_ragged([], KINDS[kind] or dtype)]
    flat = np.concatenate([values for values, _ in chunks])
    files[name] = flat
    files[f'{name}_lengths'] = np.concatenate([lengths for _, lengths in chunks])
    record['examples'] = len(files[f'{name}_lengths'])
    if kind == 'tokens' and len(flat):
      record['max_id'] = max(record['max_id'], int(flat.max()))
  return files, record


def _write_piece(task) -> None:
  """Tokenizes piece `number` into `folder` (a pool's task: a tuple)."""
  data_config, pieces, number, encoding, tokenizer, folder, key = task
  files, record = encode_piece(data_config, pieces[number], encoding,
                               tokenizer)
  sizes = {}
  for name, array in files.items():
    contents = _npy_bytes(array)
    paths.write_bytes(paths.join(folder, f'{number:05d}.{name}.npy'), contents)
    sizes[f'{number:05d}.{name}.npy'] = len(contents)
  record.update(key=key, files=sizes)
  paths.write_text(_record_path(folder, number), json.dumps(record))


def _record_path(folder: str, number: int) -> str:
  return paths.join(folder, f'{number:05d}.done.json')


def _finished(folder: str, number: int, key: str) -> dict | None:
  """The record of piece `number` if it is written under `key`."""
  try:
    record = json.loads(paths.read_text(_record_path(folder, number)))
  except (FileNotFoundError, ValueError):
    return None
  return record if record.get('key') == key else None


def tokenize(data_config: ml_collections.ConfigDict, split: str,
             encoding: Encoding, tokenizer, folder: str, key: str, *,
             process_index: int = 0, process_count: int = 1, workers: int = 1,
             piece_bytes: int = 0) -> None:
  """Writes this process's share of the pieces of `split` not yet written
  into `folder` (module docstring); commits nothing."""
  pieces = source_pieces.plan(data_config, split, piece_bytes)
  todo = [number for number in range(process_index, len(pieces),
                                     process_count)
          if _finished(folder, number, key) is None]
  tasks = [(data_config, pieces, number, encoding, tokenizer, folder, key)
           for number in todo]
  if workers > 1 and len(tasks) > 1:
    context = multiprocessing.get_context('spawn')
    with context.Pool(min(workers, len(tasks))) as pool:
      for _ in pool.imap_unordered(_write_piece, tasks):
        pass
  else:
    for task in tasks:
      _write_piece(task)


def commit(data_config: ml_collections.ConfigDict, split: str,
           encoding: Encoding, folder: str, key: str, *, piece_bytes: int = 0,
           wait: Callable[[str], None] | None = None) -> dict:
  """Writes the manifest of `folder` from the records of every piece (each
  awaited by `wait(path)`, if given) and returns it."""
  pieces = source_pieces.plan(data_config, split, piece_bytes)
  records = []
  for number, piece in enumerate(pieces):
    record = _finished(folder, number, key)
    if record is None and wait is not None:
      wait(_record_path(folder, number))
      record = _finished(folder, number, key)
    if record is None:
      raise sources.DataError(
          f'{folder}: piece {number} ({piece.path}) is not tokenized; run '
          'again to tokenize what is missing')
    records.append(record)
  variants = {r['variant'] for r in records if r['variant'] is not None}
  if len(variants) > 1:
    raise sources.DataError(
        f'the {split} split mixes lines of '
        f'{sorted(len(encoding.columns[v]) for v in variants)} columns '
        'across its files; every file of a split holds one kind of lines')
  if not sum(r['examples'] for r in records):
    raise sources.DataError(f'the {split} split of data.source='
                            f'{data_config.source!r} has no examples; check '
                            'its files')
  manifest = dict(format=FORMAT, key=key, encoding=encoding.name,
                  pieces=records)
  paths.write_text(paths.join(folder, MANIFEST), json.dumps(manifest))
  return manifest


def _damaged(path: str, problem: str, folder: str) -> sources.DataError:
  return sources.DataError(
      f'{path}: {problem}; the token cache is damaged: delete {folder} to '
      'tokenize the split again')


def read_manifest(folder: str, key: str, vocab_size: int) -> dict:
  """The manifest of `folder`, checked against `key`, the vocabulary and
  the sizes of its files."""
  path = paths.join(folder, MANIFEST)
  try:
    manifest = json.loads(paths.read_text(path))
  except ValueError:
    raise _damaged(path, 'not JSON', folder) from None
  if manifest.get('format') != FORMAT or manifest.get('key') != key:
    raise sources.DataError(
        f'{path}: written for other data, another tokenizer or another '
        f'format (key {str(manifest.get("key"))[:12]}, not {key[:12]}); '
        f'delete {folder} to tokenize the split again')
  largest = max(record['max_id'] for record in manifest['pieces'])
  if largest >= vocab_size:
    raise _damaged(path, f'token id {largest} is not below the vocabulary '
                   f'size {vocab_size}', folder)
  return manifest


def check_files(folder: str, local: str, manifest: dict) -> None:
  """Raises naming the first file of `local` (the files of `folder`) whose
  size is not the manifest's."""
  for record in manifest['pieces']:
    for name, size in record['files'].items():
      path = os.path.join(local, name)
      actual = os.path.getsize(path) if os.path.exists(path) else None
      if actual != size:
        raise _damaged(path, f'{actual} bytes, the manifest says {size}'
                       if actual is not None else 'missing', folder)


def file_names(manifest: dict) -> list[str]:
  return [name for record in manifest['pieces'] for name in record['files']]


def load(local: str, manifest: dict, name: str, *, lengths: bool
         ) -> list[tuple[np.ndarray, np.ndarray | None]]:
  """Each shard's (memory-mapped values, lengths or None) of field `name`."""
  shards = []
  for number in range(len(manifest['pieces'])):
    prefix = os.path.join(local, f'{number:05d}.{name}')
    shards.append((paths.memory_map_npy(prefix + '.npy'),
                   paths.memory_map_npy(prefix + '_lengths.npy')
                   if lengths else None))
  return shards


def piece_strings(manifest: dict, name: str) -> list[Sequence[str]]:
  """Each piece's distinct strings of 'strings' field `name`."""
  return [record[f'{name}_strings'] for record in manifest['pieces']]
