"""Building blocks: sinusoidal positions, embeddings, feed-forward network,
dropout."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jaxformer.model import ModelConfig
from jaxformer.model.backend import TRANSPOSED_MATMUL_MAX_ROWS
from jaxformer.model.layers import (AddPositions, Dropout, Embed, FeedForward,
                                    Linear, _random_halfwords, apply_linears,
                                    dropout, matmuls, sinusoidal_positions)

CONFIG = ModelConfig(vocab_size=50, d_model=32, num_heads=4, d_ff=64,
                     max_len=64)


def test_sinusoidal_positions_follow_the_paper_formula():
  table = sinusoidal_positions(50, 16)
  assert table.shape == (50, 16) and table.dtype == np.float32
  for pos in (0, 1, 7, 49):
    for i in range(8):
      angle = pos / 10000 ** (2 * i / 16)
      assert math.isclose(table[pos, 2 * i], math.sin(angle), abs_tol=1e-6)
      assert math.isclose(table[pos, 2 * i + 1], math.cos(angle), abs_tol=1e-6)


def test_sinusoidal_positions_with_odd_width():
  table = sinusoidal_positions(5, 7)
  assert table.shape == (5, 7)
  assert math.isclose(table[3, 6], math.sin(3 / 10000 ** (6 / 7)), abs_tol=1e-6)


def test_sinusoidal_positions_are_added_at_the_given_positions():
  x = jnp.zeros((1, 3, 32))
  positions = jnp.array([[0, 5, 2]])
  out, variables = AddPositions(CONFIG).init_with_output(
      jax.random.PRNGKey(0), x, positions)
  assert not variables  # Nothing to learn.
  np.testing.assert_allclose(out[0], sinusoidal_positions(64, 32)[[0, 5, 2]])


def test_learned_positions_are_a_parameter():
  config = CONFIG.replace(position_embedding='learned')
  x = jnp.zeros((1, 3, 32))
  positions = jnp.array([[0, 5, 2]])
  out, variables = AddPositions(config).init_with_output(
      jax.random.PRNGKey(0), x, positions)
  table = variables['params']['position_embedding'].unbox()
  assert table.shape == (64, 32)
  np.testing.assert_allclose(out[0], np.asarray(table)[[0, 5, 2]])


def test_embedding_is_scaled_by_sqrt_d_model_and_attend_uses_the_table():
  embed = Embed(50, CONFIG)
  ids = jnp.array([[3, 0, 49]])
  out, variables = embed.init_with_output(jax.random.PRNGKey(0), ids)
  table = variables['params']['embedding'].unbox()
  np.testing.assert_allclose(
      out[0], np.asarray(table)[[3, 0, 49]] * math.sqrt(32), rtol=1e-6)

  logits = embed.apply(variables, out, method='attend')
  assert logits.shape == (1, 3, 50) and logits.dtype == jnp.float32
  want = np.asarray(out[0]) @ np.asarray(table).T
  np.testing.assert_allclose(logits[0], want, rtol=1e-5, atol=1e-5)


def test_tensor2tensor_sinusoids_spread_periods_over_half_minus_one():
  table = sinusoidal_positions(9, 8, 'tensor2tensor')
  for pos in (0, 3, 8):
    for i in range(4):
      angle = pos / 10000 ** (i / 3)
      assert math.isclose(table[pos, i], math.sin(angle), abs_tol=1e-6)
      assert math.isclose(table[pos, 4 + i], math.cos(angle), abs_tol=1e-6)


@pytest.mark.parametrize('kind', ['sinusoidal', 'learned'])
def test_position_offset_shifts_the_lookup_and_grows_the_table(kind):
  config = CONFIG.replace(position_embedding=kind, position_offset=2)
  x = jnp.zeros((1, 3, 32))
  out, variables = AddPositions(config).init_with_output(
      jax.random.PRNGKey(0), x, jnp.array([[0, 5, 2]]))
  if kind == 'learned':
    table = np.asarray(variables['params']['position_embedding'].unbox())
  else:
    table = sinusoidal_positions(66, 32)
  assert table.shape == (66, 32)
  np.testing.assert_allclose(out[0], table[[2, 7, 4]])


@pytest.mark.slow
def test_matmuls_are_x_times_each_kernel_transposed():
  kernels = [jax.random.normal(jax.random.PRNGKey(0), (6, 5)),
             jax.random.normal(jax.random.PRNGKey(2), (3, 5))]
  # Both paths.
  for shape in [(3, 5), (2, 4, 5), (TRANSPOSED_MATMUL_MAX_ROWS + 1, 5)]:
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    products = jax.jit(matmuls)(x, kernels)
    for product, kernel in zip(products, kernels):
      np.testing.assert_allclose(product, np.asarray(x) @ np.asarray(kernel).T,
                                 rtol=1e-5, atol=1e-5)
    grad_x, grad_kernels = jax.grad(
        lambda x, ks: sum(p.sum() for p in matmuls(x, ks)),
        argnums=(0, 1))(x, kernels)
    np.testing.assert_allclose(
        grad_x, np.broadcast_to(sum(np.asarray(k).sum(0) for k in kernels),
                                shape), rtol=1e-5)
    for grad_kernel, kernel in zip(grad_kernels, kernels):
      np.testing.assert_allclose(
          grad_kernel,
          np.broadcast_to(np.asarray(x).reshape(-1, 5).sum(0), kernel.shape),
          rtol=1e-5, atol=1e-5)


def test_linears_applied_together_equal_each_applied_alone():
  class TwoLinears(nn.Module):
    together: bool

    @nn.compact
    def __call__(self, x):
      linears = [Linear((2, 3), ('heads', 'kv', 'embed'), CONFIG, name='a'),
                 Linear((4,), ('mlp', 'embed'), CONFIG, use_bias=False,
                        name='b')]
      if self.together:
        return apply_linears(x, linears)
      return [linear(x) for linear in linears]

  for rows in (3, TRANSPOSED_MATMUL_MAX_ROWS + 1):  # Both paths.
    x = jax.random.normal(jax.random.PRNGKey(0), (1, rows, 32))
    variables = TwoLinears(False).init(jax.random.PRNGKey(1), x)
    variables = jax.tree.map(lambda v: v + 0.1, variables)  # Non-zero bias.
    alone = TwoLinears(False).apply(variables, x)
    together = TwoLinears(True).apply(variables, x)
    assert [y.shape for y in together] == [(1, rows, 2, 3), (1, rows, 4)]
    for a, b in zip(alone, together):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_feed_forward_is_relu_between_two_affine_maps():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 32))
  ffn = FeedForward(CONFIG)
  out, variables = ffn.init_with_output(jax.random.PRNGKey(0), x)
  p = nn.unbox(variables['params'])
  hidden = np.maximum(np.asarray(x) @ p['wi']['kernel'].T + p['wi']['bias'],
                      0)
  want = hidden @ p['wo']['kernel'].T + p['wo']['bias']
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_gelu_feed_forward_differs_from_relu():
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 32))
  variables = FeedForward(CONFIG).init(jax.random.PRNGKey(0), x)
  relu = FeedForward(CONFIG).apply(variables, x)
  gelu = FeedForward(CONFIG.replace(activation='gelu')).apply(variables, x)
  assert not np.allclose(relu, gelu, atol=1e-3)


KEYS = {'threefry': jax.random.key(0), 'raw threefry': jax.random.PRNGKey(0),
        'rbg': jax.random.key(0, impl='rbg')}


@pytest.mark.parametrize('kind', sorted(KEYS))
def test_random_halfwords_are_uniform_and_independent(kind):
  words = np.asarray(_random_halfwords(KEYS[kind], (400, 1001)))
  assert words.shape == (400, 1001) and words.min() >= 0
  assert words.max() < 2 ** 16
  # 16 equal bins of 400,400 words: chi-square with 15 degrees of freedom,
  # 40 is beyond its 99.95th percentile.
  counts = np.bincount(words.ravel() >> 12, minlength=16)
  expected = words.size / 16
  assert ((counts - expected) ** 2 / expected).sum() < 40
  # Neighbours along either axis (within a word and across words) are
  # uncorrelated: |r| < 4 standard errors.
  for a, b in ((words[:, :-1], words[:, 1:]), (words[:-1], words[1:])):
    r = np.corrcoef(a.ravel(), b.ravel())[0, 1]
    assert abs(r) < 4 / math.sqrt(a.size)


@pytest.mark.parametrize('kind', sorted(KEYS))
@pytest.mark.parametrize('rate', [0.1, 0.3])
def test_dropout_drops_at_its_rate_and_keeps_the_mean(kind, rate):
  x = jnp.full((64, 50, 129), 2.0)
  y = np.asarray(dropout(x, rate, KEYS[kind]))
  dropped = (y == 0).mean()
  assert abs(dropped - rate) < 4 * math.sqrt(rate * (1 - rate) / y.size)
  kept = round(rate * 2 ** 16)
  np.testing.assert_allclose(y[y != 0], 2.0 * 2 ** 16 / (2 ** 16 - kept),
                             rtol=1e-6)
  assert abs(y.mean() - 2.0) < 0.01
  np.testing.assert_array_equal(y, dropout(x, rate, KEYS[kind]))
  other = jax.random.fold_in(jax.random.wrap_key_data(KEYS[kind])
                             if kind == 'raw threefry' else KEYS[kind], 1)
  assert (np.asarray(dropout(x, rate, other)) != y).mean() > rate


def test_dropout_edge_rates_shapes_and_dtypes():
  key = jax.random.key(3)
  x = jnp.arange(1.0, 8.0, dtype=jnp.bfloat16)
  np.testing.assert_array_equal(dropout(x, 0.0, key), x)
  np.testing.assert_array_equal(dropout(x, 1.0, key), jnp.zeros_like(x))
  assert dropout(x, 0.5, key).dtype == jnp.bfloat16
  assert dropout(jnp.ones(()), 0.5, key).shape == ()
  assert dropout(jnp.ones((3, 0)), 0.5, key).shape == (3, 0)
  layer = Dropout(0.5)
  np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
  trained = layer.apply({}, jnp.ones((1000,)), deterministic=False,
                        rngs={'dropout': key})
  assert 400 < int((trained == 0).sum()) < 600


@pytest.mark.slow
def test_dropout_masks_do_not_depend_on_sharding():
  mesh = jax.make_mesh((8,), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
      'data'))
  x = jnp.ones((16, 12, 36))
  drop = jax.jit(lambda x, key: dropout(x, 0.1, key))
  key = jax.random.key(5)
  sharded = drop(jax.device_put(x, sharding), key)
  np.testing.assert_array_equal(sharded, drop(x, key))
