"""Translation batches for training and evaluation, as tf.data pipelines
over tokenised splits.

Design
------
A split is tokenised once (token_cache.py: SentencePiece's batched encoder,
into sharded .npy files in the run's token cache, or in memory).  The plan
of every batch is computed from the examples' lengths alone, with
vectorised TensorFlow ops; a batch then reads the token ids of its own rows
only (`gather_examples`).

Training is a sequence of epochs.  Epoch e visits the examples in a seeded
permutation (`stateless_shuffle` with seed (seed, e)), so batch k is a pure
function of (data, config, k) and every process computes the same global plan:
  * 'pack': greedy next-fit packing of the permuted examples into rows of
    max_source_length / max_target_length (an example's source and target
    share a row and a segment number); batch_size rows per global batch; the
    last batch of an epoch is completed with empty rows.
  * 'bucket': examples grouped by max(source, target) length into buckets of
    `bucket_lengths(...)`; a batch of bucket width w has the most rows within
    tokens_per_batch that are a multiple of the row multiple (the mesh's row
    shards and the microbatch count, `bucket_rows`), completed with empty
    rows to a multiple of the process count (so the plan does not depend on
    the process count); the batches of an epoch are shuffled; each bucket's
    last batch is completed with empty rows.
Each process builds only its own rows of every global batch, so all processes
yield identical shapes at every step.

Resume cost (epochs.py finds the epoch and batch of a step): the number of
batches in epoch e is known without producing them
('bucket': a constant; 'pack': one vectorised packing plan, O(n log n) on
lengths only).  'pack' counts are kept once computed (epoch_counts.py,
beside the token cache; the training stream records each epoch's as it
plans it), so a resumed run plans only the epoch it resumes in; epochs
whose count is not stored (no token cache, or a first resume) are planned
in parallel on the CPU cores, moving no tokens: about 1 us per example
skipped on one busy core.

Memory: the lengths of all examples (4 bytes per example and side) and the
plan of the current epoch (about 30 bytes per example for 'pack') live in
host memory; token ids are read per batch, memory-mapped from a local cache
or by ranged reads from a remote one (in memory only without a cache).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from jaxformer.data import epoch_counts
from jaxformer.data import epochs
from jaxformer.data import sources
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.token_cache import TokenizedSplit
from jaxformer.parallel.row_share import RowShare, round_up_rows

Batch = dict[str, np.ndarray]
_BUCKET_GRANULARITY = 8
# Names the packing plans in stored epoch counts: change it when they change.
_PLANNER = f'packing_plan 1, tensorflow {tf.__version__}'


def training_examples(data_config: ml_collections.ConfigDict,
                      source_tok: tokenizer_lib.Tokenizer,
                      target_tok: tokenizer_lib.Tokenizer,
                      token_cache: str | None = None, process_index: int = 0
                      ) -> TokenizedSplit:
  """The train split without examples longer than the max lengths."""
  examples = token_cache_lib.tokenized_split(
      data_config, 'train', source_tok, target_tok, token_cache,
      process_index=process_index)
  fits = ((examples.source_lengths <= data_config.max_source_length) &
          (examples.target_lengths <= data_config.max_target_length))
  if not fits.any():
    raise sources.DataError(
        f'all {examples.num_examples} training examples are longer than '
        f'max_source_length={data_config.max_source_length} or '
        f'max_target_length={data_config.max_target_length} tokens; raise them')
  return examples if fits.all() else examples.subset(np.flatnonzero(fits))


def train_rows_per_process(batch_size: int, share: RowShare) -> int:
  """Rows of this process in a training batch: an exact share."""
  if batch_size % share.num_shards:
    raise ValueError(f'data.batch_size={batch_size} is not divisible by the '
                     f'{share.num_shards} row shards; make it a multiple')
  return share.local_rows(batch_size)


def eval_global_rows(batch_size: int, share: RowShare) -> int:
  """Rows of an evaluation batch: batch_size rounded up to a multiple of
  the row shards (the extra rows pad)."""
  return round_up_rows(batch_size, share)


# ---------------------------------------------------------- tensorflow ops


def gather_examples(examples: TokenizedSplit, rows: tf.Tensor,
                    max_source_length: int | None = None,
                    max_target_length: int | None = None
                    ) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
  """Examples `rows` [k] int32 as (source, target) [k, (length)] int32,
  read from `examples` (the token cache) when the batch is made; cut to the
  max lengths (keeping EOS) when given.  The caller keeps `examples` alive
  while the dataset runs (see `_as_numpy`)."""
  # TensorFlow keeps a numpy_function's Python function as long as the
  # process when built eagerly: held weakly, a split closes with its stream.
  split = weakref.ref(examples)

  def read(rows):
    # No walrus here: AutoGraph, which converts this function's parent in
    # tf.data's map, cannot parse one and warns in every run.
    held = split()
    if held is None:  # Its stream was dropped mid-read.
      raise RuntimeError('a batch of a closed stream was being read')
    return held.gather(rows, max_source_length, max_target_length)

  source, source_splits, target, target_splits = tf.numpy_function(
      read, [rows], [tf.int32, tf.int64, tf.int32, tf.int64], stateful=False)
  return tuple(
      tf.RaggedTensor.from_row_splits(tf.ensure_shape(tokens, [None]),
                                      tf.ensure_shape(splits, [None]),
                                      validate=False)
      for tokens, splits in ((source, source_splits), (target, target_splits)))


def greedy_row_starts(source_lengths: tf.Tensor, target_lengths: tf.Tensor,
                      max_source_length: int, max_target_length: int) -> tf.Tensor:
  """First example of each row when packing examples in order, next-fit.

  A row takes examples until the next one would overflow its source or its
  target.  Sequential by nature, computed here by pointer doubling: if
  jump[s] is the example after a row starting at s, the row starts are
  jump^i(0), and jump^i is composed from jump^(2^b) for the bits b of i.

  Args:
    source_lengths, target_lengths: [examples] int32, each at most its max.

  Returns:
    [rows] int32, increasing, starting with 0.
  """
  num_examples = tf.size(source_lengths)

  def first_misfit(lengths, max_length):
    bounds = tf.concat([[0], tf.cumsum(lengths)], axis=0)
    return tf.searchsorted(bounds, bounds[:-1] + max_length, side='right') - 1

  jump = tf.concat([tf.minimum(first_misfit(source_lengths, max_source_length),
                               first_misfit(target_lengths, max_target_length)),
                    [num_examples]], axis=0)
  row_number = tf.range(num_examples)
  starts = tf.zeros_like(row_number)

  def double(bit, starts, jump):
    uses_bit = tf.bitwise.bitwise_and(row_number, bit) != 0
    starts = tf.where(uses_bit, tf.gather(jump, starts), starts)
    return bit * 2, starts, tf.gather(jump, jump)

  _, starts, _ = tf.while_loop(
      lambda bit, starts, jump: bit < num_examples, double,
      (tf.constant(1), starts, jump))
  return tf.boolean_mask(starts, starts < num_examples)


def pack_into_rows(source: tf.RaggedTensor, target: tf.RaggedTensor,
                   row_of_example: tf.Tensor, num_rows: tf.Tensor,
                   source_width: tf.Tensor, target_width: tf.Tensor
                   ) -> dict[str, tf.Tensor]:
  """Lays examples out in rows, side by side within a row.

  Args:
    source, target: [examples, (length)] int32 token ids.
    row_of_example: [examples] int32, non-decreasing, each < num_rows.
    num_rows, source_width, target_width: scalar int32.

  Returns:
    'inputs', 'inputs_segment_ids', 'inputs_positions' [num_rows,
    source_width] and the 'targets...' ones [num_rows, target_width], int32:
    segment k + 1 holds the k-th example of the row, padding is 0.
  """
  examples = tf.range(tf.size(row_of_example))
  first_of_row = tf.searchsorted(row_of_example, tf.range(num_rows), side='left')
  first_of_my_row = tf.gather(first_of_row, row_of_example)
  segment_ids = examples - first_of_my_row + 1

  def lay_out(tokens: tf.RaggedTensor, width: tf.Tensor) -> tuple[tf.Tensor, ...]:
    lengths = tf.cast(tokens.row_lengths(), tf.int32)
    starts = tf.cumsum(lengths, exclusive=True)
    columns = starts - tf.gather(starts, first_of_my_row)
    token_example = tf.cast(tokens.value_rowids(), tf.int32)
    positions = tf.range(tf.size(tokens.flat_values)) - tf.gather(starts, token_example)
    indices = tf.stack([tf.gather(row_of_example, token_example),
                        tf.gather(columns, token_example) + positions], axis=1)
    shape = tf.stack([num_rows, width])
    return (tf.scatter_nd(indices, tokens.flat_values, shape),
            tf.scatter_nd(indices, tf.gather(segment_ids, token_example), shape),
            tf.scatter_nd(indices, positions, shape))

  batch = {}
  for side, tokens, width in (('inputs', source, source_width),
                              ('targets', target, target_width)):
    batch[side], batch[f'{side}_segment_ids'], batch[f'{side}_positions'] = (
        lay_out(tokens, width))
  return batch


@tf.function(input_signature=[
    tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
    tf.TensorSpec([], tf.int32), tf.TensorSpec([], tf.int32),
    tf.TensorSpec([2], tf.int64), tf.TensorSpec([], tf.bool)])
def packing_plan(source_lengths, target_lengths, max_source_length,
                 max_target_length, seed, shuffle):
  """One epoch of packing: the order of the examples and where rows start.

  Args:
    source_lengths, target_lengths: [examples] int32.
    max_source_length, max_target_length: scalar int32, the row widths.
    seed: [2] int64; shuffle: scalar bool, False keeps the given order.

  Returns:
    order: [examples] int32, the examples in the order they are packed.
    row_bounds: [rows + 1] int32; row r holds order[row_bounds[r]:row_bounds[r + 1]].
  """
  order = epochs.permutation(tf.size(source_lengths), seed, shuffle)
  row_starts = greedy_row_starts(tf.gather(source_lengths, order),
                                 tf.gather(target_lengths, order),
                                 max_source_length, max_target_length)
  return order, tf.concat([row_starts, [tf.size(order)]], axis=0)


# ------------------------------------------------------------------ training


def _concat_blocks(blocks: list[Batch]) -> Batch:
  """One batch of the rows of `blocks` (each [rows_i, ...]) in order."""
  if len(blocks) == 1:
    return blocks[0]
  return {key: tf.concat([block[key] for block in blocks], 0)
          for key in blocks[0]}


def _packed_dataset(examples: TokenizedSplit, data_config, start_step: int,
                    process_index: int, share: RowShare,
                    row_multiple: int) -> tf.data.Dataset:
  del row_multiple  # data.batch_size is the user's; see check_batch_shapes.
  batch_size = data_config.batch_size
  train_rows_per_process(batch_size, share)  # Checks that it divides.
  max_source, max_target = data_config.max_source_length, data_config.max_target_length
  source_lengths = tf.constant(examples.source_lengths)
  target_lengths = tf.constant(examples.target_lengths)
  shuffle = tf.constant(data_config.shuffle_buffer > 0)

  def epoch_plan(epoch):
    return packing_plan(source_lengths, target_lengths, max_source, max_target,
                        epochs.epoch_seed(data_config.seed, epoch, 0), shuffle)

  def batches_of_epoch(plan):
    num_rows = tf.size(plan[1]) - 1
    return tf.cast((num_rows + batch_size - 1) // batch_size, tf.int64)

  def make_block(plan, batch_number, offset, rows):
    """Rows [offset, offset + rows) of the global batch."""
    order, row_bounds = plan
    num_rows = tf.size(row_bounds) - 1
    first_row = tf.cast(batch_number, tf.int32) * batch_size + offset
    first_row, end_row = tf.minimum(first_row, num_rows), tf.minimum(first_row + rows, num_rows)
    positions = tf.range(row_bounds[first_row], row_bounds[end_row])
    row_of_example = tf.searchsorted(row_bounds, positions, side='right') - 1 - first_row
    source, target = gather_examples(examples, tf.gather(order, positions))
    return pack_into_rows(source, target, row_of_example, rows, max_source,
                          max_target)

  def make_batch(plan, batch_number):
    return _concat_blocks([make_block(plan, batch_number, offset, rows)
                           for offset, rows in share.row_ranges(batch_size)])

  counts = None if examples.folder is None else epoch_counts.packing(
      data_config, examples.folder, examples.source_lengths,
      examples.target_lengths, _PLANNER,
      writer=process_index == 0)
  first_epoch, first_batch = epochs.locate_step(
      start_step, lambda epoch: batches_of_epoch(epoch_plan(epoch)),
      examples.num_examples, counts)
  plans = epochs.batches_from(first_epoch, first_batch, epoch_plan,
                              batches_of_epoch,
                              counts.record if counts else None)
  return plans.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE)


def bucket_lengths(max_length: int) -> list[int]:
  """Bucket widths up to max_length: steps of 8, then of about a quarter."""
  widths, width = [], _BUCKET_GRANULARITY
  while width < max_length:
    widths.append(width)
    step = width // 4 // _BUCKET_GRANULARITY * _BUCKET_GRANULARITY
    width += max(_BUCKET_GRANULARITY, step)
  return widths + [max_length]


def bucket_rows(tokens_per_batch: int, widths, row_multiple: int = 1
                ) -> np.ndarray:
  """Global rows of each bucket's batches: the most rows of each width
  within the token budget that are a multiple of `row_multiple` (at least
  one multiple).

  Args:
    widths: [buckets] int; row_multiple: rows must divide into this many
      equal parts (the mesh's row shards times the microbatches).

  Returns:
    [buckets] int.
  """
  if row_multiple < 1:
    raise ValueError(f'row_multiple={row_multiple} must be at least 1.')
  rows = tokens_per_batch // np.asarray(widths)
  return np.maximum(rows // row_multiple * row_multiple, row_multiple)


def batch_shapes(data_config: ml_collections.ConfigDict, row_multiple: int = 1
                 ) -> list[tuple[int, int, int]]:
  """Every global batch shape training can produce, as (rows, source width,
  target width): one for 'pack', one per bucket for 'bucket' (see
  `bucket_rows`)."""
  max_source, max_target = data_config.max_source_length, data_config.max_target_length
  if data_config.batching != 'bucket':
    return [(int(data_config.batch_size), max_source, max_target)]
  widths = bucket_lengths(max(max_source, max_target))
  rows = bucket_rows(data_config.tokens_per_batch, widths, row_multiple)
  return [(int(r), min(w, max_source), min(w, max_target))
          for r, w in zip(rows, widths)]


def _bucket_batches(example_buckets: np.ndarray, rows_per_bucket: np.ndarray
                    ) -> np.ndarray:
  """[batches, 3] (bucket, first, count) into the examples sorted by bucket."""
  counts = np.bincount(example_buckets, minlength=len(rows_per_bucket))
  bucket_offsets = np.concatenate([[0], np.cumsum(counts)])
  batches = [(bucket, bucket_offsets[bucket] + first, min(rows, count - first))
             for bucket, (count, rows) in enumerate(zip(counts, rows_per_bucket))
             for first in range(0, count, rows)]
  return np.array(batches, np.int32).reshape(-1, 3)


def _bucketed_dataset(examples: TokenizedSplit, data_config, start_step: int,
                      process_index: int, share: RowShare,
                      row_multiple: int) -> tf.data.Dataset:
  del process_index
  max_source, max_target = data_config.max_source_length, data_config.max_target_length
  widths = np.array(bucket_lengths(max(max_source, max_target)))
  global_rows = bucket_rows(data_config.tokens_per_batch, widths, row_multiple)
  example_buckets = np.searchsorted(
      widths, np.maximum(examples.source_lengths, examples.target_lengths))
  batch_table = _bucket_batches(example_buckets, global_rows)
  shuffle = tf.constant(data_config.shuffle_buffer > 0)

  # Row shards take equal shares of a bucket's batches (row_multiple is a
  # multiple of the shards), so a bucket's last batch may end with empty rows.
  for rows in global_rows:
    share.check_divides(int(rows))
  shard_rows_of_bucket = tf.constant(global_rows // share.num_shards, tf.int32)
  source_width_of_bucket = tf.constant(np.minimum(widths, max_source), tf.int32)
  target_width_of_bucket = tf.constant(np.minimum(widths, max_target), tf.int32)
  buckets = tf.constant(example_buckets, tf.int32)
  batch_table = tf.constant(batch_table)
  num_examples, num_batches = examples.num_examples, int(batch_table.shape[0])

  def epoch_plan(epoch):
    order = epochs.permutation(
        num_examples, epochs.epoch_seed(data_config.seed, epoch, 0), shuffle)
    by_bucket = tf.gather(order, tf.argsort(tf.gather(buckets, order), stable=True))
    batch_order = epochs.permutation(
        num_batches, epochs.epoch_seed(data_config.seed, epoch, 1), shuffle)
    return by_bucket, batch_order

  def make_batch(plan, batch_number):
    by_bucket, batch_order = plan
    bucket, first, count = tf.unstack(batch_table[batch_order[batch_number]])
    shard_rows = shard_rows_of_bucket[bucket]
    blocks = []
    for first_shard, shards in share.blocks():
      start, rows = first_shard * shard_rows, shards * shard_rows
      mine = tf.range(tf.minimum(start, count), tf.minimum(start + rows, count))
      chosen = tf.gather(by_bucket, first + mine)
      source, target = gather_examples(examples, chosen)
      blocks.append(pack_into_rows(
          source, target, tf.range(tf.size(chosen)), rows,
          source_width_of_bucket[bucket], target_width_of_bucket[bucket]))
    return _concat_blocks(blocks)

  first_epoch, first_batch = divmod(start_step, num_batches)
  plans = epochs.batches_from(first_epoch, first_batch, epoch_plan,
                              lambda plan: tf.constant(num_batches, tf.int64))
  return plans.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE)


def _start_tensorflow() -> None:
  """Keeps TensorFlow on the CPU so that it leaves GPU/TPU memory to JAX."""
  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError):  # Already initialised, or no such type.
    pass


def _as_numpy(dataset: tf.data.Dataset, examples: TokenizedSplit
              ) -> Iterator[Batch]:
  """The batches of `dataset` (which starts reading now), holding
  `examples`, which its gather_examples read, while they are iterated."""
  options = tf.data.Options()
  options.deterministic = True
  iterator = dataset.with_options(options).prefetch(
      tf.data.AUTOTUNE).as_numpy_iterator()

  def batches(holding=examples):
    yield from iterator

  return batches()


def translation_train_batches(
    data_config: ml_collections.ConfigDict, source_tok: tokenizer_lib.Tokenizer,
    target_tok: tokenizer_lib.Tokenizer, *, start_step: int = 0,
    process_index: int = 0, share: RowShare = RowShare(), row_multiple: int = 1,
    token_cache: str | None = None) -> Iterator[Batch]:
  """This process's rows (`share`) of global batches start_step,
  start_step + 1, ...

  Infinite and deterministic for a given config and row_multiple: batch k
  is the same whatever start_step was, and global row r of it holds the
  same examples whatever the share.  'pack' batches have
  `share.local_rows(batch_size)` rows of max_*_length; 'bucket' batches
  have `share.local_rows(rows)` rows of a width, with rows from
  `bucket_rows(tokens_per_batch, widths, row_multiple)` and width one of
  `bucket_lengths` (capped by each side's max length), the same on every
  process at each step.  process_index 0 writes what is written once.  The split
  is tokenised once into `token_cache` (a directory, see token_cache.py), or
  in memory when None; each batch reads only the token ids of its rows.

  Yields:
    'inputs', 'inputs_segment_ids', 'inputs_positions' [rows, source_width]
    and 'targets', 'targets_segment_ids', 'targets_positions' [rows,
    target_width], int32.  Padding is 0 with segment id 0; positions restart
    at 0 in each segment.
  """
  builders = {'pack': _packed_dataset, 'bucket': _bucketed_dataset}
  if data_config.batching not in builders:
    raise ValueError(f"data.batching must be 'pack' or 'bucket', got "
                     f'{data_config.batching!r}')
  _start_tensorflow()
  examples = training_examples(data_config, source_tok, target_tok,
                               token_cache, process_index)
  dataset = builders[data_config.batching](examples, data_config, start_step,
                                           process_index, share, row_multiple)
  return _as_numpy(dataset, examples)


# ---------------------------------------------------------------- evaluation


def translation_eval_batches(
    data_config: ml_collections.ConfigDict, source_tok: tokenizer_lib.Tokenizer,
    target_tok: tokenizer_lib.Tokenizer, split: str, *,
    batch_size: int | None = None, process_index: int = 0,
    share: RowShare = RowShare(), token_cache: str | None = None
    ) -> Iterator[Batch]:
  """Every example of `split` exactly once across processes, in order.

  Global batch b holds examples [b * G, (b + 1) * G), G = batch_size rounded
  up to a multiple of the row shards (`eval_global_rows`); each process
  takes the rows of its `share`.  Rows past the end are padding.  Every
  process yields the same number of [share.local_rows(G), max_*_length]
  batches.  Examples longer than
  the max lengths are truncated, keeping their final EOS_ID.  `token_cache`
  as for `translation_train_batches`.

  Yields:
    The keys of `translation_train_batches` (one example per row, segment id 1) plus
    'example_index' [R] int32: the example's index in the split, -1 for
    padding rows.
  """
  _start_tensorflow()
  max_source, max_target = data_config.max_source_length, data_config.max_target_length
  examples = token_cache_lib.tokenized_split(
      data_config, split, source_tok, target_tok, token_cache,
      process_index=process_index)
  global_rows = eval_global_rows(batch_size or data_config.batch_size, share)
  num_batches = -(-examples.num_examples // global_rows)

  def make_block(batch_number, offset, rows):
    first = tf.cast(batch_number, tf.int32) * global_rows + offset
    chosen = tf.range(tf.minimum(first, examples.num_examples),
                      tf.minimum(first + rows, examples.num_examples))
    source, target = gather_examples(examples, chosen, max_source, max_target)
    batch = pack_into_rows(source, target, tf.range(tf.size(chosen)), rows,
                           max_source, max_target)
    batch['example_index'] = tf.pad(chosen, [[0, rows - tf.size(chosen)]],
                                    constant_values=-1)
    return batch

  def make_batch(batch_number):
    return _concat_blocks([make_block(batch_number, offset, rows)
                           for offset, rows in share.row_ranges(global_rows)])

  dataset = tf.data.Dataset.range(num_batches).map(
      make_batch, num_parallel_calls=tf.data.AUTOTUNE)
  return _as_numpy(dataset, examples)
