"""Batches for the tasks other than translation, from the same (text, label)
pairs that `sources.read_split` reads.

  classification  'inputs' (+ '_segment_ids', '_positions') [rows, max_source_length]
                  and 'labels' [rows] int32: the label's index in `data.labels`;
  regression      'inputs' (+ ...) and 'values' [rows, regression_dim] float32
                  (the label column holds regression_dim numbers);
  language_model  'targets' (+ ...) [rows, max_target_length]: the documents,
                  each ending with EOS, concatenated and cut into rows
                  (a document may continue on the next row); or one
                  prompt/response pair per row with 'targets_loss_mask'
                  (`data.lm_rows`, lm_rows.py).

Each split becomes fixed-size rows once (numpy, no tf.data), so batch k of
training is a pure function of (data, config, k): epoch e = k // batches per
epoch visits the rows in a permutation seeded by (data.seed, e); the last
batch of an epoch is completed with empty rows. Resuming at step k costs
nothing, and each process builds only its own rows of every global batch.
Evaluation visits every row once in order, completed with empty rows that
carry 'example_index' -1.

`train_batches` / `eval_batches` take the whole config and serve translation
through `pipeline`, so the training loop needs no task-specific code.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import ml_collections
import numpy as np

from jaxformer.data import batch_layout
from jaxformer.data import labelled
from jaxformer.data import lm_rows
from jaxformer.data import mixture as mixture_lib
from jaxformer.data import pipeline
from jaxformer.data import sources
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.lm_rows import pack_documents  # noqa: F401 (API)
from jaxformer.parallel.row_share import RowShare

Batch = dict[str, np.ndarray]


def label_vocabulary(labels: Sequence[str]) -> list[str]:
  """Distinct class names in id order: sorted, numerically if all are integers."""
  distinct = set(labels)
  if all(label.lstrip('-').isdigit() for label in distinct):
    return sorted(distinct, key=int)
  return sorted(distinct)


def labels_of(data_config: ml_collections.ConfigDict) -> list[str]:
  """`data.labels`, or the label vocabulary of the train split (of every
  source of a mixture) if unset."""
  if data_config.labels:
    return list(data_config.labels)
  return label_vocabulary([
      label for config in mixture_lib.train_configs(data_config)
      for label in labelled.read_split(config, 'train')[1]])


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


def _padded(lists: Sequence[Sequence[int]], width: int) -> np.ndarray:
  """[examples, width] int32: each list cut to `width` (still ending with
  its last item), then padded with 0."""
  rows = np.zeros((len(lists), width), np.int32)
  for row, items in enumerate(lists):
    cut = list(items[:width])
    if cut and len(items) > width:
      cut[-1] = items[-1]
    rows[row, :len(cut)] = cut
  return rows


def pad_token_rows(token_lists: Sequence[Sequence[int]], width: int,
                   token_types: Sequence[Sequence[int]] | None = None
                   ) -> dict[str, np.ndarray]:
  """'inputs', 'inputs_segment_ids', 'inputs_positions' [examples, width]
  int32: one example per row, cut to `width` tokens (still ending with its
  last token, EOS); segment id 0 marks padding. With `token_types` (a list
  per example, as long as its tokens) 'inputs_token_types' too."""
  lengths = np.array([[min(len(ids), width)] for ids in token_lists],
                     np.int32).reshape(-1, 1)
  present = np.arange(width) < lengths
  positions = np.where(present, np.arange(width, dtype=np.int32), 0)
  rows = {'inputs': _padded(token_lists, width),
          'inputs_segment_ids': present.astype(np.int32),
          'inputs_positions': positions}
  if token_types is not None:
    rows['inputs_token_types'] = _padded(token_types, width)
  return rows


def _document_rows(config, split, tokenizer) -> Batch:
  texts, labels = zip(*sources.read_split(config.data, split))
  return lm_rows.language_model_rows(config.data, texts, labels, split,
                                     tokenizer)


def _labelled_rows(config, split, tokenizer) -> tuple[Batch, list[str]]:
  """The token rows of a split of texts or pairs (with 'inputs_token_types'
  when the model has token types), and its labels."""
  texts, labels = labelled.read_split(config.data, split)
  width = config.data.max_source_length
  ids, types = labelled.encode(tokenizer, texts, width)
  with_types = config.model.get('type_vocab_size', 0) > 0
  return pad_token_rows(ids, width, types if with_types else None), labels


def _class_rows(config, split, tokenizer) -> Batch:
  rows, labels = _labelled_rows(config, split, tokenizer)
  rows['labels'] = label_ids(labels, labels_of(config.data), split,
                             config.get('init', {}).get('pretrained', ''))
  return rows


def _value_rows(config, split, tokenizer) -> Batch:
  rows, labels = _labelled_rows(config, split, tokenizer)
  rows['values'] = parse_values(labels, config.model.regression_dim, split)
  return rows


# How the split of each task batched from rows is laid out; the tasks not
# named here (translation) are batched by `pipeline`.
ROW_LAYOUTS = {'language_model': _document_rows,
               'classification': _class_rows, 'regression': _value_rows}


def task_rows(config: ml_collections.ConfigDict, split: str,
              source_tok: tokenizer_lib.Tokenizer) -> dict[str, np.ndarray]:
  """A whole split of `config.task` as rows: arrays [rows, ...]."""
  if config.task not in ROW_LAYOUTS:
    raise ValueError(f'task={config.task!r} has no row batches; it is '
                     'batched by jaxformer.data.pipeline')
  return ROW_LAYOUTS[config.task](config, split, source_tok)


def _take(rows: dict[str, np.ndarray], chosen: np.ndarray) -> Batch:
  """Rows `chosen` [k] of `rows`; -1 gives an empty row."""
  batch = {}
  for key, array in rows.items():
    taken = np.zeros((len(chosen),) + array.shape[1:], array.dtype)
    taken[chosen >= 0] = array[chosen[chosen >= 0]]
    batch[key] = taken
  return batch


def _pick(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
  """table[indices], -1 where an index is past the end."""
  inside = indices < len(table)
  return np.where(inside, table[np.where(inside, indices, 0)], -1)


def row_train_batches(rows: dict[str, np.ndarray], batch_size: int, seed: int,
                      *, start_step: int = 0, share: RowShare = RowShare()
                      ) -> Iterator[Batch]:
  """Endless training batches of this process's rows (`share`), from batch
  `start_step`."""
  num_rows = len(next(iter(rows.values())))
  batch_layout.train_rows_per_process(batch_size, share)  # Checks it divides.
  mine = share.rows(batch_size)
  batches_per_epoch = -(-num_rows // batch_size)
  step = start_step
  while True:
    epoch, number = divmod(step, batches_per_epoch)
    order = _epoch_rows(num_rows, seed, epoch)
    yield _take(rows, _pick(order, number * batch_size + mine))
    step += 1


def _epoch_rows(num_rows: int, seed: int, epoch: int) -> np.ndarray:
  """[num_rows] the rows of `epoch` in order (a seeded permutation)."""
  return np.random.default_rng([seed, epoch]).permutation(num_rows)


def mixed_row_batches(source_rows: list[dict[str, np.ndarray]],
                      mixture: mixture_lib.Mixture, batch_size: int,
                      seed: int, *, start_step: int = 0,
                      share: RowShare = RowShare()) -> Iterator[Batch]:
  """Endless training batches of this process's rows (`share`), from batch
  `start_step`, drawn from the rows of each source of `mixture` (in its
  order; each source's epochs in the order of `row_train_batches`), with
  'source_counts' [sources] int64: the rows each gave to the global batch."""
  sizes = [len(next(iter(rows.values()))) for rows in source_rows]
  batch_layout.train_rows_per_process(batch_size, share)  # Checks it divides.
  mine = share.rows(batch_size)
  for draw in mixture_lib.draws(mixture, seed, batch_size, start_step):
    source, index = draw.source[mine], draw.index[mine]
    batch = {key: np.zeros((len(mine),) + array.shape[1:], array.dtype)
             for key, array in source_rows[0].items()}
    for number, (rows, size) in enumerate(zip(source_rows, sizes)):
      places = np.flatnonzero(source == number)
      epoch, within = np.divmod(index[places], size)
      chosen = np.empty(len(places), np.int64)
      for each in np.unique(epoch):
        chosen[epoch == each] = _epoch_rows(size, seed, each)[
            within[epoch == each]]
      for key, array in rows.items():
        batch[key][places] = array[chosen]
    batch['source_counts'] = draw.counts
    yield batch


def row_eval_batches(rows: dict[str, np.ndarray], batch_size: int, *,
                     share: RowShare = RowShare()) -> Iterator[Batch]:
  """Every row once, in order; padding rows have 'example_index' -1."""
  num_rows = len(next(iter(rows.values())))
  global_rows = batch_layout.eval_global_rows(batch_size, share)
  mine = share.rows(global_rows)
  for start in range(0, num_rows, global_rows):
    chosen = _pick(np.arange(num_rows), start + mine).astype(np.int32)
    batch = _take(rows, chosen)
    batch['example_index'] = chosen
    yield batch


def train_batches(config: ml_collections.ConfigDict,
                  source_tok: tokenizer_lib.Tokenizer,
                  target_tok: tokenizer_lib.Tokenizer, *, start_step: int = 0,
                  process_index: int = 0, share: RowShare = RowShare(),
                  row_multiple: int = 1, token_cache: str | None = None
                  ) -> Iterator[Batch]:
  """Training batches of `config.task`, from global batch `start_step` on,
  the rows of `share` (process_index 0 writes the token cache);
  'bucket' batches have a multiple of `row_multiple` rows, one example
  each, and no '*_segment_ids' / '*_positions'. Translation tokenises into
  `token_cache` (a directory; None: in memory). With a `data.mixture`,
  batches also hold 'source_counts' [sources] (`mixture.Tally`)."""
  if config.task not in ROW_LAYOUTS:
    batches = pipeline.translation_train_batches(
        config.data, source_tok, target_tok, start_step=start_step,
        process_index=process_index, share=share,
        row_multiple=row_multiple, token_cache=token_cache)
    if config.data.batching == 'bucket':
      return map(_without_packing, batches)
    return batches
  mixture = mixture_lib.parse(config.data)
  if mixture is not None:
    mixture_lib.check_files(mixture)
    return mixed_row_batches(
        [task_rows(_with_data(config, data), 'train', source_tok)
         for data in mixture.configs], mixture, config.data.batch_size,
        config.data.seed, start_step=start_step, share=share)
  return row_train_batches(
      task_rows(config, 'train', source_tok), config.data.batch_size,
      config.data.seed, start_step=start_step, share=share)


def _with_data(config: ml_collections.ConfigDict,
               data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict(config.to_dict())
  config.data = data
  return config


def check_train_files(config: ml_collections.ConfigDict,
                      process_index: int = 0, token_cache=None) -> None:
  """Raises now for a train file of a `data.mixture` source that is not
  set or not there, where this process reads them (translation with a
  shared token cache: process 0 alone)."""
  mixture = mixture_lib.parse(config.data)
  shared = (config.task not in ROW_LAYOUTS and
            isinstance(token_cache, token_cache_lib.SharedCache))
  if mixture is not None and (process_index == 0 or not shared):
    mixture_lib.check_files(mixture)


def _without_packing(batch: Batch) -> Batch:
  """A batch of one example per row without its segment ids and positions,
  which are the model's defaults: the model then knows the rows are not
  packed (cuDNN flash attention takes such rows)."""
  return {key: value for key, value in batch.items()
          if not key.endswith(('_segment_ids', '_positions'))}


def row_multiple(config: ml_collections.ConfigDict, row_shards: int) -> int:
  """What every training batch's rows must be a multiple of: `row_shards`
  (the mesh's data x fsdp) for each of train.grad_accum_steps microbatches,
  so that each device splits its own rows into microbatches."""
  return row_shards * int(config.train.grad_accum_steps)


def data_order(config: ml_collections.ConfigDict, row_shards: int) -> dict:
  """What the order of training examples depends on besides the data, the
  data config and the seed, as saved with checkpoints: for 'bucket'
  batching of translation, the row multiple (`row_multiple`), which sets
  how many examples each bucket's batches take; nothing more for 'pack'
  and row tasks, whose global batch k is rows [k * batch_size, (k + 1) *
  batch_size) of the epoch's plan however processes, devices and
  microbatches split it. The process count never matters: a 'bucket'
  batch's examples are split over processes, padded with empty rows."""
  if config.task in ROW_LAYOUTS or config.data.batching != 'bucket':
    return {'batching': 'pack' if config.task not in ROW_LAYOUTS else 'rows'}
  return {'batching': 'bucket',
          'row_multiple': row_multiple(config, row_shards),
          'row_shards': int(row_shards),
          'grad_accum_steps': int(config.train.grad_accum_steps)}


def train_batch_shapes(config: ml_collections.ConfigDict, row_shards: int = 1
                       ) -> list[tuple[int, int, int]]:
  """Every global training batch shape of `config` on a mesh of `row_shards`
  row shards, as (rows, source width, target width)."""
  if config.task not in ROW_LAYOUTS:
    return pipeline.batch_shapes(config.data, row_multiple(config, row_shards))
  return [(int(config.data.batch_size), config.data.max_source_length,
           config.data.max_target_length)]


def check_batch_shapes(config: ml_collections.ConfigDict, row_shards: int
                       ) -> list[tuple[int, int, int]]:
  """Checks, before training starts, that every training batch shape and
  the evaluation batch split evenly over the mesh's row shards and the
  microbatches (and so over the processes, which hold equal numbers of
  row shards: `parallel.row_shares`); returns the training shapes.

  Raises:
    ValueError naming the batch shape and the keys to change.
  """
  multiple = row_multiple(config, row_shards)
  shapes = train_batch_shapes(config, row_shards)
  eval_rows = eval_batch_rows(config, row_shards)
  microbatches = (f'{row_shards} row shards (mesh.data x mesh.fsdp) x '
                  f'{config.train.grad_accum_steps} microbatches '
                  '(train.grad_accum_steps)')
  checks = [(rows, multiple, f'training batch {(rows, source, target)}',
             microbatches) for rows, source, target in shapes]
  checks.append((eval_rows, row_shards, f'evaluation batch of {eval_rows} '
                 'rows', f'{row_shards} row shards (mesh.data x mesh.fsdp)'))
  for rows, needed, what, parts in checks:
    if rows % needed:
      raise ValueError(
          f'The {what} does not split into {parts}; make data.batch_size '
          f'(or data.tokens_per_batch) a multiple of {needed} or change the '
          'mesh.')
  return shapes


def eval_batch_rows(config: ml_collections.ConfigDict, row_shards: int) -> int:
  """Global rows of an evaluation batch on `row_shards` row shards."""
  return batch_layout.eval_global_rows(int(config.data.batch_size),
                                   RowShare((0,), row_shards))


def eval_batches(config: ml_collections.ConfigDict,
                 source_tok: tokenizer_lib.Tokenizer,
                 target_tok: tokenizer_lib.Tokenizer, split: str, *,
                 process_index: int = 0, share: RowShare = RowShare(),
                 token_cache: str | None = None) -> Iterator[Batch]:
  """Evaluation batches of `config.task` over the whole `split`
  (`token_cache` as for `train_batches`)."""
  if config.task not in ROW_LAYOUTS:
    return pipeline.translation_eval_batches(
        config.data, source_tok, target_tok, split,
        process_index=process_index, share=share, token_cache=token_cache)
  return row_eval_batches(task_rows(config, split, source_tok),
                          config.data.batch_size, share=share)
