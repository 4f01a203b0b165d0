"""Rotary position embeddings (RoPE, Su et al. 2021), as Hugging Face
transformers' Llama computes them: the feature pairs (i, i + h/2) of each
query and key head are rotated by angle position * inv_freq[i], so that
their dot products depend only on the distance between positions.

The frequencies and angles are float32 and computed in the order
transformers computes them (`modeling_rope_utils`), so that imported models
give its logits.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model.config import ModelConfig


def default_frequencies(head_dim: int, theta: float) -> np.ndarray:
  """inv_freq[i] = 1 / theta^(2i / head_dim): [head_dim // 2] float32."""
  exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(
      np.float32) / np.float32(head_dim)
  # float32 powers rounded from float64 ones: what torch computes.
  powers = (float(theta) ** exponents.astype(np.float64)).astype(np.float32)
  return np.float32(1.0) / powers


def llama3_frequencies(inv_freq: np.ndarray, factor: float,
                       low_freq_factor: float, high_freq_factor: float,
                       original_max_len: int) -> np.ndarray:
  """Llama 3.1's scaling: wavelengths longer than original_max_len /
  low_freq_factor are stretched `factor` times, those shorter than
  original_max_len / high_freq_factor kept, and those between interpolated.
  [head_dim // 2] float32 -> the same."""
  # Scalars meet arrays as float32, as Python numbers meet float32 tensors.
  low_freq_wavelen = np.float32(original_max_len / low_freq_factor)
  high_freq_wavelen = np.float32(original_max_len / high_freq_factor)
  factor, low = np.float32(factor), np.float32(low_freq_factor)
  # torch divides a number by a tensor as the tensor's reciprocal times it.
  wavelen = (np.float32(1) / inv_freq) * np.float32(2 * math.pi)
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = ((np.float32(1) / wavelen) * np.float32(original_max_len)
            - low) / np.float32(high_freq_factor - low_freq_factor)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
  """The rotation speed of each feature pair of a head, with the configured
  `rope_scaling`: [head_dim // 2] float32."""
  inv_freq = default_frequencies(config.head_features, config.rope_theta)
  if config.rope_scaling == 'linear':
    return inv_freq / np.float32(config.rope_scaling_factor)
  if config.rope_scaling == 'llama3':
    return llama3_frequencies(
        inv_freq, config.rope_scaling_factor, config.rope_low_freq_factor,
        config.rope_high_freq_factor, config.rope_original_max_len)
  return inv_freq


def rotate_half(x: jax.Array) -> jax.Array:
  """[..., h] -> [..., h]: the halves (x1, x2) as (-x2, x1)."""
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def rotate(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
  """Rotates each head of x by its position.

  Args:
    x: [batch, length, n, h] queries or keys.
    positions: [batch, length] int.
    inv_freq: [h // 2] float32 (`inverse_frequencies`).

  Returns:
    [batch, length, n, h] in x's dtype.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(
      inv_freq, jnp.float32)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  return x * cos + rotate_half(x) * sin
