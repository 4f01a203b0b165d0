"""Batch counts of 'pack' epochs, kept beside the token cache so that a
resume plans only its own epoch (data/epoch_counts.py), and never changing
which batches a step gets."""
import glob
import itertools
import json
import os

import numpy as np
import pytest

from jaxformer.data import epoch_counts
from jaxformer.data import epochs
from jaxformer.data import packing
from jaxformer.data import pipeline
from jaxformer.parallel.row_share import RowShare

import tsv_corpus
from tsv_corpus import write_tsv

STEP, EPOCH = 40, 2  # 15 batches an epoch (about 2 examples a row)


def tsv_config(path, **overrides):
  return tsv_corpus.tsv_config(
      path, **{**dict(batch_size=8, shuffle_buffer=10), **overrides})


@pytest.fixture
def config(tmp_path):
  return tsv_config(write_tsv(tmp_path / 'train.tsv'))


def take(config, tok, start_step, count=2, **kwargs):
  return list(itertools.islice(pipeline.translation_train_batches(
      config, tok, tok, start_step=start_step, **kwargs), count))


def assert_equal_batches(actual, expected):
  assert len(actual) == len(expected)
  for got, want in zip(actual, expected):
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def count_files(cache):
  return sorted(glob.glob(f'{cache}/train-*/epochs-*.json'))


def no_planning(monkeypatch):
  def planned_counts(*args):
    pytest.fail('planned an epoch whose count is stored')
    yield

  monkeypatch.setattr(epochs, 'planned_counts', planned_counts)


@pytest.mark.slow
def test_training_stores_the_counts_and_a_resume_plans_no_earlier_epoch(
    config, tok, tmp_path, monkeypatch):
  cache = str(tmp_path / 'cache')
  uninterrupted = take(config, tok, 0, STEP + 2, token_cache=cache)
  (path,) = count_files(cache)
  counts = json.load(open(path))['counts']
  assert sum(counts[:EPOCH]) <= STEP < sum(counts[:EPOCH + 1])
  no_planning(monkeypatch)
  resumed = take(config, tok, STEP, token_cache=cache)
  assert_equal_batches(resumed, uninterrupted[STEP:])
  monkeypatch.undo()
  assert_equal_batches(take(config, tok, STEP), uninterrupted[STEP:])  # No cache.


@pytest.mark.slow
def test_a_first_resume_stores_the_counts_it_planned(config, tok, tmp_path,
                                                     monkeypatch):
  cache = str(tmp_path / 'cache')
  want = take(config, tok, STEP)
  assert_equal_batches(take(config, tok, STEP, token_cache=cache), want)
  (path,) = count_files(cache)
  # The epochs up to the step, and any that prefetching has planned since.
  assert len(json.load(open(path))['counts']) >= EPOCH + 1
  no_planning(monkeypatch)
  assert_equal_batches(take(config, tok, STEP, token_cache=cache), want)


@pytest.mark.slow
def test_corrupt_altered_or_foreign_counts_are_never_used(config, tok, tmp_path):
  cache = str(tmp_path / 'cache')
  want = take(config, tok, STEP)
  take(config, tok, STEP, token_cache=cache)
  (path,) = count_files(cache)
  valid = open(path).read()
  for damage in ('{"counts": [1, 2', valid.replace('"counts": [',
                                                  '"counts": [1, ')):
    with open(path, 'w') as f:
      f.write(damage)
    assert_equal_batches(take(config, tok, STEP, token_cache=cache), want)
    stored = json.load(open(path))  # Process 0 wrote them again.
    assert stored['counts'][:EPOCH + 1] == json.loads(valid)['counts'][:EPOCH + 1]
  # Another seed has its own file, and does not take this one's.
  other_config = tsv_config(config.tsv.train, seed=1)
  other_settings = epoch_counts.settings_of(
      other_config, *lengths(other_config, tok, cache), _planner())
  other_path = path.replace(path.split('/')[-1],
                            epoch_counts.file_name(other_settings))
  with open(other_path, 'w') as f:
    f.write(valid)
  assert_equal_batches(take(other_config, tok, STEP, token_cache=cache),
                       take(other_config, tok, STEP))
  assert json.load(open(other_path))['settings'] == other_settings
  # So has every other batching.
  names = {epoch_counts.file_name(epoch_counts.settings_of(
      tsv_config('', **change), *lengths(config, tok, cache), _planner()))
      for change in ({}, dict(batch_size=4), dict(max_target_length=39),
                     dict(shuffle_buffer=0))}
  assert len(names) == 4


def lengths(config, tok, cache):
  examples = pipeline.training_examples(config, tok, tok, cache)
  return examples.source_lengths, examples.target_lengths


def _planner():
  return packing.PLANNER


def test_a_count_that_disagrees_with_its_plan_stops_the_stream(config, tok,
                                                               tmp_path):
  cache = str(tmp_path / 'cache')
  take(config, tok, STEP, token_cache=cache)
  (path,) = count_files(cache)
  stored = json.load(open(path))
  counts = stored['counts']
  counts[EPOCH] -= 1  # The epoch of STEP, checksummed as if it were true.
  stored['sha256'] = epoch_counts._checksum(stored['settings'], counts)
  with open(path, 'w') as f:
    json.dump(stored, f)
  with pytest.raises(Exception, match='delete the file'):
    take(config, tok, STEP, token_cache=cache)


@pytest.mark.slow
def test_other_processes_read_the_counts_or_plan_without_waiting(
    config, tok, tmp_path, monkeypatch):
  cache = str(tmp_path / 'cache')
  share = dict(process_index=1, share=RowShare.of_process(1, 2))
  want = take(config, tok, STEP, **share)
  take(config, tok, 0, 1, token_cache=cache)  # Process 0 writes the cache.
  for path in count_files(cache):
    os.remove(path)
  assert_equal_batches(take(config, tok, STEP, token_cache=cache, **share), want)
  assert not count_files(cache)  # Only process 0 writes.
  take(config, tok, STEP, token_cache=cache)
  no_planning(monkeypatch)
  assert_equal_batches(take(config, tok, STEP, token_cache=cache, **share), want)
