"""Fixtures of the tests of data/ (the corpus is in tsv_corpus.py)."""
import pytest

from jaxformer.data import token_cache
from jaxformer.data import tokenizer as tokenizer_lib
from tsv_corpus import PAIRS, tsv_config


@pytest.fixture(scope='session')
def tok(tmp_path_factory):
  """A joint tokenizer of tsv_corpus.PAIRS, trained once."""
  prefix = str(tmp_path_factory.mktemp('tokenizer') / 'joint')
  return tokenizer_lib.train_tokenizer(
      [text for pair in PAIRS for text in pair], prefix,
      tsv_config('').tokenizer)


@pytest.fixture(autouse=True)
def no_open_splits():
  """Each test starts without splits this process already opened."""
  token_cache._open_splits.clear()
  yield
  token_cache._open_splits.clear()
