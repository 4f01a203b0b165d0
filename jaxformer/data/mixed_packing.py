"""'pack' batches of a `data.mixture`: each source packed into rows of its
own, epoch after epoch (`packing.packing_plan`: its seeded order, next-fit
rows), and the rows of every global batch drawn from the sources by
`mixture.draws`, so batch k is a pure function of (data, config, k).

A row holds examples of one source. A source's rows are drawn at its
weight divided by its examples per row (in its first epoch's plan), so the
examples drawn follow the weights (and its tokens, weight x mean length).
The rows of each epoch of a source are counted beside its token cache as
'pack' batches of one row (epoch_counts.py), so a resume plans only the
epochs whose count is not stored, in parallel, moving no tokens.
"""

from __future__ import annotations

import collections

import ml_collections
import numpy as np
import tensorflow as tf

from jaxformer.data import epoch_counts
from jaxformer.data import epochs
from jaxformer.data import mixture as mixture_lib
from jaxformer.data import packing
from jaxformer.data.batch_layout import (gather_examples, pack_into_rows,
                                         train_rows_per_process)
from jaxformer.data.ragged_tokens import TokenizedSplit, concatenate
from jaxformer.parallel.row_share import RowShare

_PLANS_KEPT = 2  # epoch plans kept per source (the one read, the next)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """[sum(lengths)] the ranges [starts[i], starts[i] + lengths[i]) in order."""
  offsets = np.cumsum(lengths) - lengths
  return np.repeat(starts - offsets, lengths) + np.arange(lengths.sum())


class SourceRows:
  """One source's endless stream of packed rows: the rows of its epochs'
  plans one after another."""

  def __init__(self, examples: TokenizedSplit, data_config, writer: bool):
    self.num_examples = examples.num_examples
    self._lengths = (tf.constant(examples.source_lengths),
                     tf.constant(examples.target_lengths))
    self._widths = (data_config.max_source_length,
                    data_config.max_target_length)
    self._seed = data_config.seed
    self._shuffle = tf.constant(data_config.shuffle_buffer > 0)
    rows = ml_collections.ConfigDict(data_config.to_dict())
    rows.batch_size = 1
    self._counts = None if examples.folder is None else epoch_counts.packing(
        rows, examples.folder, examples.source_lengths,
        examples.target_lengths, packing.PLANNER, writer=writer)
    known = self._counts.known() if self._counts else []
    self.first_rows = [0] + np.cumsum(known, dtype=np.int64).tolist()
    self._plans = collections.OrderedDict()

  def _plan_tensors(self, epoch):
    return packing.packing_plan(*self._lengths, *self._widths,
                                epochs.epoch_seed(self._seed, epoch, 0),
                                self._shuffle)

  def _rows_in(self, epoch: tf.Tensor) -> tf.Tensor:
    return tf.cast(tf.size(self._plan_tensors(epoch)[1]) - 1, tf.int64)

  def _record(self, epoch: int, rows: int) -> None:
    if epoch == len(self.first_rows) - 1:
      self.first_rows.append(self.first_rows[-1] + rows)
    if self._counts:
      self._counts.record(epoch, rows)

  def plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(order [examples], row_bounds [rows + 1]) of `epoch` (see
    `packing.packing_plan`)."""
    if epoch not in self._plans:
      order, bounds = (t.numpy() for t in self._plan_tensors(epoch))
      self._record(epoch, len(bounds) - 1)
      self._plans[epoch] = order, bounds
      while len(self._plans) > _PLANS_KEPT:
        self._plans.popitem(last=False)
    self._plans.move_to_end(epoch)
    return self._plans[epoch]

  def reach(self, row: int) -> None:
    """Counts the rows of the epochs up to the one holding stream row
    `row`; those not stored are planned in parallel (a resume)."""
    if self.first_rows[-1] > row:
      return
    for epoch, rows in epochs.planned_counts(
        len(self.first_rows) - 1, self._rows_in, self.num_examples):
      self._record(epoch, int(rows))
      if self.first_rows[-1] > row:
        return

  def examples_per_row(self) -> float:
    """Examples per row of the first epoch."""
    if len(self.first_rows) < 2:
      self.plan(0)
    return self.num_examples / self.first_rows[1]

  def rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The examples of stream rows `index` [k] (increasing): their ids [m]
    row after row, and [k] how many each row holds."""
    while self.first_rows[-1] <= index[-1]:
      self.plan(len(self.first_rows) - 1)
    first_rows = np.asarray(self.first_rows)
    epoch_of = np.searchsorted(first_rows, index, side='right') - 1
    ids, lengths = [], []
    for epoch in np.unique(epoch_of):
      order, bounds = self.plan(int(epoch))
      within = index[epoch_of == epoch] - first_rows[epoch]
      lengths.append(bounds[within + 1] - bounds[within])
      ids.append(order[_ranges(bounds[within], lengths[-1])])
    return np.concatenate(ids), np.concatenate(lengths)


def mixed_dataset(splits: list[TokenizedSplit],
                  mixture: mixture_lib.Mixture, data_config,
                  start_step: int, process_index: int, share: RowShare
                  ) -> tuple[tf.data.Dataset, TokenizedSplit]:
  """This process's rows (`share`) of the 'pack' batches start_step,
  start_step + 1, ... of the mixture of `splits` (one per source, in
  `mixture` order), and the split they read (the sources' examples one
  after another), to keep while the dataset is read.

  Each batch is that of `pipeline.translation_train_batches`, plus
  'source_counts' [sources] int64: the examples each source gave to the
  global batch (the same on every process).
  """
  batch_size, seed = data_config.batch_size, data_config.seed
  local_rows = train_rows_per_process(batch_size, share)
  streams = [SourceRows(split, data_config, writer=process_index == 0)
             for split in splits]
  rows_mixture = mixture.per_row([s.examples_per_row() for s in streams])
  before = mixture_lib.counts_before(rows_mixture, seed, start_step,
                                     batch_size)
  for stream, first_row in zip(streams, before):
    stream.reach(int(first_row))
  offsets = np.cumsum([0] + [s.num_examples for s in streams[:-1]])
  local_row_of = np.full(batch_size, -1)
  local_row_of[share.rows(batch_size)] = np.arange(local_rows)

  def plan(draw: mixture_lib.Draw):
    """(example ids [m], local row of each [m], drawn [sources]) of a batch."""
    ids, rows, drawn = [], [], np.zeros(len(streams), np.int64)
    for number, stream in enumerate(streams):
      chosen = np.flatnonzero(draw.source == number)
      if not chosen.size:
        continue
      example_ids, lengths = stream.rows(draw.index[chosen])
      drawn[number] = lengths.sum()
      row_of = np.repeat(local_row_of[chosen], lengths)
      ids.append(example_ids[row_of >= 0] + offsets[number])
      rows.append(row_of[row_of >= 0])
    ids, rows = np.concatenate(ids), np.concatenate(rows)
    order = np.argsort(rows, kind='stable')
    return ids[order].astype(np.int32), rows[order].astype(np.int32), drawn

  def plans():
    for draw in mixture_lib.draws(rows_mixture, seed, batch_size, start_step):
      yield plan(draw)

  examples = concatenate(splits)
  max_source, max_target = data_config.max_source_length, data_config.max_target_length

  # Graph ops only: autograph would rewrite it for nothing (start-up time).
  @tf.autograph.experimental.do_not_convert
  def make_batch(ids, rows, drawn):
    source, target = gather_examples(examples, ids)
    batch = pack_into_rows(source, target, rows, local_rows, max_source,
                           max_target)
    batch['source_counts'] = drawn
    return batch

  dataset = tf.data.Dataset.from_generator(plans, output_signature=(
      tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
      tf.TensorSpec([len(streams)], tf.int64)))
  return dataset.map(make_batch, num_parallel_calls=tf.data.AUTOTUNE), examples
