"""Rotary positions: the frequencies (plain, linear and Llama 3 scaling),
the rotation itself, and what it is for: attention scores that depend only
on the distance between positions."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model import ModelConfig, rotary
from jaxformer.model.attention import MultiHeadAttention
from jaxformer.model.masks import attention_mask

ROPE = ModelConfig(vocab_size=50, d_model=32, num_heads=4, num_kv_heads=2,
                   d_ff=64, position_embedding='rope')
LLAMA3 = dict(rope_scaling='llama3', rope_scaling_factor=8.0,
              rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_len=8192)


def test_frequencies_are_one_over_theta_to_the_even_features():
  inv_freq = rotary.default_frequencies(16, 10000.0)
  want = 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16)
  assert inv_freq.dtype == np.float32 and inv_freq.shape == (8,)
  np.testing.assert_allclose(inv_freq, want, rtol=1e-7)


def meta_llama3_scaling(freqs, factor, low, high, old_len):
  """Meta's `apply_scaling` of Llama 3.1, element by element in float64."""
  out = []
  for freq in freqs:
    wavelen = 2 * math.pi / freq
    if wavelen < old_len / high:
      out.append(freq)
    elif wavelen > old_len / low:
      out.append(freq / factor)
    else:
      smooth = (old_len / wavelen - low) / (high - low)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def test_llama3_scaling_keeps_high_stretches_low_and_blends_the_middle():
  config = ModelConfig(d_model=256, num_heads=2, head_dim=128,
                       position_embedding='rope', rope_theta=500000.0,
                       **LLAMA3)
  plain = rotary.default_frequencies(128, 500000.0)
  scaled = rotary.inverse_frequencies(config)
  want = meta_llama3_scaling(plain.astype(np.float64), 8.0, 1.0, 4.0, 8192)
  np.testing.assert_allclose(scaled, want, rtol=1e-6)
  kept, stretched = scaled == plain, np.isclose(scaled, plain / 8, rtol=1e-6)
  assert kept.any() and stretched.any() and (~kept & ~stretched).any()


def test_linear_scaling_divides_the_frequencies():
  config = ROPE.replace(rope_scaling='linear', rope_scaling_factor=4.0)
  np.testing.assert_array_equal(rotary.inverse_frequencies(config),
                                rotary.default_frequencies(8, 10000.0) / 4)


@pytest.mark.parametrize('scaling', ['linear', 'llama3'])
def test_scaled_frequencies_equal_hugging_face_bit_for_bit(scaling):
  """transformers' Llama rotary embedding: its own float32 pow is within an
  ulp of the correctly rounded one we take (it varies with the CPU's vector
  unit); the scalings of equal frequencies are equal bit for bit."""
  transformers = pytest.importorskip('transformers')
  from transformers.models.llama import modeling_llama

  def their_frequencies(**options):
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=96,
        max_position_embeddings=131072,
        rope_parameters=dict(rope_theta=500000.0, **options))
    return modeling_llama.LlamaRotaryEmbedding(config).inv_freq.numpy()

  options = dict(rope_type=scaling, factor=8.0)
  if scaling == 'llama3':
    options.update(low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
  theirs = their_frequencies(**options)
  plain = their_frequencies(rope_type='default')
  np.testing.assert_allclose(rotary.default_frequencies(96, 500000.0), plain,
                             rtol=1.2e-7)
  if scaling == 'llama3':
    ours = rotary.llama3_frequencies(plain, 8.0, 1.0, 4.0, 8192)
  else:
    ours = plain / np.float32(8.0)
  np.testing.assert_array_equal(ours, theirs)


@pytest.mark.slow
def test_rotate_turns_each_feature_pair_by_position_times_frequency():
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 3, 8))
  positions = jnp.array([[0, 1, 2, 3, 4], [7, 0, 9, 3, 11]])
  inv_freq = rotary.default_frequencies(8, 10000.0)
  got = rotary.rotate(x, positions, inv_freq)
  # Pair i is (x[i], x[i + 4]), a complex number x[i] + j x[i + 4].
  x64 = np.asarray(x, np.float64)
  pairs = x64[..., :4] + 1j * x64[..., 4:]
  angle = np.asarray(positions)[:, :, None, None] * inv_freq.astype(
      np.float64)
  turned = pairs * np.exp(1j * angle)
  np.testing.assert_allclose(got, np.concatenate(
      [turned.real, turned.imag], axis=-1), atol=2e-6)


def scores(q, k, positions, inv_freq):
  return jnp.einsum('bqnh,bknh->bnqk', rotary.rotate(q, positions, inv_freq),
                    rotary.rotate(k, positions, inv_freq))


def test_scores_depend_only_on_the_distance_between_positions():
  q, k = jax.random.normal(jax.random.PRNGKey(1), (2, 2, 6, 2, 16))
  positions = jnp.array([[0, 1, 2, 3, 4, 5], [3, 4, 5, 0, 1, 2]])
  inv_freq = rotary.default_frequencies(16, 10000.0)
  base = scores(q, k, positions, inv_freq)
  shifted = scores(q, k, positions + 13, inv_freq)
  np.testing.assert_allclose(shifted, base, atol=1e-4)
  # Not because positions do nothing: the queries themselves moved.
  assert not np.allclose(rotary.rotate(q, positions + 13, inv_freq),
                         rotary.rotate(q, positions, inv_freq), atol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['self', 'causal'])
def test_rotary_attention_is_the_same_at_shifted_positions(kind):
  config = ROPE.replace(qkv_bias=True, **LLAMA3)  # The key bias rotates too.
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 6, 32))
  ids = jnp.ones((2, 6), jnp.int32)
  mask = attention_mask(ids, ids, causal=kind == 'causal')
  positions = jnp.broadcast_to(jnp.arange(6), (2, 6))
  attend = MultiHeadAttention(config, kind)
  params = attend.init(jax.random.PRNGKey(3), x, x, mask, positions)
  assert 'bias' in params['params']['key']
  run = jax.jit(lambda positions: attend.apply(params, x, x, mask, positions))
  base = run(positions)
  np.testing.assert_allclose(run(positions + 29), base, atol=1e-5)
  reordered = positions.at[:, 0].set(5).at[:, 5].set(0)
  assert not np.allclose(run(reordered), base, atol=1e-3)


def test_rotary_attention_needs_positions():
  x = jnp.ones((1, 3, 32))
  mask = jnp.ones((1, 1, 3, 3), bool)
  with pytest.raises(ValueError, match='positions'):
    MultiHeadAttention(ROPE).init(jax.random.PRNGKey(0), x, x, mask)
