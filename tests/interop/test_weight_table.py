"""One weight-table type for every interop family, read and written by one
walk (`interop/weight_table.py`)."""
import numpy as np
import pytest

from jaxformer.interop import bert, llama, m2m100, marian, weight_table
from jaxformer.model.config import ModelConfig
from jaxformer.storage.errors import InteropError, JaxformerError


class TableError(InteropError):
  pass


def tiny(**options) -> ModelConfig:
  return ModelConfig(vocab_size=20, d_model=8, num_heads=2, d_ff=16,
                     num_encoder_layers=1, num_decoder_layers=1, max_len=10,
                     **options)


@pytest.mark.parametrize('table', [
    lambda: llama.weight_table(tiny(share_embeddings='none')),
    lambda: bert.weight_table(tiny(), 'bert', 'classification', True),
    lambda: marian.weight_table(tiny(share_embeddings='target')),
    lambda: m2m100.weight_table(tiny()),
], ids=['llama', 'bert', 'marian', 'm2m100'])
def test_every_family_builds_one_kind_of_row(table):
  rows = table()
  assert rows and all(type(row) is weight_table.Tensor for row in rows)
  for row in rows:
    assert np.prod(row.shape) == np.prod(row.our_shape), row
  names = [name for row in rows for name in row.names]
  assert len(names) == len(set(names))


def random_params(table, seed=0) -> dict:
  rng, params = np.random.default_rng(seed), {}
  for row in table:
    if row.path is not None:
      weight_table.place(params, row.path,
                         rng.standard_normal(row.our_shape).astype(np.float32))
  return params


def test_writing_then_reading_a_table_gives_the_parameters_back():
  table = marian.weight_table(tiny(share_embeddings='all'))
  params = random_params(table)
  state = weight_table.write(params, table)
  # Tied names hold one tensor; a dropped row (the key bias) is zeros.
  assert state['lm_head.weight'] is state['model.shared.weight']
  key_bias = 'model.encoder.layers.0.self_attn.k_proj.bias'
  assert not state[key_bias].any() and state[key_bias].shape == (8,)
  back = weight_table.load(state, table, TableError, 'a test model')
  flat = lambda tree: {k: v for k, v in _leaves(tree)}
  assert flat(back).keys() == flat(params).keys()
  for path, value in _leaves(params):
    np.testing.assert_array_equal(flat(back)[path], value)


def _leaves(tree, prefix=()):
  for key, value in tree.items():
    if isinstance(value, dict):
      yield from _leaves(value, (*prefix, key))
    else:
      yield (*prefix, key), value


def test_a_bias_the_model_lacks_is_written_as_zeros():
  table = [weight_table.tensor('w', ('layer', 'kernel'), (2, 3)),
           weight_table.tensor('b', ('layer', 'bias'), (2,))]
  state = weight_table.write({'layer': {'kernel': np.ones((2, 3))}}, table)
  np.testing.assert_array_equal(state['b'], np.zeros(2, np.float32))
  with pytest.raises(KeyError):  # A kernel is never made up.
    weight_table.write({'layer': {}}, table)


@pytest.mark.parametrize('weights, words', [
    ({'a': np.ones(2)}, 'the weights have no b; are they a test model?'),
    ({'a': np.ones(2), 'b': np.ones(4)}, 'b has shape (4,), config.json '
     'says (3,)'),
    ({'a': np.ones(2), 'b': np.ones(3), 'c': np.ones(3)},
     'c differs from b, which config.json ties it to'),
    ({'a': np.ones(2), 'b': np.ones(3), 'd': np.ones(1)},
     "unexpected tensors ['d']: not a test model that jaxformer can express"),
])
def test_a_table_check_names_the_tensor_in_the_familys_error(weights, words):
  if 'c' in weights:
    weights['c'] = np.zeros(3)
  table = [weight_table.tensor('a', ('a',), (2,)),
           weight_table.tensor(('b', 'c'), ('b',), (3,))]
  with pytest.raises(TableError) as error:
    weight_table.check(weights, table, TableError, 'a test model')
  assert str(error.value) == words
  assert isinstance(error.value, JaxformerError)


def test_expected_tensors_are_left_over_and_tied_names_read_the_first():
  table = [weight_table.tensor(('b', 'c'), ('b',), (3,))]
  weights = {'c': np.arange(3.0), 'buffer': np.ones(1)}
  read = weight_table.check(weights, table, TableError, 'x',
                            lambda name: name == 'buffer')
  assert read == {'b': 'c'}
  params = weight_table.read(weights, table, read)
  np.testing.assert_array_equal(params['b'], np.arange(3.0))
