"""Examples as named fields: JSONL lines and Parquet rows (as Hugging Face
`datasets` publish them), and the fields a task reads from them.

A task names its fields ('text'; 'prompt', 'response'; 'text', 'label' or
'text_a', 'text_b', 'label'; 'source', 'target'); `data.jsonl.<field>`
(`data.parquet.<field>`) says which key of a record holds each, by default
the field's own name. A key may name a nested value with dots
('translation.en'); 'source' and 'target' missing from a record that has
Hugging Face's {"translation": {"en": ..., "de": ...}} are read from it
under `source_language` and `target_language`.

Texts must be strings; a label may also be a number, a boolean or a list of
numbers (a regression label: they are joined by spaces). Every problem is a
DataError naming the file, the line (or row group and row) and the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence

import ml_collections

from jaxformer.data import input_errors
from jaxformer.storage import paths

NAMED_SOURCES = ('jsonl', 'parquet')
LABEL = 'label'
# The field of a chat record that holds its list of messages.
MESSAGES = 'messages'
_BATCH_ROWS = 4096


def json_record(line: str, where: Callable[[int], str], number: int) -> dict:
  """The JSON object on `line` (example `number`, named by `where`)."""
  try:
    value = json.loads(line)
  except json.JSONDecodeError as e:
    raise input_errors.DataError(
        f'{where(number)}: not valid JSON ({e.msg} at column {e.colno}); '
        'each line of a JSONL file is one JSON object') from None
  if not isinstance(value, dict):
    raise input_errors.DataError(
        f'{where(number)}: a JSON {type(value).__name__}, not an object; '
        'each line of a JSONL file is one object, e.g. {"text": "..."}')
  return value


def _parquet_file(path: str):
  import pyarrow.parquet as pq  # Deferred: only Parquet sources need it.
  with input_errors.storage_errors(path):
    stream = paths.open_bytes(path)
  try:
    return pq.ParquetFile(stream)
  except Exception as e:  # pyarrow raises several types for a bad file.
    raise input_errors.DataError(f'{path}: not a Parquet file ({e}); '
                                 'point data.parquet at .parquet files'
                                 ) from None


def parquet_row_groups(path: str) -> int:
  """How many row groups the Parquet file `path` has (its footer only)."""
  return _parquet_file(path).num_row_groups


def parquet_rows(path: str, group: int) -> Iterator[tuple[int, dict]]:
  """(row number in the group, row as a dict) of row group `group`, a few
  thousand rows at a time."""
  number = 0
  for batch in _parquet_file(path).iter_batches(_BATCH_ROWS,
                                                row_groups=[group]):
    for row in batch.to_pylist():
      number += 1
      yield number, row


def _key(settings: ml_collections.ConfigDict, name: str, record: dict) -> str:
  key = settings.get(name) or name
  if (name in ('source', 'target') and key == name and key not in record
      and isinstance(record.get('translation'), dict)):
    return f'translation.{settings.get(name + "_language", "")}'
  return key


def _lookup(record: dict, key: str):
  value = record
  for part in key.split('.'):
    if not isinstance(value, dict) or part not in value:
      raise KeyError(key)
    value = value[part]
  return value


def _as_text(value, name: str, where: Callable[[], str], key: str) -> str:
  if isinstance(value, str):
    return value
  if name == MESSAGES and isinstance(value, list):
    return json.dumps({'messages': value})  # As a chat line holds it.
  if name == LABEL and isinstance(value, (bool, int, float)):
    return str(int(value)) if isinstance(value, bool) else str(value)
  if (name == LABEL and isinstance(value, list) and value and
      all(isinstance(v, (int, float)) for v in value)):
    return ' '.join(map(str, value))
  wanted = 'a string, a number or a list of numbers' if name == LABEL else (
      'a string')
  raise input_errors.DataError(
      f'{where()}: field {key!r} ({name}) is a {type(value).__name__}, not '
      f'{wanted}; fix the data or point data.<source>.{name} at another key')


def has_field(record: dict, name: str,
              settings: ml_collections.ConfigDict) -> bool:
  """Whether `record` holds field `name`."""
  try:
    _lookup(record, _key(settings, name, record))
  except KeyError:
    return False
  return True


def fields(record: dict, names: Sequence[str],
           settings: ml_collections.ConfigDict, where: Callable[[], str]
           ) -> tuple[str, ...]:
  """The texts of fields `names` of `record` (`where()` names it, asked
  only for an error)."""
  texts = []
  for name in names:
    key = _key(settings, name, record)
    try:
      value = _lookup(record, key)
    except KeyError:
      raise input_errors.DataError(
          f'{where()}: no field {key!r} ({name}); the record has '
          f'{sorted(record)[:8]}; set data.<source>.{name} to the key that '
          'holds it') from None
    texts.append(_as_text(value, name, where, key))
  return tuple(texts)
