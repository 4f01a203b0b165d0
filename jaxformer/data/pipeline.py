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
  * 'pack' (packing.py): the permuted examples packed next-fit into rows of
    the max lengths; batch_size rows per global batch.
  * 'bucket' (bucketing.py): examples grouped into buckets of widths by
    length; each width's batches have the most rows within
    tokens_per_batch.
Each process builds only its own rows of every global batch (batch_layout.py),
so all processes yield identical shapes at every step.

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

from collections.abc import Iterator

import ml_collections
import numpy as np
import tensorflow as tf

from jaxformer.data import language_tokenizer
from jaxformer.data import mixture as mixture_lib
from jaxformer.data import sources
from jaxformer.data import token_cache as token_cache_lib
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.batch_layout import (Batch, concat_blocks,
                                         eval_global_rows, gather_examples,
                                         pack_into_rows)
from jaxformer.data.bucketing import (bucket_lengths, bucket_rows,
                                      bucketed_dataset)
from jaxformer.data.mixed_packing import mixed_dataset
from jaxformer.data.packing import packed_dataset
from jaxformer.data.ragged_tokens import TokenizedSplit
from jaxformer.parallel.row_share import RowShare


def training_examples(data_config: ml_collections.ConfigDict,
                      source_tok: tokenizer_lib.Tokenizer,
                      target_tok: tokenizer_lib.Tokenizer,
                      token_cache: str | None = None, process_index: int = 0,
                      name: str = '') -> TokenizedSplit:
  """The train split without examples longer than the max lengths (`name`:
  see `token_cache.tokenized_split`)."""
  examples = token_cache_lib.tokenized_split(
      data_config, 'train', source_tok, target_tok, token_cache,
      process_index=process_index, name=name)
  fits = ((examples.source_lengths <= data_config.max_source_length) &
          (examples.target_lengths <= data_config.max_target_length))
  if not fits.any():
    raise sources.DataError(
        f'all {examples.num_examples} training examples are longer than '
        f'max_source_length={data_config.max_source_length} or '
        f'max_target_length={data_config.max_target_length} tokens; raise them')
  return examples if fits.all() else examples.subset(np.flatnonzero(fits))


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

  With a `data.mixture` ('pack' only), the rows come from its sources
  (mixed_packing.py), each source tokenised into a cache of its own.

  Yields:
    'inputs', 'inputs_segment_ids', 'inputs_positions' [rows, source_width]
    and 'targets', 'targets_segment_ids', 'targets_positions' [rows,
    target_width], int32.  Padding is 0 with segment id 0; positions restart
    at 0 in each segment.  With a mixture, also 'source_counts' [sources]
    int64: the examples each source gave to the global batch.
  """
  builders = {'pack': packed_dataset, 'bucket': bucketed_dataset}
  if data_config.batching not in builders:
    raise ValueError(f"data.batching must be 'pack' or 'bucket', got "
                     f'{data_config.batching!r}')
  _start_tensorflow()
  mixture = mixture_lib.parse(data_config)
  if mixture is not None:
    splits = _mixture_examples(mixture, source_tok, target_tok, token_cache,
                               process_index)
    return _as_numpy(*mixed_dataset(splits, mixture, data_config, start_step,
                                    process_index, share))
  examples = training_examples(data_config, source_tok, target_tok,
                               token_cache, process_index)
  dataset = builders[data_config.batching](examples, data_config, start_step,
                                           process_index, share, row_multiple)
  return _as_numpy(dataset, examples)


def _mixture_examples(mixture: mixture_lib.Mixture, source_tok, target_tok,
                      token_cache, process_index: int) -> list[TokenizedSplit]:
  """Each source's training examples, in its own language pair where it
  names one, every train file checked first (where this process reads
  them: with a shared cache, process 0 alone)."""
  if process_index == 0 or not isinstance(token_cache,
                                          token_cache_lib.SharedCache):
    mixture_lib.check_files(mixture)
  splits = []
  for name, config in zip(mixture.names, mixture.configs):
    try:
      splits.append(training_examples(
          config, *language_tokenizer.bind_pair(source_tok, target_tok,
                                                config),
          token_cache, process_index, name=f'mixture/{name}'))
    except sources.DataError as e:
      raise type(e)(f"data.mixture source '{name}': {e}") from None
  return splits


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

  # Graph ops only: autograph would rewrite it for nothing (start-up time).
  @tf.autograph.experimental.do_not_convert
  def make_batch(batch_number):
    return concat_blocks([make_block(batch_number, offset, rows)
                          for offset, rows in share.row_ranges(global_rows)])

  dataset = tf.data.Dataset.range(num_batches).map(
      make_batch, num_parallel_calls=tf.data.AUTOTUNE)
  return _as_numpy(dataset, examples)
