"""Scaled dot-product attention, functions of arrays: the einsum path (also
for the decoding cache: beams that share keys, a cache read in prefixes)
and the kernel paths (`kernels`, chosen by `backend.attention_kernel`).

Shapes: `batch` b, query length t, key length s, query heads n, key/value
heads k (k divides n: grouped-query attention, where query heads
i * n/k ... (i + 1) * n/k - 1 share key/value head i; k = n is multi-head
attention), head features h.
"""
import jax
import jax.numpy as jnp

from jaxformer.model import backend, cpu_kernels, kernels
from jaxformer.model.layers import dropout
from jaxformer.model.masks import Segments, dense_mask, masked_value


def grouped_mask(mask, kv_heads: int, group: int, length: int,
                 keys: int) -> jax.Array:
  """A mask broadcastable to [batch, n, t, s] for the queries of each key
  head stacked along t: [batch, 1 or k, group * t, s] (n = k * group)."""
  if group == 1:
    return mask
  mask = jnp.asarray(mask)
  rows, heads = mask.shape[0], mask.shape[1]
  if heads == 1:
    mask = jnp.broadcast_to(mask[:, :, None], (rows, 1, group, length, keys))
  else:
    mask = jnp.broadcast_to(mask, (rows, heads, length, keys))
  return mask.reshape(rows, -1, group * length, keys)


def heads_first_attention(query, key, value, mask, *,
                          key_layout: str = 'bnsh', dropout_rate: float = 0.0,
                          dropout_rng=None):
  """Scaled dot-product attention on heads-first arrays, written out with
  einsums. The query heads that share a key/value head are stacked along
  the query axis, so keys and values are never repeated.

  Args:
    query: [batch, n, t, h]; value: [batch, k, s, h].
    key: [batch, k, s, h], or [batch, k, h, s] with key_layout='bnhs' (the
      decoding cache: transposed keys make the logits a plain matmul, which
      XLA's CPU matmul runs without first transposing the whole cache).
    mask: bool, broadcastable to [batch, n, t, s].

  Returns:
    ([batch, n, t, h] in query's dtype, [batch, n, t, s] float32 weights).
  """
  batch, heads, length, head_dim = query.shape
  kv_heads, keys = value.shape[1], value.shape[2]
  group = heads // kv_heads
  query = query.reshape(batch, kv_heads, group * length, head_dim)
  mask = grouped_mask(mask, kv_heads, group, length, keys)
  scale = head_dim ** -0.5
  logits = jnp.einsum(f'bnth,{key_layout}->bnts',
                      query * jnp.asarray(scale, query.dtype), key,
                      preferred_element_type=jnp.float32)
  logits = jnp.where(mask, logits, masked_value(jnp.float32))
  weights = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0 and dropout_rng is not None:
    weights = dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum('bnts,bnsh->bnth', weights.astype(value.dtype), value)
  return (out.reshape(batch, heads, length, head_dim),
          weights.reshape(batch, heads, length, keys))


def heads_first(x: jax.Array) -> jax.Array:
  """[batch, length, n, h] <-> [batch, n, length, h]."""
  return jnp.swapaxes(x, 1, 2)


def transposed_keys(key: jax.Array) -> jax.Array:
  """[batch, s, n, h] -> [batch, n, h, s]."""
  return jnp.transpose(key, (0, 2, 3, 1))


def einsum_attention(query, key, value, mask, *, dropout_rate: float = 0.0,
                     dropout_rng=None):
  """Scaled dot-product attention written out with einsums.

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, k, h].
    mask: bool, broadcastable to [batch, n, t, s].

  Returns:
    ([batch, t, n, h] in query's dtype, [batch, n, t, s] float32 weights).
  """
  out, weights = heads_first_attention(
      heads_first(query), heads_first(key), heads_first(value), mask,
      dropout_rate=dropout_rate, dropout_rng=dropout_rng)
  return heads_first(out), weights


def shared_key_attention(query, key_t, value, mask):
  """Attention in which each run of `group` consecutive query rows shares one
  row of keys and values, as the beams of a sentence share its source and
  its decoding cache; the group size is rows // batch.

  Args:
    query: [rows, t, n, h] with rows = batch * group.
    key_t: [batch, k, h, s] (transposed keys); value: [batch, k, s, h].
    mask: bool, broadcastable to [rows, 1, t, s].

  Returns:
    ([rows, t, n, h] in query's dtype, [rows, n, t, s] float32 weights).
  """
  rows, length, heads, head_dim = query.shape
  batch, _, _, source_length = key_t.shape
  group = rows // batch
  mask = jnp.broadcast_to(mask, (rows, 1, length, source_length))
  out, weights = heads_first_attention(
      heads_first(query.reshape(batch, group * length, heads, head_dim)),
      key_t, value, mask.reshape(batch, 1, group * length, source_length),
      key_layout='bnhs')
  out = heads_first(out).reshape(rows, length, heads, head_dim)
  weights = jnp.swapaxes(
      weights.reshape(batch, heads, group, length, source_length), 1, 2)
  return out, weights.reshape(rows, heads, length, source_length)


def prefix_attention(query, key_t, value, mask, filled,
                     buckets: int | None = None):
  """`shared_key_attention` over the first `filled` cache slots only: on CPU
  with a long cache, rounded up to one of `buckets` static lengths
  (`cpu_kernels.read_prefix`); elsewhere over the whole cache.

  Args:
    query, key_t, value, mask: as in `shared_key_attention`; slots at or
      beyond `filled` must be masked out.
    filled: [] int, 1 <= filled <= s.
    buckets: the number of static lengths; None for
      `cpu_kernels.prefix_buckets` on CPU, 1 elsewhere.

  Returns:
    as `shared_key_attention`; the weights are zero beyond the bucket.
  """
  if buckets is None:
    buckets = 1
    if backend.cpu_kernel_applies('prefix_buckets', backend.platform(query)):
      buckets = cpu_kernels.prefix_buckets(value.shape[2])
  if buckets <= 1:
    return shared_key_attention(query, key_t, value, mask)
  return cpu_kernels.read_prefix(shared_key_attention, query, key_t, value,
                                 mask, filled, buckets)


def fused_attention(query, key, value, mask):
  """`jax.nn.dot_product_attention` with XLA's fused softmax (no flash
  tiling): `einsum_attention` without dropout and weights."""
  return kernels.xla_attention(query, key, value, dense_mask(mask))


def kernel_attention(kernel: str, query, key, value, mask, platform: str):
  """The kernel path `kernel` ('fused', 'cudnn' or 'splash', see
  `backend.attention_kernel`), or the einsums where it cannot take `mask`
  (saying why, once).

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, k, h].
    mask: `Segments`, or a bool mask (dense: only 'fused' takes it).

  Returns:
    [batch, t, n, h] in query's dtype.
  """
  if kernel == 'fused':
    return fused_attention(query, key, value, mask)
  reason = None
  if not isinstance(mask, Segments):
    reason = 'it was given a dense mask, not segment ids'
  elif kernel == 'cudnn' and mask.packed:
    reason = ("cuDNN's flash attention takes sequence lengths, not segment "
              'ids, and these rows may hold packed examples (pass no segment '
              "ids for unpacked rows, as 'bucket' batching does)")
  if reason is not None:
    backend.log_once(f'{kernel} attention falls back to the einsum path: '
                     f'{reason}.')
    return einsum_attention(query, key, value, dense_mask(mask))[0]
  if kernel == 'cudnn':
    return kernels.cudnn_attention(query, key, value, mask.query, mask.key,
                                   mask.causal)
  return kernels.splash_attention(query, key, value, mask.query, mask.key,
                                  mask.causal, interpret=platform != 'tpu')
