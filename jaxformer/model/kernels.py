"""Attention kernels that never build the [batch, n, t, s] weights: XLA's
fused softmax, cuDNN flash attention (GPUs) and the Pallas splash kernel
(TPUs), behind the signature of `dot_product.einsum_attention` without
dropout. Each takes fewer key/value heads than query heads as they are
(grouped-query attention), without repeating them.

Shapes: `batch` b, query length t, key length s, query heads n, key/value
heads k (dividing n), head features h.
"""
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec

# Splash tiles lengths in blocks of multiples of the TPU's 128 lanes.
_LANES = 128


def xla_attention(query, key, value, mask):
  """`jax.nn.dot_product_attention` with XLA's implementation.

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, k, h].
    mask: bool, broadcastable to [batch, 1, t, s].

  Returns:
    [batch, t, n, h] in query's dtype.
  """
  mask = jnp.broadcast_to(
      mask, (query.shape[0], 1, query.shape[1], key.shape[1]))
  return jax.nn.dot_product_attention(query, key, value, mask=mask,
                                      implementation='xla')


def sequence_lengths(segment_ids: jax.Array) -> jax.Array:
  """[batch, length] segment ids of unpacked rows (tokens, then padding)
  -> [batch] int32 lengths."""
  return jnp.count_nonzero(segment_ids, axis=1).astype(jnp.int32)


def cudnn_attention(query, key, value, query_segment_ids, key_segment_ids,
                    causal: bool):
  """cuDNN flash attention on unpacked rows: causality through `is_causal`,
  padding through sequence lengths (cuDNN's interface takes no segment ids).

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, k, h]; bfloat16 or
      float16.
    query_segment_ids: [batch, t]; key_segment_ids: [batch, s]: 1 for
      tokens, 0 for the padding after them.

  Returns:
    [batch, t, n, h]; rows past a query's length are zero.
  """
  return jax.nn.dot_product_attention(
      query, key, value, is_causal=causal,
      query_seq_lengths=sequence_lengths(query_segment_ids),
      key_value_seq_lengths=sequence_lengths(key_segment_ids),
      implementation='cudnn')


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _block(length: int) -> int:
  """The largest of 512, 256, 128 that divides `length` (a multiple of 128)."""
  return next(b for b in (512, 256, _LANES) if length % b == 0)


def _splash_kernel(heads: int, q_length: int, kv_length: int, causal: bool,
                   interpret: bool):
  """One head-batched splash kernel: (q [n, t, h], k, v [k, s, h],
  segment_ids=SegmentIds) -> [n, t, h]; t and s multiples of 128."""
  # Imported here: Pallas' TPU modules take a while to load, and most
  # programs never need them.
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  shape = (q_length, kv_length)
  mask = splash.CausalMask(shape) if causal else splash.FullMask(shape)
  bq, bkv = _block(q_length), _block(kv_length)
  blocks = splash.BlockSizes(
      block_q=bq, block_kv=bkv, block_kv_compute=bkv,
      block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
      block_q_dq=bq, block_kv_dq=bkv)
  return splash.make_splash_mha_single_device(
      splash.MultiHeadMask([mask] * heads), block_sizes=blocks,
      interpret=interpret)


def local_splash_attention(query, key, value, query_segment_ids,
                           key_segment_ids, causal: bool,
                           interpret: bool = False):
  """Splash attention on one device's arrays.

  Lengths are padded up to multiples of 128 with segment id 0; queries
  attend to keys of their own non-zero segment (padding queries to padding
  keys, which only fills rows nobody reads), so packed rows need nothing
  else. The kernel does not scale the logits itself.

  Args:
    query: [batch, t, n, h]; key, value: [batch, s, k, h].
    query_segment_ids: [batch, t] int; key_segment_ids: [batch, s] int.

  Returns:
    [batch, t, n, h] in query's dtype.
  """
  batch, t, heads, head_dim = query.shape
  s = key.shape[1]
  tp, sp = _round_up(t, _LANES), _round_up(s, _LANES)

  def heads_first(x, padded):
    x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
    return jnp.swapaxes(x, 1, 2)

  def pad_ids(ids, padded):
    return jnp.pad(ids.astype(jnp.int32), ((0, 0), (0, padded - ids.shape[1])))

  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
  scale = jnp.asarray(head_dim ** -0.5, query.dtype)
  kernel = _splash_kernel(heads, tp, sp, causal, interpret)
  out = jax.vmap(kernel)(
      heads_first(query * scale, tp), heads_first(key, sp),
      heads_first(value, sp),
      segment_ids=SegmentIds(q=pad_ids(query_segment_ids, tp),
                             kv=pad_ids(key_segment_ids, sp)))
  return jnp.swapaxes(out, 1, 2)[:, :t]


def _mesh_axes(logical: str):
  """The mesh axes the current logical rules give `logical` (None if none)."""
  try:
    return nn.logical_to_mesh_axes((logical,))[0]
  except ValueError:
    return None


def _mesh_size(axes) -> int:
  """How many parts the mesh axes `axes` (a name, a tuple or None) split an
  array into."""
  mesh = jax.sharding.get_abstract_mesh()
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return math.prod(mesh.shape[name] for name in names)


def splash_attention(query, key, value, query_segment_ids, key_segment_ids,
                     causal: bool, interpret: bool = False):
  """`local_splash_attention` under `shard_map` over the mesh in context:
  rows split as the logical 'batch' axis is, heads as 'heads'; without a
  mesh, on the arrays as they are. Shapes as `local_splash_attention`.

  Key/value heads split as the query heads do where the split divides
  them, so that each device holds the key/value heads of its query heads;
  elsewhere they are repeated to one per query head, here only.
  """
  mesh = jax.sharding.get_abstract_mesh()

  def attend(query, key, value, query_segment_ids, key_segment_ids):
    return local_splash_attention(query, key, value, query_segment_ids,
                                  key_segment_ids, causal, interpret)

  if mesh.empty:
    return attend(query, key, value, query_segment_ids, key_segment_ids)
  rows, heads = _mesh_axes('batch'), _mesh_axes('heads')
  kv_heads = key.shape[2]
  if kv_heads % _mesh_size(heads):
    key, value = (jnp.repeat(x, query.shape[2] // kv_heads, axis=2)
                  for x in (key, value))
  qkv = PartitionSpec(rows, None, heads, None)
  ids = PartitionSpec(rows, None)
  return jax.shard_map(attend, mesh=mesh, in_specs=(qkv, qkv, qkv, ids, ids),
                       out_specs=qkv, check_vma=False)(
                           query, key, value, query_segment_ids,
                           key_segment_ids)
