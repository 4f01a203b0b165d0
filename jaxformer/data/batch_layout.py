"""How a translation batch is made from a tokenised split: the rows of a
global batch that one process builds, the token ids of a batch's examples
(read when the batch is made), and the examples laid out side by side in
rows (TensorFlow ops, shared by packing, bucketing and evaluation)."""

from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from jaxformer.data.ragged_tokens import TokenizedSplit
from jaxformer.parallel.row_share import RowShare, round_up_rows

Batch = dict[str, np.ndarray]


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


def gather_examples(examples: TokenizedSplit, rows: tf.Tensor,
                    max_source_length: int | None = None,
                    max_target_length: int | None = None
                    ) -> tuple[tf.RaggedTensor, tf.RaggedTensor]:
  """Examples `rows` [k] int32 as (source, target) [k, (length)] int32,
  read from `examples` (the token cache) when the batch is made; cut to the
  max lengths (keeping EOS) when given.  The caller keeps `examples` alive
  while the dataset runs (see `pipeline._as_numpy`)."""
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


def concat_blocks(blocks: list[Batch]) -> Batch:
  """One batch of the rows of `blocks` (each [rows_i, ...]) in order."""
  if len(blocks) == 1:
    return blocks[0]
  return {key: tf.concat([block[key] for block in blocks], 0)
          for key in blocks[0]}
