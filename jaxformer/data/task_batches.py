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

Each split is tokenized once into the token cache (row_layouts.py,
token_shards.py: every process its share of the input), and its rows are
made per batch from the memory-mapped shards (row_tables.py), so batch k of
training is a pure function of (data, config, k): epoch e = k // batches per
epoch visits the rows in a permutation seeded by (data.seed, e); the last
batch of an epoch is completed with empty rows. Resuming at step k costs
nothing, and each process builds only its own rows of every global batch.
Evaluation visits every row once in order, completed with empty rows that
carry 'example_index' -1.

`train_batches` / `eval_batches` take the whole config and serve every task
through its engine (`ENGINES`: translation through `pipeline`), so the
training loop needs no task-specific code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from jaxformer.data import batch_layout
from jaxformer.data import mixture as mixture_lib
from jaxformer.data import pipeline
from jaxformer.data import row_layouts
from jaxformer.data import row_tables
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.row_layouts import ROW_LAYOUTS
from jaxformer.parallel.row_share import RowShare

Batch = dict[str, np.ndarray]


def task_table(config: ml_collections.ConfigDict, split: str,
               source_tok: tokenizer_lib.Tokenizer, token_cache=None, *,
               process_index: int = 0, name: str = ''):
  """A split of `config.task` as a table of rows (row_tables.py), read
  from the token cache `token_cache` (tokenized there first;
  None: a temporary folder)."""
  layout = ROW_LAYOUTS.get(config.task)
  if layout is None:
    raise ValueError(f'task={config.task!r} has no row batches; it is '
                     'batched by jaxformer.data.pipeline')
  opened_split = lambda encoding: row_layouts.open_split(
      config.data, split, encoding, source_tok, token_cache,
      process_index=process_index, name=name)
  return layout(config, split, source_tok, opened_split)


def task_rows(config: ml_collections.ConfigDict, split: str,
              source_tok: tokenizer_lib.Tokenizer) -> dict[str, np.ndarray]:
  """A whole split of `config.task` as rows: arrays [rows, ...]."""
  table = task_table(config, split, source_tok)
  return table.take(np.arange(table.num_rows))


def _pick(table: np.ndarray, indices: np.ndarray) -> np.ndarray:
  """table[indices], -1 where an index is past the end."""
  inside = indices < len(table)
  return np.where(inside, table[np.where(inside, indices, 0)], -1)


def row_train_batches(rows, batch_size: int, seed: int, *,
                      start_step: int = 0, share: RowShare = RowShare()
                      ) -> Iterator[Batch]:
  """Endless training batches of this process's rows (`share`) of `rows`
  (a table of row_tables.py, or arrays [rows, ...]), from batch
  `start_step`."""
  table = row_tables.as_table(rows)
  batch_layout.train_rows_per_process(batch_size, share)  # Checks it divides.
  mine = share.rows(batch_size)
  batches_per_epoch = -(-table.num_rows // batch_size)
  step, order = start_step, _EpochOrder(table.num_rows, seed)
  while True:
    epoch, number = divmod(step, batches_per_epoch)
    yield table.take(_pick(order(epoch), number * batch_size + mine))
    step += 1


class _EpochOrder:
  """The rows of an epoch in order (a permutation seeded by (seed, epoch)),
  the last epoch's kept."""

  def __init__(self, num_rows: int, seed: int):
    self.num_rows, self.seed, self.epoch, self.rows = num_rows, seed, None, None

  def __call__(self, epoch: int) -> np.ndarray:
    if epoch != self.epoch:
      self.epoch, self.rows = epoch, _epoch_rows(self.num_rows, self.seed,
                                                 epoch)
    return self.rows


def _epoch_rows(num_rows: int, seed: int, epoch: int) -> np.ndarray:
  """[num_rows] the rows of `epoch` in order (a seeded permutation)."""
  return np.random.default_rng([seed, epoch]).permutation(num_rows)


def mixed_row_batches(source_rows: list, mixture: mixture_lib.Mixture,
                      batch_size: int, seed: int, *, start_step: int = 0,
                      share: RowShare = RowShare()) -> Iterator[Batch]:
  """Endless training batches of this process's rows (`share`), from batch
  `start_step`, drawn from the rows of each source of `mixture` (tables or
  arrays, in its order; each source's epochs in the order of
  `row_train_batches`), with 'source_counts' [sources] int64: the rows each
  gave to the global batch."""
  tables = [row_tables.as_table(rows) for rows in source_rows]
  orders = [_EpochOrder(table.num_rows, seed) for table in tables]
  batch_layout.train_rows_per_process(batch_size, share)  # Checks it divides.
  mine = share.rows(batch_size)
  for draw in mixture_lib.draws(mixture, seed, batch_size, start_step):
    source, index = draw.source[mine], draw.index[mine]
    batch = tables[0].take(np.full(len(mine), -1))
    for number, (table, order) in enumerate(zip(tables, orders)):
      places = np.flatnonzero(source == number)
      epoch, within = np.divmod(index[places], table.num_rows)
      chosen = np.empty(len(places), np.int64)
      for each in np.unique(epoch):
        chosen[epoch == each] = order(each)[within[epoch == each]]
      for key, array in table.take(chosen).items():
        batch[key][places] = array
    batch['source_counts'] = draw.counts
    yield batch


def row_eval_batches(rows, batch_size: int, *, share: RowShare = RowShare()
                     ) -> Iterator[Batch]:
  """Every row once, in order; padding rows have 'example_index' -1."""
  table = row_tables.as_table(rows)
  global_rows = batch_layout.eval_global_rows(batch_size, share)
  mine = share.rows(global_rows)
  for start in range(0, table.num_rows, global_rows):
    chosen = (start + mine).astype(np.int32)
    chosen[chosen >= table.num_rows] = -1
    batch = table.take(chosen)
    batch['example_index'] = chosen
    yield batch


def train_batches(config: ml_collections.ConfigDict,
                  source_tok: tokenizer_lib.Tokenizer,
                  target_tok: tokenizer_lib.Tokenizer, *, start_step: int = 0,
                  process_index: int = 0, share: RowShare = RowShare(),
                  row_multiple: int = 1, token_cache=None) -> Iterator[Batch]:
  """Training batches of `config.task`, from global batch `start_step` on,
  the rows of `share`, tokenized into `token_cache` (a directory or a
  `token_cache.SharedCache`; None: in memory or a temporary folder);
  'bucket' batches have a multiple of `row_multiple` rows, one example
  each, and no '*_segment_ids' / '*_positions'. With a `data.mixture`,
  batches also hold 'source_counts' [sources] (`mixture.Tally`)."""
  return engine_of(config).train(
      config, source_tok, target_tok, start_step=start_step,
      process_index=process_index, share=share, row_multiple=row_multiple,
      token_cache=token_cache)


def _translation_train(config, source_tok, target_tok, *, row_multiple,
                       **where) -> Iterator[Batch]:
  batches = pipeline.translation_train_batches(
      config.data, source_tok, target_tok, row_multiple=row_multiple, **where)
  if config.data.batching == 'bucket':
    return map(_without_packing, batches)
  return batches


def _rows_train(config, source_tok, target_tok, *, start_step, process_index,
                share, row_multiple, token_cache) -> Iterator[Batch]:
  del target_tok, row_multiple  # One tokenizer; rows need no multiple.
  mixture = mixture_lib.parse(config.data)
  if mixture is not None:
    mixture_lib.check_files(mixture)
    return mixed_row_batches(
        [task_table(_with_data(config, data), 'train', source_tok,
                    token_cache, process_index=process_index, name=name)
         for name, data in zip(mixture.names, mixture.configs)],
        mixture, config.data.batch_size, config.data.seed,
        start_step=start_step, share=share)
  return row_train_batches(
      task_table(config, 'train', source_tok, token_cache,
                 process_index=process_index), config.data.batch_size,
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
  shared = (engine_of(config).process_0_tokenizes and
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
  return engine_of(config).data_order(config, row_shards)


def _translation_order(config, row_shards: int) -> dict:
  if config.data.batching != 'bucket':
    return {'batching': 'pack'}
  return {'batching': 'bucket',
          'row_multiple': row_multiple(config, row_shards),
          'row_shards': int(row_shards),
          'grad_accum_steps': int(config.train.grad_accum_steps)}


def train_batch_shapes(config: ml_collections.ConfigDict, row_shards: int = 1
                       ) -> list[tuple[int, int, int]]:
  """Every global training batch shape of `config` on a mesh of `row_shards`
  row shards, as (rows, source width, target width)."""
  return engine_of(config).batch_shapes(config, row_shards)


def _translation_shapes(config, row_shards: int) -> list[tuple[int, int, int]]:
  return pipeline.batch_shapes(config.data, row_multiple(config, row_shards))


def _rows_shapes(config, row_shards: int) -> list[tuple[int, int, int]]:
  del row_shards  # Every batch has data.batch_size rows.
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
  return engine_of(config).eval(config, source_tok, target_tok, split,
                                process_index=process_index, share=share,
                                token_cache=token_cache)


def _translation_eval(config, source_tok, target_tok, split, **where
                      ) -> Iterator[Batch]:
  return pipeline.translation_eval_batches(config.data, source_tok,
                                           target_tok, split, **where)


def _rows_eval(config, source_tok, target_tok, split, *, process_index,
               share, token_cache) -> Iterator[Batch]:
  del target_tok  # One tokenizer.
  return row_eval_batches(
      task_table(config, split, source_tok, token_cache,
                 process_index=process_index), config.data.batch_size,
      share=share)


@dataclasses.dataclass(frozen=True)
class Engine:
  """How one kind of task is batched: its training and evaluation batches,
  their shapes, what their order depends on, and whether process 0 alone
  tokenizes (else every process tokenizes its share of the input)."""
  train: Callable[..., Iterator[Batch]]
  eval: Callable[..., Iterator[Batch]]
  batch_shapes: Callable[..., list]
  data_order: Callable[..., dict]
  process_0_tokenizes: bool


TRANSLATION = Engine(_translation_train, _translation_eval,
                     _translation_shapes, _translation_order, True)
ROWS = Engine(_rows_train, _rows_eval, _rows_shapes,
              lambda config, row_shards: {'batching': 'rows'}, False)
# Each task's engine, by name (the data layer cannot import train/tasks.py).
ENGINES = {'translation': TRANSLATION, **{task: ROWS for task in ROW_LAYOUTS}}


def engine_of(config: ml_collections.ConfigDict) -> Engine:
  engine = ENGINES.get(config.task)
  if engine is None:
    raise ValueError(f'task={config.task!r} has no batches; one of '
                     f'{sorted(ENGINES)}')
  return engine
