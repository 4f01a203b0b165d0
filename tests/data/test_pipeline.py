import itertools

import numpy as np
import pytest
import tensorflow as tf

from jaxformer.data import batch_layout, bucketing, builtin, packing
from jaxformer.data.defaults import default_data_config
from jaxformer.data import pipeline
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.sources import DataError
from jaxformer.data.tokenizer import EOS_ID
from jaxformer.parallel.row_share import RowShare

NUM_TRAIN, NUM_DEV = 300, 23
KEYS = ('inputs', 'inputs_segment_ids', 'inputs_positions',
        'targets', 'targets_segment_ids', 'targets_positions')


def small_config(**overrides):
  config = default_data_config()
  config.builtin.update(num_train=NUM_TRAIN, num_dev=NUM_DEV, num_test=5)
  config.tokenizer.vocab_size = 200
  config.update(batch_size=8, max_source_length=64, max_target_length=56,
                tokens_per_batch=512)
  config.update(overrides)
  return config


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  texts = [text for pair in builtin.generate(NUM_TRAIN, 0, 'train') for text in pair]
  prefix = str(tmp_path_factory.mktemp('tokenizer') / 'joint')
  return tokenizer_lib.train_tokenizer(texts, prefix, small_config().tokenizer)


def take(config, tok, count, **kwargs):
  return list(itertools.islice(pipeline.translation_train_batches(config, tok, tok, **kwargs), count))


def segments(tokens, segment_ids):
  """{segment id: token ids} of one row, each segment in order."""
  return {int(s): tokens[segment_ids == s].tolist() for s in np.unique(segment_ids) if s}


def assert_equal_batches(actual, expected):
  assert len(actual) == len(expected)
  for got, want in zip(actual, expected):
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_greedy_row_starts_packs_next_fit():
  # Source max 6: [3 3] [3] [5 1] [1] [6] [2]; the last target (7) fits alone.
  starts = packing.greedy_row_starts(tf.constant([3, 3, 3, 5, 1, 1, 6, 2]),
                                     tf.constant([1, 1, 1, 1, 1, 1, 1, 7]), 6, 8)
  np.testing.assert_array_equal(starts, [0, 2, 3, 5, 6, 7])


def test_pack_into_rows_lays_out_segments():
  source = tf.ragged.constant([[5, 1], [6, 7, 1], [8, 1]])
  target = tf.ragged.constant([[9, 1], [10, 1], [11, 12, 1]])
  batch = batch_layout.pack_into_rows(source, target, tf.constant([0, 0, 1]), 3, 6, 4)
  np.testing.assert_array_equal(batch['inputs'], [[5, 1, 6, 7, 1, 0], [8, 1, 0, 0, 0, 0], [0] * 6])
  np.testing.assert_array_equal(batch['inputs_segment_ids'], [[1, 1, 2, 2, 2, 0], [1, 1, 0, 0, 0, 0], [0] * 6])
  np.testing.assert_array_equal(batch['inputs_positions'], [[0, 1, 0, 1, 2, 0], [0, 1, 0, 0, 0, 0], [0] * 6])
  np.testing.assert_array_equal(batch['targets'], [[9, 1, 10, 1], [11, 12, 1, 0], [0] * 4])
  np.testing.assert_array_equal(batch['targets_segment_ids'], [[1, 1, 2, 2], [1, 1, 1, 0], [0] * 4])


def test_packed_batches_have_fixed_shapes(tok):
  for batch in take(small_config(), tok, 3):
    assert sorted(batch) == sorted(KEYS)
    for key in ('inputs', 'inputs_segment_ids', 'inputs_positions'):
      assert batch[key].shape == (8, 64) and batch[key].dtype == np.int32
    for key in ('targets', 'targets_segment_ids', 'targets_positions'):
      assert batch[key].shape == (8, 56) and batch[key].dtype == np.int32


@pytest.mark.parametrize('batching', ['pack', 'bucket'])
def test_batches_are_built_without_autograph_warnings(tok, batching, caplog):
  # AutoGraph converts the functions tf.data maps; one it cannot parse it
  # runs as is, and says so in every run ('Please report this...').
  take(small_config(batching=batching), tok, 1)
  assert not [r for r in caplog.records if 'AutoGraph' in r.getMessage()]


def test_packed_rows_hold_whole_matching_examples(tok):
  translations = dict(builtin.generate(NUM_TRAIN, 0, 'train'))
  num_examples = 0
  for batch in take(small_config(), tok, 4):
    for row in range(8):
      inputs = segments(batch['inputs'][row], batch['inputs_segment_ids'][row])
      targets = segments(batch['targets'][row], batch['targets_segment_ids'][row])
      assert list(inputs) == list(targets) == list(range(1, len(inputs) + 1))
      for side in ('inputs', 'targets'):
        ids, positions = batch[f'{side}_segment_ids'][row], batch[f'{side}_positions'][row]
        used = np.count_nonzero(ids)
        assert (ids[:used] > 0).all() and not ids[used:].any() and not batch[side][row, used:].any()
        for segment in np.unique(ids[:used]):
          np.testing.assert_array_equal(positions[ids == segment], np.arange(np.sum(ids == segment)))
      for segment, source_ids in inputs.items():
        assert source_ids[-1] == EOS_ID and targets[segment][-1] == EOS_ID
        assert translations[tok.decode(source_ids)] == tok.decode(targets[segment])
      num_examples += len(inputs)
  assert num_examples > 4 * 8 * 1.5  # Rows usually hold more than one example.


def test_one_epoch_visits_every_example_once(tok):
  english = []
  for batch in pipeline.translation_train_batches(small_config(), tok, tok):
    for row in range(8):
      english += [tok.decode(ids) for ids in
                  segments(batch['inputs'][row], batch['inputs_segment_ids'][row]).values()]
    if len(english) >= NUM_TRAIN:
      break
  assert sorted(english) == sorted(e for e, _ in builtin.generate(NUM_TRAIN, 0, 'train'))


def test_too_long_examples_are_dropped_from_training(tok):
  config = small_config(max_source_length=14, max_target_length=12)
  for batch in take(config, tok, 3):
    for row in range(8):
      for ids in segments(batch['inputs'][row], batch['inputs_segment_ids'][row]).values():
        assert len(ids) <= 14
  with pytest.raises(DataError, match='longer than'):
    take(small_config(max_source_length=2), tok, 1)


@pytest.mark.slow
@pytest.mark.parametrize('batching', ['pack', 'bucket'])
def test_stream_is_deterministic_and_seeded(tok, batching):
  first = take(small_config(batching=batching), tok, 3)
  assert_equal_batches(take(small_config(batching=batching), tok, 3), first)
  reseeded = take(small_config(batching=batching, seed=1), tok, 3)
  assert any(a['inputs'].shape != b['inputs'].shape or (a['inputs'] != b['inputs']).any()
             for a, b in zip(first, reseeded))


@pytest.mark.slow
@pytest.mark.parametrize('batching', ['pack', 'bucket'])
def test_resumed_stream_equals_the_uninterrupted_one(tok, batching):
  config = small_config(batching=batching)
  uninterrupted = take(config, tok, 40)  # Several epochs of 300 examples.
  for start_step in (1, 13, 29):
    assert_equal_batches(take(config, tok, 40 - start_step, start_step=start_step),
                         uninterrupted[start_step:])


@pytest.mark.slow
@pytest.mark.parametrize('batching', ['pack', 'bucket'])
@pytest.mark.parametrize('shards', [((0,), (1,), (2,)), ((0, 2), (1, 3))],
                         ids=['blocks', 'interleaved'])
def test_processes_read_the_rows_of_their_shards(tok, batching, shards):
  """Global row r holds the same examples whichever process reads it, also
  when a process's row shards are not neighbours (TPU pods)."""
  num_shards = sum(map(len, shards))
  config = small_config(batching=batching, batch_size=12, tokens_per_batch=256)
  whole = take(config, tok, 12, row_multiple=num_shards)
  shares = [RowShare(s, num_shards) for s in shards]
  local = [take(config, tok, 12, process_index=p, share=share,
                row_multiple=num_shards) for p, share in enumerate(shares)]
  for step, step_batches in enumerate(zip(*local)):
    rows = whole[step]['inputs'].shape[0]
    for key in KEYS:
      assert len({batch[key].shape for batch in step_batches}) == 1
      together = np.zeros_like(whole[step][key])
      for share, batch in zip(shares, step_batches):
        together[share.rows(rows)] = batch[key]
      np.testing.assert_array_equal(together, whole[step][key])


def test_batch_size_must_divide_among_row_shards(tok):
  with pytest.raises(ValueError, match='not divisible'):
    take(small_config(), tok, 1, share=RowShare.of_process(0, 3))


def test_bucketed_batches_keep_the_token_budget(tok):
  config = small_config(batching='bucket', tokens_per_batch=512)
  widths = bucketing.bucket_lengths(64)
  seen_widths = set()
  for batch in take(config, tok, 30):
    rows, width = batch['inputs'].shape
    seen_widths.add(width)
    assert width in widths and rows * width <= 512
    assert batch['targets'].shape == (rows, min(width, 56))
    assert batch['inputs_segment_ids'].max() == 1  # One example per row.
    longest_side = np.maximum(np.count_nonzero(batch['inputs_segment_ids'], axis=1),
                              np.count_nonzero(batch['targets_segment_ids'], axis=1))
    narrower = widths[widths.index(width) - 1] if width != widths[0] else 0
    assert (longest_side[longest_side > 0] > narrower).all()
  assert len(seen_widths) > 1


def test_bucket_lengths_grow_by_eights_then_quarters():
  assert bucketing.bucket_lengths(64) == [8, 16, 24, 32, 40, 48, 56, 64]
  assert bucketing.bucket_lengths(256)[-4:] == [144, 176, 216, 256]


@pytest.mark.parametrize('shards', [((0,),), ((0,), (1,)), ((0,), (1,), (2,)),
                                    ((0, 2), (1, 3))])
@pytest.mark.parametrize('batch_size', [1, 4, 32])
def test_eval_sees_every_example_exactly_once(tok, shards, batch_size):
  config = small_config()
  num_shards = sum(map(len, shards))
  per_process = [list(pipeline.translation_eval_batches(
      config, tok, tok, 'dev', batch_size=batch_size, process_index=p,
      share=RowShare(s, num_shards))) for p, s in enumerate(shards)]
  assert len({len(batches) for batches in per_process}) == 1
  sources = [english for english, _ in builtin.generate(NUM_DEV, 0, 'dev')]
  seen = []
  for step_batches in zip(*per_process):
    assert len({tuple(b[k].shape for k in KEYS) for b in step_batches}) == 1
    for batch in step_batches:
      for row, index in enumerate(batch['example_index']):
        if index < 0:
          assert not batch['inputs_segment_ids'][row].any()
        else:
          assert tok.decode(batch['inputs'][row]) == sources[index]
          seen.append(index)
  assert sorted(seen) == list(range(NUM_DEV))


def test_eval_truncates_long_examples_and_keeps_eos(tok):
  config = small_config(max_source_length=6, max_target_length=5)
  batch = next(pipeline.translation_eval_batches(config, tok, tok, 'dev'))
  assert batch['inputs'].shape == (8, 6) and batch['targets'].shape == (8, 5)
  assert (batch['inputs'][:, -1] == EOS_ID).all() and (batch['targets'][:, -1] == EOS_ID).all()
  np.testing.assert_array_equal(batch['inputs_positions'][0], np.arange(6))


def test_shuffle_buffer_zero_keeps_the_file_order(tok):
  batch = take(small_config(shuffle_buffer=0), tok, 1)[0]
  first = segments(batch['inputs'][0], batch['inputs_segment_ids'][0])[1]
  assert tok.decode(first) == builtin.generate(1, 0, 'train')[0][0]


def test_a_dataset_smaller_than_a_batch_pads_each_epoch(tok):
  config = small_config()
  config.builtin.num_train = 3
  for batch in take(config, tok, 4):
    assert batch['inputs'].shape == (8, 64)
    assert np.count_nonzero(batch['inputs'][:, 0] == 0) >= 6  # At most 2 rows used.
    assert sum(len(segments(tokens, ids)) for tokens, ids in
               zip(batch['inputs'], batch['inputs_segment_ids'])) == 3
