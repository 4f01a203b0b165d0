"""Attention masks, the einsum and fused attention paths, attention dropout."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model import ModelConfig
from jaxformer.model.attention import MultiHeadAttention
from jaxformer.model.dot_product import (einsum_attention, fused_attention,
                                         heads_first, prefix_attention,
                                         shared_key_attention,
                                         transposed_keys)
from jaxformer.model.masks import attention_mask

CONFIG = ModelConfig(vocab_size=50, d_model=32, num_heads=4, d_ff=64,
                     attention_dropout=0.0)


def random_qkv(t=5, s=6, seed=0):
  q, k, v = jax.random.normal(jax.random.PRNGKey(seed), (3, 2, max(t, s), 4, 8))
  return q[:, :t], k[:, :s], v[:, :s]


def reference_attention(q, k, v, mask):
  """softmax(q k^T / sqrt(h)) v per head, in numpy, masked keys excluded."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -1e30)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return np.einsum('bnts,bsnh->btnh', weights, v)


def test_padding_mask_hides_padding_keys():
  segments = jnp.array([[1, 1, 1, 0]])
  mask = attention_mask(segments, segments, causal=False)
  assert mask.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(mask[0, 0], [[1, 1, 1, 0]] * 3 + [[0, 0, 0, 0]])


def test_causal_mask_hides_later_keys():
  segments = jnp.array([[1, 1, 1]])
  mask = attention_mask(segments, segments, causal=True)
  np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0], [1, 1, 0], [1, 1, 1]])


def test_packed_segments_only_see_their_own_segment():
  segments = jnp.array([[1, 1, 2, 2, 0]])
  mask = attention_mask(segments, segments, causal=True)
  np.testing.assert_array_equal(mask[0, 0], [[1, 0, 0, 0, 0],
                                             [1, 1, 0, 0, 0],
                                             [0, 0, 1, 0, 0],
                                             [0, 0, 1, 1, 0],
                                             [0, 0, 0, 0, 0]])


def test_cross_attention_mask_pairs_query_and_key_segments():
  mask = attention_mask(jnp.array([[1, 2, 0]]), jnp.array([[1, 1, 2, 0]]),
                        causal=False)
  np.testing.assert_array_equal(mask[0, 0], [[1, 1, 0, 0],
                                             [0, 0, 1, 0],
                                             [0, 0, 0, 0]])


@pytest.mark.slow
@pytest.mark.parametrize('causal', [False, True])
def test_einsum_attention_is_scaled_dot_product_attention(causal):
  q, k, v = random_qkv(t=6, s=6)
  segments = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
  mask = attention_mask(segments, segments, causal=causal)
  out, weights = einsum_attention(q, k, v, mask)
  want = reference_attention(q, k, v, mask)
  real = np.asarray(segments, bool)
  np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_fully_masked_padding_query_gives_finite_output():
  q, k, v = random_qkv(t=6, s=6)
  segments = jnp.array([[1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 0, 0]])
  mask = attention_mask(segments, segments, causal=False)
  assert np.isfinite(einsum_attention(q, k, v, mask)[0]).all()
  assert np.isfinite(fused_attention(q, k, v, mask)).all()


def test_shared_key_attention_gives_each_beam_its_sentences_keys():
  # 2 sentences x 3 beams: rows 0-2 attend to sentence 0's keys, 3-5 to 1's.
  q, k, v = random_qkv(t=1, s=6)
  query = jnp.repeat(q, 3, axis=0) * jnp.arange(1.0, 7.0)[:, None, None, None]
  mask = jnp.ones((6, 1, 1, 6), bool).at[1, ..., 4:].set(False)
  out, weights = shared_key_attention(query, transposed_keys(k), heads_first(v),
                                      mask)
  assert out.shape == (6, 1, 4, 8) and weights.shape == (6, 4, 1, 6)
  for row in range(6):
    one = slice(row // 3, row // 3 + 1)  # the row's sentence
    expected = reference_attention(query[row:row + 1], k[one], v[one],
                                   mask[row])
    np.testing.assert_allclose(out[row], expected[0], atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize('buckets', [4, None])  # None: 10 slots, one bucket.
@pytest.mark.parametrize('filled', [1, 3, 4, 7, 10])
def test_prefix_attention_equals_attention_over_the_whole_cache(filled,
                                                                 buckets):
  q, k, v = random_qkv(t=1, s=10)
  query = jnp.repeat(q, 2, axis=0)
  mask = jnp.broadcast_to(jnp.arange(10) < filled, (4, 1, 1, 10))
  key_t, value = transposed_keys(k), heads_first(v)
  expected = shared_key_attention(query, key_t, value, mask)
  got = jax.jit(prefix_attention, static_argnames='buckets')(
      query, key_t, value, mask, filled, buckets=buckets)
  np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
  np.testing.assert_allclose(got[1], expected[1], atol=1e-6)


@pytest.mark.parametrize('causal', [False, True])
def test_fused_attention_equals_einsum_attention(causal):
  q, k, v = random_qkv(t=6, s=6)
  segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  mask = attention_mask(segments, segments, causal=causal)
  real = np.asarray(segments, bool)
  einsum_out, _ = einsum_attention(q, k, v, mask)
  fused_out = fused_attention(q, k, v, mask)
  np.testing.assert_allclose(np.asarray(fused_out)[real],
                             np.asarray(einsum_out)[real], atol=1e-5)


def test_fused_cross_attention_equals_einsum_with_source_padding():
  q, k, v = random_qkv(t=4, s=6)
  mask = attention_mask(jnp.ones((2, 4), jnp.int32),
                        jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]),
                        causal=False)
  np.testing.assert_allclose(fused_attention(q, k, v, mask),
                             einsum_attention(q, k, v, mask)[0], atol=1e-5)


@pytest.mark.slow
def test_multi_head_attention_maps_d_model_to_d_model():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 32))
  everywhere = jnp.ones((2, 5), jnp.int32)
  mask = attention_mask(everywhere, everywhere, causal=False)
  out, variables = MultiHeadAttention(CONFIG).init_with_output(
      jax.random.PRNGKey(1), x, x, mask)
  assert out.shape == (2, 5, 32)
  # Kernels are output-major: [outputs..., inputs...].
  assert variables['params']['query']['kernel'].unbox().shape == (4, 8, 32)
  assert variables['params']['out']['kernel'].unbox().shape == (32, 4, 8)


def test_attention_dropout_is_active_only_when_not_deterministic():
  config = CONFIG.replace(attention_dropout=0.5)
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 32))
  everywhere = jnp.ones((2, 5), jnp.int32)
  mask = attention_mask(everywhere, everywhere, causal=False)
  variables = MultiHeadAttention(config).init(jax.random.PRNGKey(1), x, x, mask)
  without_dropout = MultiHeadAttention(CONFIG).apply(variables, x, x, mask)

  deterministic = MultiHeadAttention(config, deterministic=True).apply(
      variables, x, x, mask)
  np.testing.assert_allclose(deterministic, without_dropout, rtol=1e-6)

  training = MultiHeadAttention(config, deterministic=False)
  dropped, state = training.apply(variables, x, x, mask,
                                  rngs={'dropout': jax.random.PRNGKey(2)},
                                  mutable=['intermediates'])
  other = training.apply(variables, x, x, mask,
                         rngs={'dropout': jax.random.PRNGKey(3)})
  assert not np.allclose(dropped, without_dropout, atol=1e-3)
  assert not np.allclose(dropped, other, atol=1e-3)
  weights = state['intermediates']['attention_weights'][0]
  zeros = float((weights == 0).mean())
  assert 0.3 < zeros < 0.7  # About half of the weights dropped.


# Grouped-query attention: 4 query heads over 2 (or 1) key/value heads.


def grouped_qkv(kv_heads, t=5, s=6):
  q, k, v = random_qkv(t, s)
  return q, k[:, :, :kv_heads], v[:, :, :kv_heads]


def repeated(x, heads=4):
  """Key/value heads copied to their query heads ([b, s, k, h] -> n)."""
  return jnp.repeat(x, heads // x.shape[2], axis=2)


@pytest.mark.parametrize('kv_heads', [1, 2])
def test_grouped_einsum_attention_is_attention_to_repeated_heads(kv_heads):
  q, k, v = grouped_qkv(kv_heads, t=6)
  segments = jnp.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
  mask = attention_mask(segments, segments, causal=True)
  out, weights = einsum_attention(q, k, v, mask)
  assert out.shape == (2, 6, 4, 8) and weights.shape == (2, 4, 6, 6)
  want = reference_attention(q, repeated(k), repeated(v), mask)
  real = np.asarray(segments, bool)
  np.testing.assert_allclose(np.asarray(out)[real], want[real], atol=1e-5)
  # A mask per head, too.
  per_head = jnp.broadcast_to(mask, (2, 4, 6, 6)).at[:, 1, :, 0].set(False)
  np.testing.assert_allclose(
      einsum_attention(q, k, v, per_head)[0],
      reference_attention(q, repeated(k), repeated(v), per_head), atol=1e-5)


@pytest.mark.parametrize('kv_heads', [1, 2])
def test_grouped_fused_attention_equals_einsum_attention(kv_heads):
  q, k, v = grouped_qkv(kv_heads, t=6)
  segments = jnp.array([[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
  mask = attention_mask(segments, segments, causal=True)
  real = np.asarray(segments, bool)
  np.testing.assert_allclose(
      np.asarray(fused_attention(q, k, v, mask))[real],
      np.asarray(einsum_attention(q, k, v, mask)[0])[real], atol=1e-5)


@pytest.mark.slow
def test_grouped_cache_attention_equals_attention_to_repeated_heads():
  """The decoding cache's paths: beams sharing a sentence's kv heads, and
  the cache read in prefixes."""
  q, k, v = grouped_qkv(2, t=1, s=10)
  query = jnp.repeat(q, 2, axis=0)  # 2 beams per sentence.
  mask = jnp.broadcast_to(jnp.arange(10) < 7, (4, 1, 1, 10))
  got = shared_key_attention(query, transposed_keys(k), heads_first(v), mask)
  want = shared_key_attention(query, transposed_keys(repeated(k)),
                              heads_first(repeated(v)), mask)
  np.testing.assert_allclose(got[0], want[0], atol=1e-6)
  np.testing.assert_allclose(got[1], want[1], atol=1e-6)
  prefix = prefix_attention(query, transposed_keys(k), heads_first(v), mask,
                            7, buckets=4)
  np.testing.assert_allclose(prefix[0], want[0], atol=1e-6)
