"""Multi-head attention: self, causal self and cross attention, with masks for
padding and packed sequences, an einsum and a fused path, and a decoding cache.

Shapes: `batch` b, query length t, key length s, heads n, head features h.
"""
import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.model.config import ModelConfig


def attention_mask(query_segment_ids: jax.Array, key_segment_ids: jax.Array,
                   causal: bool) -> jax.Array:
  """Which keys each query may attend to.

  Args:
    query_segment_ids: [batch, q_length] int; 0 marks padding, equal non-zero
      ids mark one example of a packed row.
    key_segment_ids: [batch, k_length] int, same convention.
    causal: also forbid keys at later positions than the query.

  Returns:
    [batch, 1, q_length, k_length] bool, True where attention is allowed.
  """
  mask = (query_segment_ids[:, :, None] == key_segment_ids[:, None, :])
  mask &= (key_segment_ids[:, None, :] != 0)
  if causal:
    q_index = jnp.arange(query_segment_ids.shape[1])[:, None]
    k_index = jnp.arange(key_segment_ids.shape[1])[None, :]
    mask &= (k_index <= q_index)[None]
  return mask[:, None]


def _masked_value(dtype) -> float:
  # Large but finite: a fully masked row (a padding query) softmaxes to a
  # uniform distribution instead of NaN, as jax.nn.dot_product_attention does.
  return -0.7 * float(jnp.finfo(dtype).max)


def einsum_attention(query, key, value, mask, *, dropout_rate: float = 0.0,
                     dropout_rng=None):
  """Scaled dot-product attention written out with einsums.

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, n, h].
    mask: bool, broadcastable to [batch, n, t, s].

  Returns:
    ([batch, t, n, h] in query's dtype, [batch, n, t, s] float32 weights).
  """
  scale = query.shape[-1] ** -0.5
  logits = jnp.einsum('btnh,bsnh->bnts', query * jnp.asarray(scale, query.dtype),
                      key, preferred_element_type=jnp.float32)
  logits = jnp.where(mask, logits, _masked_value(jnp.float32))
  weights = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0 and dropout_rng is not None:
    keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
    weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum('bnts,bsnh->btnh', weights.astype(value.dtype), value)
  return out, weights


def fused_attention(query, key, value, mask):
  """`jax.nn.dot_product_attention`: cuDNN flash attention on GPUs when the
  shapes and dtype allow it, XLA's fused softmax elsewhere. Same signature and
  result as `einsum_attention` without dropout and weights."""
  mask = jnp.broadcast_to(
      mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
  return jax.nn.dot_product_attention(query, key, value, mask=mask)


def _xavier(in_axis, out_axis):
  return nn.initializers.variance_scaling(
      1.0, 'fan_avg', 'uniform', in_axis=in_axis, out_axis=out_axis)


class SplitHeads(nn.Module):
  """[batch, length, d_model] -> [batch, length, heads, head_dim]."""
  config: ModelConfig
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(
            _xavier(0, (1, 2)), ('embed', 'heads', 'kv')),
        (cfg.d_model, cfg.num_heads, cfg.head_dim), jnp.float32)
    y = jnp.einsum('bld,dnh->blnh', x, kernel.astype(cfg.compute_dtype))
    if self.use_bias and cfg.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(
          nn.initializers.zeros, ('heads', 'kv')),
                        (cfg.num_heads, cfg.head_dim), jnp.float32)
      y += bias.astype(cfg.compute_dtype)
    return y


class MergeHeads(nn.Module):
  """[batch, length, heads, head_dim] -> [batch, length, d_model]."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(
            _xavier((0, 1), 2), ('heads', 'kv', 'embed')),
        (cfg.num_heads, cfg.head_dim, cfg.d_model), jnp.float32)
    y = jnp.einsum('blnh,nhd->bld', x, kernel.astype(cfg.compute_dtype))
    if cfg.use_bias:
      bias = self.param('bias', nn.with_logical_partitioning(
          nn.initializers.zeros, ('embed',)), (cfg.d_model,), jnp.float32)
      y += bias.astype(cfg.compute_dtype)
    return y


class MultiHeadAttention(nn.Module):
  """Multi-head attention of one kind: 'self', 'causal' (masked self) or 'cross'.

  In decode mode, 'causal' keeps keys and values of earlier steps in the
  'cache' collection and takes one query position per call; 'cross' computes
  the keys and values of the source once, when the cache is created, and
  reuses them at every step.
  """
  config: ModelConfig
  kind: str = 'self'
  deterministic: bool = True
  decode: bool = False

  def _project(self, x, name):
    # A key bias adds the same q.b to every logit of a query, which softmax
    # ignores: it has no effect and zero gradient, so there is none.
    return SplitHeads(self.config, use_bias=name != 'key', name=name)(x)

  @nn.compact
  def __call__(self, query_inputs, kv_inputs, mask):
    """Attends from `query_inputs` to `kv_inputs`.

    Args:
      query_inputs: [batch, t, d_model].
      kv_inputs: [batch, s, d_model]; ignored by 'cross' once its cache exists.
      mask: bool broadcastable to [batch, heads, t, s]; for 'causal' in decode
        mode it is ignored (the cache index decides).

    Returns:
      [batch, t, d_model].
    """
    cfg = self.config
    query = self._project(query_inputs, 'query')
    if self.decode and self.kind == 'cross':
      key, value = self._cross_cache(kv_inputs)
    else:
      key = self._project(kv_inputs, 'key')
      value = self._project(kv_inputs, 'value')
    if self.decode and self.kind == 'causal':
      key, value, mask = self._causal_cache(key, value)

    dropout_rng = None
    if not self.deterministic and cfg.attention_dropout > 0:
      dropout_rng = self.make_rng('dropout')
    if cfg.attention_impl == 'fused' and dropout_rng is None:
      out = fused_attention(query, key, value, mask)
    else:
      out, weights = einsum_attention(
          query, key, value, mask, dropout_rate=cfg.attention_dropout,
          dropout_rng=dropout_rng)
      self.sow('intermediates', 'attention_weights', weights)

    return MergeHeads(cfg, name='out')(out)

  def _cross_cache(self, kv_inputs):
    """Source keys and values, projected once when the cache is created."""
    key = self.variable('cache', 'source_key', lambda: self._project(kv_inputs, 'key'))
    value = self.variable('cache', 'source_value',
                          lambda: self._project(kv_inputs, 'value'))
    return key.value, value.value

  def _causal_cache(self, key, value):
    """Writes this step's key/value [batch, 1, n, h] at the cache index.

    The cache is created (zeros, index 0) by a call whose inputs have the
    maximum decode length; later calls take one position each.
    """
    ready = self.has_variable('cache', 'cached_key')
    cached_key = self.variable('cache', 'cached_key', jnp.zeros, key.shape,
                               key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 value.shape, value.dtype)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    max_length = cached_key.value.shape[1]
    if not ready:
      mask = attention_mask(jnp.ones(key.shape[:2], jnp.int32),
                            jnp.ones(key.shape[:2], jnp.int32), causal=True)
      return key, value, mask
    if key.shape[1] != 1:
      raise ValueError(f'Cached decoding takes one position per call, got '
                       f'{key.shape[1]}.')
    i = index.value
    cached_key.value = jax.lax.dynamic_update_slice_in_dim(
        cached_key.value, key, i, axis=1)
    cached_value.value = jax.lax.dynamic_update_slice_in_dim(
        cached_value.value, value, i, axis=1)
    index.value = i + 1
    mask = (jnp.arange(max_length) <= i)[None, None, None, :]
    return cached_key.value, cached_value.value, mask
