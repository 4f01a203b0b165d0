"""The token cache: written once, committed by its manifest, keyed by the data
and the tokenizer, read back row by row (data/token_cache.py)."""
import gc
import itertools
import os
import re
import weakref

import numpy as np
import pytest

from jaxformer.data import input_errors
from jaxformer.data import pipeline
from jaxformer.data import sources
from jaxformer.data import token_cache
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.defaults import default_data_config

import tsv_corpus
from tsv_corpus import PAIRS, write_tsv


def tsv_config(path, **overrides):
  return tsv_corpus.tsv_config(path, **{
      **dict(batch_size=4, shuffle_buffer=1, tokens_per_batch=256),
      **overrides})


def folders(directory):
  return sorted(os.listdir(directory))


def gathered(examples, rows):
  return [array.tolist() for array in examples.gather(np.asarray(rows))]


def test_written_once_then_read_without_the_data(tmp_path, tok, monkeypatch):
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS))
  cache = str(tmp_path / 'cache')
  first = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  (folder,) = folders(cache)
  assert folder.startswith('train-')
  assert token_cache.MANIFEST in os.listdir(os.path.join(cache, folder))
  token_cache._open_splits.clear()
  monkeypatch.setattr(sources, 'iter_split', lambda *a: pytest.fail('read again'))
  again = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  assert isinstance(again.source.shards[0], np.memmap)
  rows = [3, 0, 119, 3]
  assert gathered(again, rows) == gathered(first, rows)
  source, source_splits, target, _ = again.gather(np.array([7]))
  assert source[-1] == target[-1] == tokenizer_lib.EOS_ID
  assert tok.decode(source) == PAIRS[7][0]


def test_shards_are_read_across_their_boundaries(tmp_path, tok, monkeypatch):
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS))
  in_memory = token_cache.tokenized_split(config, 'train', tok, tok)
  monkeypatch.setattr(token_cache, 'SHARD_EXAMPLES', 7)
  monkeypatch.setattr(token_cache, 'ENCODE_CHUNK', 3)
  token_cache._open_splits.clear()
  cache = str(tmp_path / 'cache')
  sharded = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  assert len(sharded.source.shards) == 18  # ceil(120 / 7)
  rows = [6, 7, 13, 14, 119, 0, 50]
  assert gathered(sharded, rows) == gathered(in_memory, rows)
  truncated = sharded.gather(np.array(rows), 4, 3)
  assert truncated[1].tolist() == [0, 4, 8, 12, 16, 20, 24, 28]
  assert (truncated[0][3::4] == tokenizer_lib.EOS_ID).all()


def test_changed_data_or_tokenizer_is_never_read_stale(tmp_path, tok):
  path = write_tsv(tmp_path / 'train.tsv', PAIRS)
  config = tsv_config(path)
  cache = str(tmp_path / 'cache')
  token_cache.tokenized_split(config, 'train', tok, tok, cache)
  changed = [(target, source) for source, target in PAIRS[:50]]
  write_tsv(path, changed)
  token_cache._open_splits.clear()
  examples = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  assert examples.num_examples == 50
  assert tok.decode(examples.gather(np.array([2]))[0]) == PAIRS[2][1]
  other_tok = tokenizer_lib.train_tokenizer(
      [text for pair in PAIRS for text in pair], str(tmp_path / 'other'),
      _with_vocab(config.tokenizer, 140))
  token_cache.tokenized_split(config, 'train', other_tok, other_tok, cache)
  assert len(folders(cache)) == 3


def _with_vocab(tok_config, vocab_size):
  tok_config = tok_config.copy_and_resolve_references()
  tok_config.vocab_size = vocab_size
  return tok_config


def test_a_killed_write_leaves_no_cache_that_looks_complete(tmp_path, tok,
                                                           monkeypatch):
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS))
  cache = str(tmp_path / 'cache')
  monkeypatch.setattr(token_cache, 'SHARD_EXAMPLES', 50)
  real_iter_split = sources.iter_split

  def killed_after_60_pairs(*args):
    yield from itertools.islice(real_iter_split(*args), 60)
    raise KeyboardInterrupt  # As a signal ending the run mid-write.

  monkeypatch.setattr(sources, 'iter_split', killed_after_60_pairs)
  with pytest.raises(KeyboardInterrupt):
    token_cache.tokenized_split(config, 'train', tok, tok, cache)
  (folder,) = folders(cache)
  written = os.listdir(os.path.join(cache, folder))
  assert '00000.source.npy' in written and token_cache.MANIFEST not in written
  monkeypatch.setattr(sources, 'iter_split', real_iter_split)
  examples = token_cache.tokenized_split(config, 'train', tok, tok, cache)
  assert examples.num_examples == len(PAIRS)
  assert tok.decode(examples.gather(np.array([119]))[0]) == PAIRS[119][0]


def test_other_processes_wait_for_process_0(tmp_path, tok):
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS))
  config.tokenizer.wait_seconds = 0.0
  cache = str(tmp_path / 'cache')
  with pytest.raises(TimeoutError, match='process 0 to write the token cache'):
    token_cache.tokenized_split(config, 'train', tok, tok, cache,
                                process_index=1)
  token_cache.tokenized_split(config, 'train', tok, tok, cache)
  token_cache._open_splits.clear()
  assert token_cache.tokenized_split(
      config, 'train', tok, tok, cache, process_index=1).num_examples == 120


def test_every_host_reads_the_folder_of_process_0s_key(tmp_path, tok):
  """A `SharedCache` takes the key that process 0 computed (sent through the
  runtime's key-value store in a run, a dict here): a host whose copy of
  the data has another path, or that has none, reads process 0's folder
  instead of waiting for one that never comes."""
  config = tsv_config(write_tsv(tmp_path / 'host0.tsv', PAIRS))
  cache = str(tmp_path / 'cache')
  sent = {}

  def as_process_0(name, compute, pattern):
    sent[name] = compute()
    assert re.fullmatch(pattern, sent[name])
    return sent[name]

  token_cache.tokenized_split(config, 'train', tok, tok,
                              token_cache.SharedCache(cache, as_process_0))
  token_cache._open_splits.clear()
  elsewhere = tsv_config(str(tmp_path / 'host1.tsv'))  # Not on this host.
  with pytest.raises(input_errors.MissingFileError):
    token_cache.cache_key(elsewhere, 'train', tok, tok)
  examples = token_cache.tokenized_split(
      elsewhere, 'train', tok, tok,
      token_cache.SharedCache(cache, lambda name, compute, pattern: sent[name]),
      process_index=1)
  assert examples.num_examples == 120
  assert folders(cache) == [f'train-{sent["token_cache/train"][:24]}']


@pytest.mark.slow
@pytest.mark.parametrize('batching', ['pack', 'bucket'])
def test_batches_from_the_cache_equal_those_from_memory(tmp_path, tok, batching):
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS),
                      batching=batching, shuffle_buffer=10)
  cache = str(tmp_path / 'cache')

  def take(**kwargs):
    return list(itertools.islice(pipeline.translation_train_batches(
        config, tok, tok, start_step=20, **kwargs), 3))

  for got, want in zip(take(token_cache=cache), take()):
    assert got.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  got = next(pipeline.translation_eval_batches(config, tok, tok, 'train',
                                               token_cache=cache))
  want = next(pipeline.translation_eval_batches(config, tok, tok, 'train'))
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_the_cache_directory_follows_the_config(tmp_path):
  config = default_data_config()
  assert token_cache.directory(config, 'gs://b/run') == (
      'gs://b/run/tokenizer/token_cache')
  assert token_cache.directory(config, None) is None
  config.token_cache_dir = 'gs://b/shared'
  assert token_cache.directory(config, str(tmp_path)) == 'gs://b/shared'
  config.token_cache = False
  assert token_cache.directory(config, str(tmp_path)) is None


@pytest.mark.slow
def test_a_long_lived_process_keeps_only_the_last_few_splits_open(tmp_path, tok):
  """Splits leave the process-wide cache in LRU order, and close once no
  stream reads them (TensorFlow keeps every numpy_function's Python
  function as long as the process: it must not hold the split)."""
  config = tsv_config(write_tsv(tmp_path / 'train.tsv', PAIRS[:20]))
  caches = [str(tmp_path / f'cache{i}') for i in range(token_cache._IN_MEMORY + 1)]
  first = weakref.ref(token_cache.tokenized_split(
      config, 'train', tok, tok, caches[0]).source.shards[0])
  stream = pipeline.translation_train_batches(config, tok, tok,
                                              token_cache=caches[0])
  want = list(itertools.islice(pipeline.translation_train_batches(
      config, tok, tok), 2))
  for cache in caches[1:]:
    next(pipeline.translation_eval_batches(config, tok, tok, 'train',
                                           token_cache=cache))
  assert [cache for _, cache in token_cache._open_splits] == caches[1:]
  gc.collect()
  for got in (next(stream), next(stream)):  # It holds its split.
    np.testing.assert_array_equal(got['inputs'], want.pop(0)['inputs'])
  del stream
  gc.collect()
  assert first() is None  # Its memory map is closed.
