"""What each row task keeps of an example in the token cache, and its rows.

An `Encoding` (token_shards.py) names the columns a task reads and the
fields it stores; a layout below turns a committed split into a table of
rows (row_tables.py):

  lm_packed           'text' -> documents (text + EOS) packed into rows
  lm_prompt_response  'prompt', 'response' -> one pair per row
  lm_chat             a conversation ('text': its JSON line, or a record's
                      'messages') -> its ids and assistant mask, one per row
  classification      'text' or 'text_a', 'text_b'; 'label' (a class name)
  regression          the same; 'label' holds numbers

`open_split` tokenizes a split once (each process its share of the
pieces) and opens it; with no cache directory, into a temporary folder.
"""

from __future__ import annotations

import json
import tempfile
import time
import weakref
from collections.abc import Sequence

import ml_collections
import numpy as np

from jaxformer.data import chat_template
from jaxformer.data import lm_rows
from jaxformer.data import mixture as mixture_lib
from jaxformer.data import records
from jaxformer.data import row_tables
from jaxformer.data import source_pieces
from jaxformer.data import sources
from jaxformer.data import token_cache
from jaxformer.data import token_shards
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.storage import paths

Encoding = token_shards.Encoding
TEXTS = (('text', 'label'), ('text_a', 'text_b', 'label'))


def _documents(tokenizer, texts, data_config, where):
  return {'text': lm_rows.document_ids(tokenizer, [t[0] for t in texts])}


def _pairs(tokenizer, texts, data_config, where):
  for number, (_, response) in enumerate(texts):
    if not response:
      raise sources.DataError(
          f'{where(number)}: no response; data.lm_rows=\'prompt_response\' '
          "reads 'prompt<TAB>response' lines (or 'prompt' and 'response' "
          'fields)')
  return {'prompt': lm_rows.document_ids(tokenizer, [t[0] for t in texts]),
          'response': lm_rows.document_ids(tokenizer, [t[1] for t in texts])}


def _conversations(tokenizer, texts, data_config, where):
  template = chat_template.template_of(tokenizer)
  ids, masks = [], []
  for number, (line,) in enumerate(texts):
    try:
      conversation = json.loads(line)
    except json.JSONDecodeError as e:
      raise chat_template.ChatError(f'{where(number)}: not JSON ({e.msg}); '
                                    'data.lm_rows=chat reads one JSON '
                                    'conversation a line') from None
    messages = chat_template.check_conversation(conversation, where(number))
    example_ids, mask = lm_rows.chat_example(tokenizer, template, messages)
    ids.append(example_ids)
    masks.append(mask)
  return {'tokens': ids, 'assistant_mask': masks}


def _inputs(tokenizer, texts):
  if len(texts[0]) == 2:
    ids = tokenizer.encode([text for text, _ in texts])
    return {'inputs': ids, 'inputs_types': [[0] * len(each) for each in ids]}
  encoded = [tokenizer.encode_pair(a, b) for a, b, _ in texts]
  return {'inputs': [list(ids) for ids, _ in encoded],
          'inputs_types': [list(types) for _, types in encoded]}


def _classes(tokenizer, texts, data_config, where):
  return {**_inputs(tokenizer, texts), 'label': [t[-1] for t in texts]}


def _values(tokenizer, texts, data_config, where):
  values = []
  for number, text in enumerate(t[-1] for t in texts):
    try:
      values.append([float(field) for field in text.split()])
    except ValueError:
      raise sources.DataError(
          f'{where(number)}: label {text!r} is not numbers; regression lines '
          "are 'text<TAB>value' with model.regression_dim space-separated "
          'numbers') from None
  return {**_inputs(tokenizer, texts), 'values': values}


_INPUTS = {'inputs': 'tokens', 'inputs_types': 'types'}
ENCODINGS = {encoding.name: encoding for encoding in (
    Encoding('lm_packed', (('text',),), {'text': 'tokens'}, _documents),
    Encoding('lm_prompt_response', (('prompt', 'response'),),
             {'prompt': 'tokens', 'response': 'tokens'}, _pairs),
    Encoding('lm_chat', (('text',), (records.MESSAGES,)),
             {'tokens': 'tokens', 'assistant_mask': 'types'}, _conversations),
    Encoding('classification', TEXTS, {**_INPUTS, 'label': 'strings'},
             _classes),
    Encoding('regression', TEXTS, {**_INPUTS, 'values': 'numbers'}, _values),
)}


def _wait_for(path: str, seconds: float) -> None:
  """Returns once another process wrote the piece record `path`."""
  deadline = time.monotonic() + seconds
  while not paths.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(
          f'waited {seconds:.0f}s for another process to tokenize its piece '
          f'of the token cache ({path}); check the other processes\' logs, '
          'or raise data.tokenizer.wait_seconds')
    time.sleep(1)


class _Holder:
  """Owns a temporary folder: removed when no table holds it."""


class _Opened:
  """A committed split: its manifest and the local folder of its files."""

  def __init__(self, manifest: dict, local: str, vocab_size: int):
    self.manifest, self.local, self.vocab_size = manifest, local, vocab_size

  def ragged(self, name: str, tokens: bool = True) -> row_tables.ShardedRagged:
    return row_tables.ShardedRagged(
        token_shards.load(self.local, self.manifest, name, lengths=True),
        self.vocab_size if tokens else None, name)

  def column(self, name: str) -> list[np.ndarray]:
    return [values for values, _ in token_shards.load(
        self.local, self.manifest, name, lengths=False)]


def _temporary_folder(owner) -> str:
  folder = tempfile.mkdtemp(prefix='jaxformer-rows-')
  weakref.finalize(owner, paths.remove_tree, folder)
  return folder


def open_split(data_config: ml_collections.ConfigDict, split: str,
               encoding: Encoding, tokenizer, cache=None, *,
               process_index: int = 0, process_count: int = 1,
               name: str = '') -> _Opened:
  """`split` tokenized by `encoding` into the cache directory `cache` (a
  `token_cache.SharedCache` in a run of several processes; None: a
  temporary folder) and opened, checked (token_shards.py)."""
  piece_bytes = int(data_config.get('token_cache_piece_bytes', 0) or
                    source_pieces.PIECE_BYTES)
  compute_key = lambda: token_cache.rows_key(
      data_config, split, encoding.name, tokenizer, piece_bytes)
  wait_seconds = data_config.tokenizer.get('wait_seconds', 3600)
  if isinstance(cache, token_cache.SharedCache):
    key = cache.agree(f'token_cache/{split}/{encoding.name}' +
                      (f'/{name}' if name else ''), compute_key,
                      pattern=tokenizer_lib.SHA256)
    process_count = max(process_count, cache.processes())
    cache = cache.directory
  else:
    key = compute_key()
  holder = _Holder()
  directory = cache if cache is not None else _temporary_folder(holder)
  folder = paths.join(directory, f'{split}-{key[:24]}')
  manifest_path = paths.join(folder, token_shards.MANIFEST)
  if not paths.exists(manifest_path):
    token_shards.tokenize(
        data_config, split, encoding, tokenizer, folder, key,
        process_index=process_index, process_count=process_count,
        workers=int(data_config.get('tokenize_workers', 1)),
        piece_bytes=piece_bytes)
    wait = lambda path: _wait_for(path, wait_seconds)
    if process_index == 0:
      token_shards.commit(data_config, split, encoding, folder, key,
                          piece_bytes=piece_bytes, wait=wait)
    else:
      tokenizer_lib.wait_for_process_0(manifest_path, wait_seconds,
                                       'the token cache ')
  manifest = token_shards.read_manifest(folder, key, tokenizer.vocab_size)
  local = (token_cache.local_copy(folder, manifest,
                                  token_shards.file_names(manifest))
           if paths.is_remote(folder) else folder)
  token_shards.check_files(folder, local, manifest)
  opened = _Opened(manifest, local, tokenizer.vocab_size)
  opened.holder = holder  # Keeps a temporary folder while the split is open.
  return opened


def label_vocabulary(labels: Sequence[str]) -> list[str]:
  """Distinct class names in id order: sorted, numerically if all are integers."""
  distinct = set(labels)
  if all(label.lstrip('-').isdigit() for label in distinct):
    return sorted(distinct, key=int)
  return sorted(distinct)


def labels_of(data_config: ml_collections.ConfigDict) -> list[str]:
  """`data.labels`, or the label vocabulary of the train split (of every
  source of a mixture) if unset: its files read once, holding only the
  distinct labels."""
  if data_config.labels:
    return list(data_config.labels)
  encoding = ENCODINGS['classification']
  distinct = set()
  for config in mixture_lib.train_configs(data_config):
    for piece in source_pieces.plan(config, 'train'):
      for number, record in sources.read_piece(config, piece):
        distinct.add(token_shards.columns_of(
            record, encoding, config, lambda: piece.where(number))[1][-1])
  return label_vocabulary(distinct)


def label_ids(labels: Sequence[str], vocabulary: Sequence[str], split: str,
              pretrained: str = '') -> np.ndarray:
  """[examples] int32 indices of `labels` in `vocabulary` (the labels of
  the model at `pretrained`, if one is named)."""
  index = {label: i for i, label in enumerate(vocabulary)}
  unknown = sorted(set(labels) - set(index))
  if unknown and pretrained:
    number = next(n for n, label in enumerate(labels, 1) if label not in index)
    raise sources.DataError(
        f'the {split} split, example {number}: label {labels[number - 1]!r} '
        f'is not one of the labels {list(vocabulary)} of the pretrained '
        f'model {pretrained}; correct or remove its examples ({len(unknown)} '
        'unknown label(s))')
  if unknown:
    raise sources.DataError(
        f'the {split} split has labels {unknown[:5]} that are not in '
        f'data.labels={list(vocabulary)}; add them to data.labels (or leave it '
        'empty to use the labels of the train split)')
  return np.array([index[label] for label in labels], np.int32)


def parse_values(texts: Sequence[str], dim: int, split: str) -> np.ndarray:
  """[examples, dim] float32 from lines of `dim` space-separated numbers."""
  values = np.zeros((len(texts), dim), np.float32)
  for row, text in enumerate(texts):
    fields = text.split()
    try:
      if len(fields) != dim:
        raise ValueError
      values[row] = [float(field) for field in fields]
    except ValueError:
      raise sources.DataError(
          f'{split} example {row + 1}: label {text!r} is not {dim} number(s); '
          "regression lines are 'text<TAB>value' with model.regression_dim "
          'space-separated numbers') from None
  return values


def _document_rows(config, split, tokenizer, opened_split):
  layout = config.data.get('lm_rows', 'packed')
  if layout not in lm_rows.LM_ROWS:
    raise sources.DataError(f'data.lm_rows={layout!r} is not one of '
                            f'{list(lm_rows.LM_ROWS)}')
  opened = opened_split(ENCODINGS[f'lm_{layout}'])
  width = config.data.max_target_length
  first_is_input = lm_rows.first_token_is_input(tokenizer)
  if layout == 'packed':
    return row_tables.PackedRows(opened.ragged('text'), width)
  if layout == 'chat':
    return row_tables.MaskedRows(
        opened.ragged('tokens'), opened.ragged('assistant_mask', tokens=False),
        width, first_is_input)
  return row_tables.PairRows(opened.ragged('prompt'), opened.ragged('response'),
                             width, first_is_input)


def _label_maps(opened, config, split) -> list[np.ndarray]:
  """Each shard's class id of its distinct labels; an unknown label is
  refused as `label_ids` refuses it, naming its first example."""
  vocabulary = labels_of(config.data)
  pretrained = config.get('init', {}).get('pretrained', '')
  shard_strings = token_shards.piece_strings(opened.manifest, 'label')
  known = set(vocabulary)
  unknown = sorted({s for strings in shard_strings for s in strings} - known)
  if unknown:
    column, before = opened.column('label'), 0
    for strings, labels in zip(shard_strings, column):
      bad = np.flatnonzero(np.isin(labels, [
          i for i, s in enumerate(strings) if s not in known]))
      if len(bad):
        first = strings[labels[bad[0]]]
        label_ids([vocabulary[0]] * int(before + bad[0]) + [first] + unknown,
                  vocabulary, split, pretrained)
      before += len(labels)
  return [label_ids(strings, vocabulary, split, pretrained)
          for strings in shard_strings]


def _labelled(config, opened, **labels):
  width = config.data.max_source_length
  with_types = config.model.get('type_vocab_size', 0) > 0
  return row_tables.LabelledRows(
      opened.ragged('inputs'), opened.ragged('inputs_types', tokens=False),
      width, with_types, **labels)


def _class_rows(config, split, tokenizer, opened_split):
  opened = opened_split(ENCODINGS['classification'])
  return _labelled(config, opened, labels=opened.column('label'),
                   label_maps=_label_maps(opened, config, split))


def _value_rows(config, split, tokenizer, opened_split):
  opened = opened_split(ENCODINGS['regression'])
  values, dim = opened.ragged('values', tokens=False), config.model.regression_dim
  for shard, lengths in enumerate(values.lengths):
    wrong = np.flatnonzero(np.asarray(lengths) != dim)
    if len(wrong):
      number = int(values.example_starts[shard] + wrong[0]) + 1
      raise sources.DataError(
          f'{split} example {number}: {int(lengths[wrong[0]])} label '
          f'number(s), not {dim}; regression lines are \'text<TAB>value\' '
          'with model.regression_dim space-separated numbers')
  return _labelled(config, opened, values=values, dim=dim)


# How the split of each task batched from rows is laid out; the tasks not
# named here (translation) are batched by `pipeline`.
ROW_LAYOUTS = {'language_model': _document_rows,
               'classification': _class_rows, 'regression': _value_rows}
