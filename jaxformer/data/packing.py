"""'pack' batching: greedy next-fit packing of each epoch's permuted
examples into rows of max_source_length / max_target_length (an example's
source and target share a row and a segment number); batch_size rows per
global batch; the last batch of an epoch is completed with empty rows.

An epoch's plan (`packing_plan`) is computed from the examples' lengths
alone, O(n log n); its number of batches is kept once computed
(epoch_counts.py), so that a resume plans only the epoch it resumes in.
"""

from __future__ import annotations

import tensorflow as tf

from jaxformer.data import epoch_counts
from jaxformer.data import epochs
from jaxformer.data.batch_layout import (concat_blocks, gather_examples,
                                         pack_into_rows,
                                         train_rows_per_process)
from jaxformer.data.ragged_tokens import TokenizedSplit
from jaxformer.parallel.row_share import RowShare

# Names the packing plans in stored epoch counts: change it when they change.
PLANNER = f'packing_plan 1, tensorflow {tf.__version__}'


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


@tf.function(autograph=False, input_signature=[
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


def packed_dataset(examples: TokenizedSplit, data_config, start_step: int,
                   process_index: int, share: RowShare,
                   row_multiple: int) -> tf.data.Dataset:
  """This process's rows (`share`) of the 'pack' batches start_step,
  start_step + 1, ... of `examples`, as `pipeline.translation_train_batches`
  yields them."""
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

  # Graph ops only: autograph would rewrite it for nothing (start-up time).
  @tf.autograph.experimental.do_not_convert
  def make_batch(plan, batch_number):
    return concat_blocks([make_block(plan, batch_number, offset, rows)
                          for offset, rows in share.row_ranges(batch_size)])

  counts = None if examples.folder is None else epoch_counts.packing(
      data_config, examples.folder, examples.source_lengths,
      examples.target_lengths, PLANNER,
      writer=process_index == 0)
  first_epoch, first_batch = epochs.locate_step(
      start_step, lambda epoch: batches_of_epoch(epoch_plan(epoch)),
      examples.num_examples, counts)
  plans = epochs.batches_from(first_epoch, first_batch, epoch_plan,
                              batches_of_epoch,
                              counts.record if counts else None)
  return plans.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE)
