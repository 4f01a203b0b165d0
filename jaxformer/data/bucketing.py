"""'bucket' batching: examples grouped by max(source, target) length into
buckets of `bucket_lengths(...)`; a batch of bucket width w has the most
rows within tokens_per_batch that are a multiple of the row multiple (the
mesh's row shards and the microbatch count, `bucket_rows`), completed with
empty rows to a multiple of the process count (so the plan does not depend
on the process count); the batches of an epoch are shuffled; each bucket's
last batch is completed with empty rows. An epoch has a constant number of
batches, so a resume plans nothing.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from jaxformer.data import epochs
from jaxformer.data.batch_layout import (concat_blocks, gather_examples,
                                         pack_into_rows)
from jaxformer.data.ragged_tokens import TokenizedSplit
from jaxformer.parallel.row_share import RowShare

_BUCKET_GRANULARITY = 8


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


def _bucket_batches(example_buckets: np.ndarray, rows_per_bucket: np.ndarray
                    ) -> np.ndarray:
  """[batches, 3] (bucket, first, count) into the examples sorted by bucket."""
  counts = np.bincount(example_buckets, minlength=len(rows_per_bucket))
  bucket_offsets = np.concatenate([[0], np.cumsum(counts)])
  batches = [(bucket, bucket_offsets[bucket] + first, min(rows, count - first))
             for bucket, (count, rows) in enumerate(zip(counts, rows_per_bucket))
             for first in range(0, count, rows)]
  return np.array(batches, np.int32).reshape(-1, 3)


def bucketed_dataset(examples: TokenizedSplit, data_config, start_step: int,
                     process_index: int, share: RowShare,
                     row_multiple: int) -> tf.data.Dataset:
  """This process's rows (`share`) of the 'bucket' batches start_step,
  start_step + 1, ... of `examples`, as `pipeline.translation_train_batches`
  yields them."""
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

  # Graph ops only: autograph would rewrite it for nothing (start-up time).
  @tf.autograph.experimental.do_not_convert
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
    return concat_blocks(blocks)

  first_epoch, first_batch = divmod(start_step, num_batches)
  plans = epochs.batches_from(first_epoch, first_batch, epoch_plan,
                              lambda plan: tf.constant(num_batches, tf.int64))
  return plans.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE)
