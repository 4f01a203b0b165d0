"""A split's rows, built when a batch asks for them: from arrays in memory
(`ArrayRows`), or from the memory-mapped shards of the token cache
(`PackedRows`, `PairRows`, `LabelledRows`), so that a host's memory does not
grow with the corpus: it holds the shards' lengths' running sums (4 bytes an
example, made when a shard is first read) and the rows of a batch.

Every table has `num_rows` and `take(chosen)`: the rows `chosen` [k]
(-1: an empty row, all zeros) as arrays [k, ...]; a table over the cache
gives the same rows as the arrays `task_batches` made of the whole split.
"""

from __future__ import annotations

import numpy as np

from jaxformer.data import labelled
from jaxformer.data import lm_rows
from jaxformer.data import sources

Batch = dict[str, np.ndarray]


class ArrayRows:
  """Rows held whole in memory: {key: [rows, ...]}."""

  def __init__(self, rows: Batch):
    self.rows = rows
    self.num_rows = len(next(iter(rows.values())))

  def take(self, chosen: np.ndarray) -> Batch:
    batch = {}
    for key, array in self.rows.items():
      taken = np.zeros((len(chosen),) + array.shape[1:], array.dtype)
      taken[chosen >= 0] = array[chosen[chosen >= 0]]
      batch[key] = taken
    return batch


def as_table(rows) -> (ArrayRows | PackedRows | PairRows | MaskedRows
                        | LabelledRows):
  return ArrayRows(rows) if isinstance(rows, dict) else rows


class ShardedRagged:
  """A field's values of every example, in shards: example i of shard s is
  values[s][ends[i] - lengths[s][i]:ends[i]], ends the running sum."""

  def __init__(self, shards, vocab_size: int | None = None, name: str = ''):
    self.values = [values for values, _ in shards]
    self.lengths = [lengths for _, lengths in shards]
    self.example_starts = np.concatenate(
        [[0], np.cumsum([len(lengths) for lengths in self.lengths])])
    self.value_starts = np.concatenate(
        [[0], np.cumsum([len(values) for values in self.values])])
    self.vocab_size, self.name = vocab_size, name
    self._ends = {}

  @property
  def num_examples(self) -> int:
    return int(self.example_starts[-1])

  @property
  def num_values(self) -> int:
    return int(self.value_starts[-1])

  def ends(self, shard: int) -> np.ndarray:
    """The running sum of the shard's lengths: int32 where its values
    allow (a shard is a piece of --token_cache_piece_bytes), halving what
    a host holds per example."""
    if shard not in self._ends:
      size = self.value_starts[shard + 1] - self.value_starts[shard]
      dtype = np.int32 if size < np.iinfo(np.int32).max else np.int64
      self._ends[shard] = np.cumsum(self.lengths[shard], dtype=dtype)
    return self._ends[shard]

  def _checked(self, values: np.ndarray) -> np.ndarray:
    if self.vocab_size is not None and len(values) and (
        values.max() >= self.vocab_size):
      raise sources.DataError(
          f'the token cache field {self.name!r} holds id {int(values.max())}, '
          f'not below the vocabulary size {self.vocab_size}: the cache is '
          'damaged; delete its folder to tokenize the split again')
    return values

  def example(self, row: int) -> np.ndarray:
    """The values of example `row`."""
    shard = int(np.searchsorted(self.example_starts, row, 'right')) - 1
    within = row - self.example_starts[shard]
    end = int(self.ends(shard)[within])
    start = end - int(self.lengths[shard][within])
    return self._checked(np.asarray(self.values[shard][start:end]))

  def flat(self, index: np.ndarray) -> np.ndarray:
    """The values [n] at positions `index` [n] of the shards end to end."""
    shard_of = np.searchsorted(self.value_starts, index, 'right') - 1
    values = np.empty(len(index), np.int32)
    for shard in np.flatnonzero(np.bincount(shard_of)):
      mine = shard_of == shard
      values[mine] = self.values[shard][index[mine] - self.value_starts[shard]]
    return self._checked(values)

  def examples_at(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(example, its first position) [n] of positions `index` [n]."""
    shard_of = np.searchsorted(self.value_starts, index, 'right') - 1
    example = np.empty(len(index), np.int64)
    start = np.empty(len(index), np.int64)
    for shard in np.flatnonzero(np.bincount(shard_of)):
      mine = shard_of == shard
      ends = self.ends(shard)
      local = index[mine] - self.value_starts[shard]
      within = np.searchsorted(ends, local, 'right')
      example[mine] = self.example_starts[shard] + within
      start[mine] = self.value_starts[shard] + np.where(
          within > 0, ends[np.maximum(within - 1, 0)], 0)
    return example, start


class PackedRows:
  """Documents concatenated and cut into rows of `width` (as
  `lm_rows.pack_documents`)."""

  def __init__(self, documents: ShardedRagged, width: int):
    self.documents, self.width = documents, width
    self.num_rows = -(-documents.num_values // width)

  def take(self, chosen: np.ndarray) -> Batch:
    width, total = self.width, self.documents.num_values
    index = chosen[:, None].astype(np.int64) * width + np.arange(width)
    inside = (chosen[:, None] >= 0) & (index < total)
    positions = index[inside]
    row_start = positions // width * width
    document, document_start = self.documents.examples_at(positions)
    real = chosen >= 0
    first_of_row = np.zeros(len(chosen), np.int64)
    first_of_row[real] = self.documents.examples_at(
        chosen[real].astype(np.int64) * width)[0]
    first = np.broadcast_to(first_of_row[:, None], index.shape)[inside]
    batch = {key: np.zeros((len(chosen), width), np.int32) for key in (
        'targets', 'targets_segment_ids', 'targets_positions')}
    batch['targets'][inside] = self.documents.flat(positions)
    batch['targets_segment_ids'][inside] = document - first + 1
    batch['targets_positions'][inside] = positions - np.maximum(
        document_start, row_start)
    return batch


def _placed(rows: Batch, chosen: np.ndarray) -> Batch:
  """`rows` of the chosen rows >= 0 placed among empty rows."""
  real = chosen >= 0
  batch = {}
  for key, array in rows.items():
    batch[key] = np.zeros((len(chosen),) + array.shape[1:], array.dtype)
    batch[key][real] = array
  return batch


class PairRows:
  """One prompt/response pair per row (as `lm_rows.pair_rows`)."""

  def __init__(self, prompts: ShardedRagged, responses: ShardedRagged,
               width: int, first_is_input: bool):
    self.prompts, self.responses = prompts, responses
    self.width, self.first_is_input = width, first_is_input
    self.num_rows = prompts.num_examples

  def take(self, chosen: np.ndarray) -> Batch:
    pairs = []
    for row in chosen[chosen >= 0]:
      prompt = self.prompts.example(row).tolist()
      response = self.responses.example(row).tolist()
      pairs.append((prompt[:-1] + response, len(prompt) - 1))
    return _placed(lm_rows.pair_rows(pairs, self.width, self.first_is_input),
                   chosen)


class MaskedRows:
  """One (ids, loss mask) example per row (as `lm_rows.masked_rows`): a
  conversation and its assistant mask."""

  def __init__(self, ids: ShardedRagged, masks: ShardedRagged, width: int,
               first_is_input: bool):
    self.ids, self.masks = ids, masks
    self.width, self.first_is_input = width, first_is_input
    self.num_rows = ids.num_examples

  def take(self, chosen: np.ndarray) -> Batch:
    examples = [(self.ids.example(row).tolist(),
                 self.masks.example(row).tolist())
                for row in chosen[chosen >= 0]]
    return _placed(lm_rows.masked_rows(examples, self.width,
                                       self.first_is_input), chosen)


class LabelledRows:
  """One text or sentence pair per row with its label: class ids (`labels`
  [examples], from each shard's strings through `label_maps`) or values."""

  def __init__(self, inputs: ShardedRagged, types: ShardedRagged,
               width: int, with_types: bool, *, labels=None, label_maps=None,
               values: ShardedRagged | None = None, dim: int = 1):
    self.inputs, self.types, self.width = inputs, types, width
    self.with_types = with_types
    self.labels, self.label_maps, self.values = labels, label_maps, values
    self.dim = dim
    self.num_rows = inputs.num_examples

  def take(self, chosen: np.ndarray) -> Batch:
    ids, types, targets = [], [], []
    for row in chosen[chosen >= 0]:
      cut = labelled.cut_pair(self.inputs.example(row).tolist(),
                              self.types.example(row).tolist(), self.width)
      ids.append(cut[0])
      types.append(cut[1])
      targets.append(self._target(row))
    rows = labelled.pad_token_rows(ids, self.width,
                                   types if self.with_types else None)
    if self.values is not None:
      rows['values'] = np.array(targets, np.float32).reshape(
          len(ids), self.dim)
    else:
      rows['labels'] = np.array(targets, np.int32)
    return _placed(rows, chosen)

  def _target(self, row: int):
    if self.values is not None:
      return self.values.example(row)
    shard = int(np.searchsorted(self.inputs.example_starts, row, 'right')) - 1
    return self.label_maps[shard][
        self.labels[shard][row - self.inputs.example_starts[shard]]]

