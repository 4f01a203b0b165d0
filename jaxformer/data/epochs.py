"""The sequence of training epochs: each epoch's seeded order, which epoch
and batch a global step falls in (what a resume plans), and the stream of
(epoch plan, batch number) elements that batches are made from.

A batching (packing.py, bucketing.py) supplies `epoch_plan(epoch)` (a
TensorFlow function of the epoch number: its permutation, packing, ...)
and `batches_of_epoch(plan)`; what is here knows nothing of tokens.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

from jaxformer.data import epoch_counts

PLAN_EXAMPLES = 1 << 22  # examples planned at once when resuming


def epoch_seed(seed: int, epoch: tf.Tensor, stream: int) -> tf.Tensor:
  """[2] int64 seed of one random stream of one epoch."""
  return tf.stack([tf.constant(seed, tf.int64), 2 * tf.cast(epoch, tf.int64) + stream])


def permutation(size: tf.Tensor, seed: tf.Tensor, shuffle: tf.Tensor) -> tf.Tensor:
  """[size] int32: a permutation fixed by `seed` [2], or the identity."""
  order = tf.range(size)
  return tf.cond(shuffle,
                 lambda: tf.random.experimental.stateless_shuffle(order, seed=seed),
                 lambda: order)


def locate_step(step: int, batches_in_epoch, num_examples: int,
                counts: epoch_counts.EpochCounts | None = None
                ) -> tuple[int, int]:
  """(epoch, batch within epoch) of global batch number `step`.

  Epochs whose batch count `counts` knows are not planned; the next ones
  are, by `batches_in_epoch(epoch)` (a TensorFlow function), in parallel
  on the CPU cores, as many at once as host memory allows (a plan needs
  ~120 bytes per example while it is computed), and recorded in `counts`.
  """
  if step == 0:
    return 0, 0
  known = counts.known() if counts else []
  planned = planned_counts(len(known), batches_in_epoch, num_examples)
  for epoch, count in itertools.chain(enumerate(known), planned):
    if counts and epoch >= len(known):
      counts.record(epoch, count)
    if step < count:
      return epoch, step
    step -= count
  raise AssertionError('unreachable: the epochs never end')


def planned_counts(first_epoch: int, batches_in_epoch, num_examples: int
                   ) -> Iterator[tuple[int, int]]:
  """(epoch, batches) of epochs first_epoch, first_epoch + 1, ..., planned
  (from the first next() on)."""
  parallel = max(1, min(os.cpu_count() or 1,
                        PLAN_EXAMPLES // max(num_examples, 1)))
  counts = tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max).map(
      tf.autograph.experimental.do_not_convert(batches_in_epoch),
      num_parallel_calls=parallel)
  yield from enumerate(counts.as_numpy_iterator(), start=first_epoch)


def batches_from(first_epoch: int, first_batch: int, epoch_plan,
                 batches_of_epoch, record=None) -> tf.data.Dataset:
  """Plan elements of every epoch from `first_epoch`, skipping `first_batch`;
  `record(epoch, batches)`, if given, is told each epoch's count."""
  # Graph ops only: autograph would rewrite them for nothing (start-up time).
  @tf.autograph.experimental.do_not_convert
  def batches(epoch):
    plan = epoch_plan(epoch)
    count = batches_of_epoch(plan)
    if record is not None:
      count = tf.ensure_shape(tf.numpy_function(
          lambda epoch, count: (record(epoch, count), count)[1],
          [epoch, count], tf.int64, stateful=True), [])
    first = tf.where(epoch == first_epoch, tf.constant(first_batch, tf.int64), 0)
    batch_numbers = tf.data.Dataset.range(first, count)
    return batch_numbers.map(tf.autograph.experimental.do_not_convert(
        lambda number: (plan, number)))

  return tf.data.Dataset.range(first_epoch, np.iinfo(np.int64).max).flat_map(batches)
