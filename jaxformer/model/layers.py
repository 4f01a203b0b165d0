"""Building blocks: linear maps, embeddings, positions, the position-wise
feed-forward network (plain or gated), dropout, and residual connections
with LayerNorm or RMSNorm in either order."""
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxformer.model import backend, cpu_kernels, frozen_kernels, lora
from jaxformer.model.config import ModelConfig


def sinusoidal_positions(max_len: int, d_model: int,
                         layout: str = 'interleaved') -> np.ndarray:
  """The sinusoid table, angles pos / 10000^(2i/d_model) for positions
  0..max_len-1. 'interleaved' (the paper): PE[pos, 2i] = sin, PE[pos, 2i+1]
  = cos; 'halves' (Marian): the ceil(d/2) sines, then the floor(d/2)
  cosines; 'tensor2tensor': the d/2 sines then the d/2 cosines of angles
  pos / 10000^(i / (d/2 - 1)), i < d/2.

  Returns:
    [max_len, d_model] float32.
  """
  position = np.arange(max_len, dtype=np.float64)[:, None]
  if layout == 'tensor2tensor':
    half = d_model // 2
    i = np.arange(half, dtype=np.float64)[None, :]
    angle = position / np.power(10000.0, i / max(half - 1, 1))
    return np.concatenate([np.sin(angle), np.cos(angle)],
                          axis=1).astype(np.float32)
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]
  angle = position / np.power(10000.0, two_i / d_model)
  sines, cosines = np.sin(angle), np.cos(angle[:, : d_model // 2])
  if layout == 'halves':
    return np.concatenate([sines, cosines], axis=1).astype(np.float32)
  table = np.zeros((max_len, d_model), dtype=np.float64)
  table[:, 0::2] = sines
  table[:, 1::2] = cosines
  return table.astype(np.float32)


def matmuls(x: jax.Array, kernels, preferred_element_type=None
            ) -> list[jax.Array]:
  """x kernel^T for each kernel: [..., in] x [out_k, in] -> [..., out_k].

  On CPU with few rows (a decoding step), one product of the kernels
  stacked (`cpu_kernels.transposed_matmuls`).
  """
  leading, features = x.shape[:-1], x.shape[-1]
  rows = int(np.prod(leading))
  if not backend.cpu_kernel_applies('transposed_matmuls',
                                    backend.platform(x), rows):
    return [jnp.einsum('...i,oi->...o', x, kernel,
                       preferred_element_type=preferred_element_type)
            for kernel in kernels]
  products = cpu_kernels.transposed_matmuls(
      x.reshape(rows, features), kernels, preferred_element_type)
  return [y.reshape(*leading, y.shape[-1]) for y in products]


class Embed(nn.Module):
  """Token embedding, scaled by sqrt(d_model) (config.scale_embedding);
  `attend` reuses the table as the output projection (tied embeddings). With
  config.zero_pad_embedding the pad row reads as zeros."""
  vocab_size: int
  config: ModelConfig

  def setup(self):
    d_model = self.config.d_model
    self.table = self.param(
        'embedding',
        nn.with_logical_partitioning(
            nn.initializers.normal(stddev=d_model ** -0.5), ('vocab', 'embed')),
        (self.vocab_size, d_model), jnp.float32)

  def weights(self) -> jax.Array:
    """The table [vocab, d_model] as the model uses it, in the compute
    dtype."""
    cfg = self.config
    table = jnp.asarray(self.table, cfg.compute_dtype)
    if cfg.zero_pad_embedding:
      is_pad = jnp.arange(self.vocab_size)[:, None] == cfg.pad_id
      table = jnp.where(is_pad, jnp.zeros((), table.dtype), table)
    return table

  def __call__(self, ids: jax.Array) -> jax.Array:
    """[batch, length] int -> [batch, length, d_model]."""
    table = self.weights()
    x = jnp.take(table, ids, axis=0)
    if not self.config.scale_embedding:
      return x
    return x * jnp.sqrt(jnp.asarray(self.config.d_model, table.dtype))

  def attend(self, x: jax.Array) -> jax.Array:
    """[batch, length, d_model] -> [batch, length, vocab] float32 logits."""
    return matmuls(x, [self.weights()], preferred_element_type=jnp.float32)[0]


class AddPositions(nn.Module):
  """Adds sinusoidal (the paper) or learned position embeddings; rotary
  positions add nothing here (attention rotates its queries and keys)."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x: [batch, length, d_model]; positions: [batch, length] int, from 0
    (model.position_offset is added here)."""
    cfg = self.config
    if cfg.position_embedding == 'rope':
      return x
    rows = cfg.max_len + cfg.position_offset
    if cfg.position_embedding == 'sinusoidal':
      table = jnp.asarray(sinusoidal_positions(rows, cfg.d_model,
                                               cfg.sinusoid_layout))
    else:
      table = self.param(
          'position_embedding',
          nn.with_logical_partitioning(
              nn.initializers.normal(stddev=0.02), (None, 'embed')),
          (rows, cfg.d_model), jnp.float32)
    return x + jnp.take(table, positions + cfg.position_offset,
                        axis=0).astype(x.dtype)


class TokenTypes(nn.Module):
  """Adds the token-type (segment A/B) embeddings of
  config.type_vocab_size rows."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, token_types: jax.Array | None
               ) -> jax.Array:
    """x: [batch, length, d_model]; token_types: [batch, length] int, or
    None for all 0."""
    table = self.param('embedding', nn.with_logical_partitioning(
        nn.initializers.normal(stddev=0.02), (None, 'embed')),
        (self.config.type_vocab_size, self.config.d_model), jnp.float32)
    if token_types is None:
      return x + table[0].astype(x.dtype)
    return x + jnp.take(table, token_types, axis=0).astype(x.dtype)


class Linear(nn.Module):
  """y = x W^T + b over the last `in_ndim` axes of x.

  The kernel is stored output-major, [*features, *in_features] (as in
  torch), and applied as one 2-D matmul, so a kernel with several output
  axes is never transposed at run time. Layers that read the same input can
  be applied together, with `apply_linears`. A projection of attention or
  the FFN names itself (`projection`: q, k, v, o, gate, up, down, ffn_in,
  ffn_out); model.lora.targets naming it gives it a low-rank adapter
  (`model/lora.py`).
  """
  features: tuple[int, ...]
  axes: tuple[str | None, ...]  # Logical axes of the kernel: outputs, inputs.
  config: ModelConfig
  in_ndim: int = 1
  use_bias: bool = True
  projection: str | None = None
  deterministic: bool = True  # The adapter's dropout is off.

  @nn.compact
  def weights(self, in_features: tuple[int, ...]):
    """(kernel, bias, adapter): the kernel as a [prod(features),
    prod(in_features)] matrix and the bias [*features] (None without one),
    in the compute dtype; the adapter's (A [rank, in], B [out, rank])
    float32, or None."""
    cfg = self.config
    outputs = len(self.features)
    init = nn.initializers.variance_scaling(
        1.0, 'fan_avg', 'uniform',
        in_axis=tuple(range(outputs, outputs + self.in_ndim)),
        out_axis=tuple(range(outputs)))
    shape = (*self.features, *in_features)
    if self.projection is None:
      kernel = self.param('kernel', nn.with_logical_partitioning(
          init, self.axes), shape, jnp.float32)
    else:  # Frozen under adapters: in model.lora.base_dtype.
      kernel = frozen_kernels.kernel(self, shape, outputs, self.axes, init)
    kernel = kernel.reshape(int(np.prod(self.features)), -1)
    bias = None
    if self.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(
          nn.initializers.zeros, self.axes[:outputs]), self.features,
                        jnp.float32).astype(cfg.compute_dtype)
    adapter = None
    if self.projection in cfg.lora_targets:
      adapter = lora.adapter_factors(self, kernel.shape[0], kernel.shape[1])
    return kernel.astype(cfg.compute_dtype), bias, adapter

  def adapted(self, y: jax.Array, x: jax.Array, adapter) -> jax.Array:
    """y [..., out] plus the adapter's product of x [..., in] (its input
    dropped out while training)."""
    lora_config = self.config.lora
    if not self.deterministic and lora_config.dropout > 0:
      x = dropout(x, lora_config.dropout, self.make_rng('dropout'))
    return y + lora.adapter_product(x, *adapter, lora_config.scale)

  def __call__(self, x: jax.Array) -> jax.Array:
    """[..., *in_features] -> [..., *features] in the compute dtype."""
    return apply_linears(x, [self])[0]


def apply_linears(x: jax.Array, linears) -> list[jax.Array]:
  """Linear layers of one `in_ndim` applied to the same x, as one matrix
  product where that is faster (`matmuls`), each adapter's product added:
  [..., *in_features] -> [..., *features] for each layer."""
  in_ndim = linears[0].in_ndim
  leading, in_features = x.shape[:-in_ndim], x.shape[-in_ndim:]
  weights = [linear.weights(in_features) for linear in linears]
  x = x.reshape(*leading, -1).astype(linears[0].config.compute_dtype)
  products = matmuls(x, [kernel for kernel, _, _ in weights])
  outputs = []
  for linear, y, (_, bias, adapter) in zip(linears, products, weights):
    if adapter is not None:
      y = linear.adapted(y, x, adapter)
    y = y.reshape(*leading, *linear.features)
    outputs.append(y if bias is None else y + bias)
  return outputs


def _random_halfwords(rng: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """Independent uniform 16-bit words, [*shape] uint32 in [0, 2^16).

  jax.random.bits spends one threefry2x32 block (64 random bits) on each
  32-bit word; here one block gives four 16-bit words, so dropout hashes a
  quarter as much (the `small` train step on 2 CPU cores: 4.5-8% faster). Other
  key kinds (rbg) draw 32-bit words and use both halves. The words are laid
  out along the last axis, so they shard like `shape` does.
  """
  *lead, last = shape
  if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.wrap_key_data(rng)  # A raw key of the default impl.
  per_word = 4 if str(jax.random.key_impl(rng)) == 'threefry2x32' else 2
  words_shape = (*lead, math.ceil(last / per_word))
  if math.prod(words_shape) >= 2 ** 32:
    raise ValueError(f'dropout of {shape}: more than 2^32 random words; '
                     'split the array.')
  if per_word == 4:
    # Each word's row-major index, the counter threefry hashes.
    counts = jax.lax.broadcasted_iota(jnp.uint32, words_shape, len(lead))
    stride = words_shape[-1]
    for axis in reversed(range(len(lead))):
      counts += jax.lax.broadcasted_iota(jnp.uint32, words_shape, axis) * (
          np.uint32(stride))
      stride *= words_shape[axis]
    key = jax.random.key_data(rng)
    words = jax.extend.random.threefry2x32_p.bind(
        key[0], key[1], jnp.zeros_like(counts), counts)
  else:
    words = [jax.random.bits(rng, words_shape, jnp.uint32)]
  halves = [part for w in words for part in (w & 0xFFFF, w >> 16)]
  return jnp.stack(halves, axis=-1).reshape(*lead, -1)[..., :last]


def dropout(x: jax.Array, rate: float, rng: jax.Array) -> jax.Array:
  """Inverted dropout: each element of x is zeroed with probability `rate`,
  rounded to a multiple of 2^-16 (off by at most 7.6e-6), and the rest are
  scaled by the exact inverse of the keep probability, so E[out] = x.

  Args:
    x: [...] any float dtype; rate: in [0, 1]; rng: a PRNG key.
  """
  if rate >= 1.0:
    return jnp.zeros_like(x)
  dropped = round(rate * 2 ** 16)
  if not dropped or x.size == 0:
    return x
  keep = _random_halfwords(rng, x.shape or (1,)).reshape(x.shape) >= dropped
  scale = jnp.asarray(2 ** 16 / (2 ** 16 - dropped), x.dtype)
  return jnp.where(keep, x * scale, jnp.zeros_like(x))


class Dropout(nn.Module):
  """`dropout` with a key from the 'dropout' rng stream, off when
  deterministic (flax.linen.Dropout's interface)."""
  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng('dropout'))


ACTIVATIONS = {
    'relu': nn.relu,
    'gelu': nn.gelu,  # The tanh approximation.
    'gelu_exact': lambda x: nn.gelu(x, approximate=False),
    'swish': nn.swish,
    'swiglu': nn.swish,  # Gated: of the gate's projection.
    'geglu': nn.gelu,
}


class FeedForward(nn.Module):
  """FFN(x) = act(x W1 + b1) W2 + b2, applied at every position; gated
  (config.gated_ffn), act(x W_0 + b_0) * (x W_1 + b_1) W2 + b2, with the
  projections 'wi_0' (the gate) and 'wi_1' in place of 'wi'."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    """[batch, length, d_model] -> [batch, length, d_model]."""
    cfg = self.config
    names = {'wi_0': 'gate', 'wi_1': 'up'} if cfg.gated_ffn else {
        'wi': 'ffn_in'}
    inputs = apply_linears(x, [
        Linear((cfg.d_ff,), ('mlp', 'embed'), cfg, use_bias=cfg.use_bias,
               projection=projection, deterministic=self.deterministic,
               name=name) for name, projection in names.items()])
    h = ACTIVATIONS[cfg.activation](inputs[0])
    if cfg.gated_ffn:
      h = h * inputs[1]
    h = nn.with_logical_constraint(h, ('batch', 'length', 'mlp'))
    h = Dropout(cfg.ffn_dropout)(h, deterministic=self.deterministic)
    return Linear((cfg.d_model,), ('embed', 'mlp'), cfg, use_bias=cfg.use_bias,
                  projection='down' if cfg.gated_ffn else 'ffn_out',
                  deterministic=self.deterministic, name='wo')(h)


def norm(config: ModelConfig, name: str) -> nn.Module:
  """The configured norm (`config.norm_type`) over the last axis, computed in
  float32 statistics with float32 parameters."""
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, ('embed',))
  if config.norm_type == 'rms':
    return nn.RMSNorm(epsilon=config.rms_norm_epsilon,
                      dtype=config.compute_dtype, param_dtype=jnp.float32,
                      scale_init=scale_init, name=name)
  return nn.LayerNorm(
      epsilon=config.layer_norm_epsilon, dtype=config.compute_dtype,
      param_dtype=jnp.float32, use_bias=config.norm_bias,
      scale_init=scale_init,
      bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
      name=name)


def embedding_norm(config: ModelConfig, x: jax.Array) -> jax.Array:
  """x [batch, length, d_model] through the norm 'embedding_norm' where
  config.embedding_norm asks for one (called inside a compact method)."""
  return norm(config, 'embedding_norm')(x) if config.embedding_norm else x


def residual(x: jax.Array, sublayer: Callable[[jax.Array], jax.Array],
             name: str, drop: Dropout, config: ModelConfig,
             deterministic: bool) -> jax.Array:
  """A sublayer with its residual connection and the norm `{name}_norm`
  (LayerNorm or RMSNorm), in `config.norm_position`:

  post-LN (the paper): Norm(x + Dropout(sublayer(x)));
  pre-LN: x + Dropout(sublayer(Norm(x))).
  """
  normalize = norm(config, f'{name}_norm')
  if config.norm_position == 'pre':
    return x + drop(sublayer(normalize(x)), deterministic=deterministic)
  return normalize(x + drop(sublayer(x), deterministic=deterministic))
