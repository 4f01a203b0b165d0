"""Multi-head attention: self, causal self and cross attention, with masks for
padding and packed sequences, an einsum path and kernel paths (`kernels`,
chosen by `backend.attention_kernel`), and a decoding cache.

Shapes: `batch` b, query length t, key length s, heads n, head features h.
"""
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct

from jaxformer.model import backend, cpu_kernels, kernels
from jaxformer.model.config import ModelConfig
from jaxformer.model.layers import Linear, apply_linears, dropout


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


@struct.dataclass
class Segments:
  """Which keys each query may attend to, as segment ids rather than a
  dense mask, so that kernels which take ids or lengths can use them.

  query: [batch, t] int; key: [batch, s] int (0 = padding, equal non-zero
  ids = one example). causal: keys after the query are masked too. packed:
  whether rows may hold several examples (the caller passed segment ids);
  False promises one example per row, tokens then padding.
  """
  query: jax.Array
  key: jax.Array
  causal: bool = struct.field(pytree_node=False, default=False)
  packed: bool = struct.field(pytree_node=False, default=True)

  def dense(self) -> jax.Array:
    """[batch, 1, t, s] bool, see `attention_mask`."""
    return attention_mask(self.query, self.key, self.causal)


def dense_mask(mask) -> jax.Array:
  """A `Segments` or a bool mask -> bool, broadcastable to [batch, n, t, s]."""
  return mask.dense() if isinstance(mask, Segments) else mask


def _masked_value(dtype) -> float:
  # Large but finite: a fully masked row (a padding query) softmaxes to a
  # uniform distribution instead of NaN, as jax.nn.dot_product_attention does.
  return -0.7 * float(jnp.finfo(dtype).max)


def heads_first_attention(query, key, value, mask, *,
                          key_layout: str = 'bnsh', dropout_rate: float = 0.0,
                          dropout_rng=None):
  """Scaled dot-product attention on heads-first arrays, written out with
  einsums.

  Args:
    query: [batch, n, t, h]; value: [batch, n, s, h].
    key: [batch, n, s, h], or [batch, n, h, s] with key_layout='bnhs' (the
      decoding cache: transposed keys make the logits a plain matmul, which
      XLA's CPU matmul runs without first transposing the whole cache).
    mask: bool, broadcastable to [batch, n, t, s].

  Returns:
    ([batch, n, t, h] in query's dtype, [batch, n, t, s] float32 weights).
  """
  scale = query.shape[-1] ** -0.5
  logits = jnp.einsum(f'bnth,{key_layout}->bnts',
                      query * jnp.asarray(scale, query.dtype), key,
                      preferred_element_type=jnp.float32)
  logits = jnp.where(mask, logits, _masked_value(jnp.float32))
  weights = jax.nn.softmax(logits, axis=-1)
  if dropout_rate > 0.0 and dropout_rng is not None:
    weights = dropout(weights, dropout_rate, dropout_rng)
  out = jnp.einsum('bnts,bnsh->bnth', weights.astype(value.dtype), value)
  return out, weights


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
    query: [batch, t, n, h]; key, value: [batch, s, n, h].
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
    key_t: [batch, n, h, s] (transposed keys); value: [batch, n, s, h].
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
    query: [batch, t, n, h]; key, value: [batch, s, n, h].
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


class MultiHeadAttention(nn.Module):
  """Multi-head attention of one kind: 'self', 'causal' (masked self) or 'cross'.

  In decode mode, 'causal' keeps keys and values of earlier steps in the
  'cache' collection and takes one query position per call; 'cross' computes
  the keys and values of the source once, when the cache is created, and
  reuses them at every step. Decoding takes the einsum path, without dropout.

  The decoding cache serves `beams` hypotheses per sentence (1 unless a beam
  search widens it, see `repeat_cache_for_beams`); the rows of a step
  are batch * beams, sentence-major. All hypotheses of a sentence attend to
  one copy of its source keys/values, and to one pool of cached positions:
  every hypothesis writes its key/value at step p into its own slot, and a
  `history` records, for each hypothesis and position, the slot that holds
  its key/value there. Choosing new beams then only reorders `history`, never
  keys or values.
  """
  config: ModelConfig
  kind: str = 'self'
  deterministic: bool = True
  decode: bool = False

  def _project(self, x, names):
    """[batch, length, d_model] -> [batch, length, n, h] for each projection
    in `names`, computed together."""
    cfg = self.config
    # A key bias adds the same q.b to every logit of a query, which softmax
    # ignores: it has no effect and zero gradient, so there is none.
    return apply_linears(x, [
        Linear((cfg.num_heads, cfg.head_dim), ('heads', 'kv', 'embed'), cfg,
               use_bias=cfg.use_bias and name != 'key', name=name)
        for name in names])

  @nn.compact
  def __call__(self, query_inputs, kv_inputs, mask):
    """Attends from `query_inputs` to `kv_inputs`.

    Args:
      query_inputs: [batch, t, d_model].
      kv_inputs: [batch, s, d_model]; ignored by 'cross' once its cache exists;
        for 'self' and 'causal', query_inputs itself.
      mask: bool broadcastable to [batch, heads, t, s]; for 'causal' in decode
        mode it is ignored (the cache decides).

    Returns:
      [batch, t, d_model].
    """
    cfg = self.config
    if self.kind == 'cross':
      query, = self._project(query_inputs, ['query'])
      if self.decode:
        key_t, value = self._cross_cache(kv_inputs)
        out, weights = shared_key_attention(query, key_t, value,
                                            dense_mask(mask))
      else:
        key, value = self._project(kv_inputs, ['key', 'value'])
        out, weights = self._attend(query, key, value, mask)
    else:
      if kv_inputs is not query_inputs:
        raise ValueError(f"'{self.kind}' attention attends from its inputs to "
                         'themselves: pass the same array twice.')
      query, key, value = self._project(query_inputs,
                                        ['query', 'key', 'value'])
      if self.decode and self.kind == 'causal':
        key_t, value, mask, filled = self._causal_cache(key, value)
        if filled is None:
          out, weights = shared_key_attention(query, key_t, value, mask)
        else:
          out, weights = prefix_attention(query, key_t, value, mask, filled)
      else:
        out, weights = self._attend(query, key, value, mask)
    if weights is not None:
      self.sow('intermediates', 'attention_weights', weights)
    return Linear((cfg.d_model,), ('embed', 'heads', 'kv'), cfg, in_ndim=2,
                  use_bias=cfg.use_bias, name='out')(out)

  def _attend(self, query, key, value, mask):
    """The configured attention path, with attention dropout when training
    (einsum only: the kernels do not return the weights it drops).
    -> (out [batch, t, n, h], weights [batch, n, t, s] or None for a
    kernel)."""
    cfg = self.config
    dropout_rng = None
    if not self.deterministic and cfg.attention_dropout > 0:
      dropout_rng = self.make_rng('dropout')
    platform = backend.platform(query)
    kernel = backend.attention_kernel(cfg.attention_impl, platform,
                                      cfg.compute_dtype,
                                      (query.shape[1], key.shape[1]))
    if kernel != 'einsum' and dropout_rng is not None:
      backend.log_once(
          f'model.attention_dropout={cfg.attention_dropout} runs attention '
          f'on the einsum path, not {kernel}: the kernels do not expose the '
          'weights that dropout drops.')
      kernel = 'einsum'
    if kernel != 'einsum':
      return kernel_attention(kernel, query, key, value, mask, platform), None
    return einsum_attention(query, key, value, dense_mask(mask),
                            dropout_rate=cfg.attention_dropout,
                            dropout_rng=dropout_rng)

  def _cross_cache(self, kv_inputs):
    """Source keys [batch, n, h, s] (transposed) and values [batch, n, s, h],
    projected once when the cache is created."""
    if not self.has_variable('cache', 'source_key'):
      key, value = self._project(kv_inputs, ['key', 'value'])
      self.put_variable('cache', 'source_key', transposed_keys(key))
      self.put_variable('cache', 'source_value', heads_first(value))
    return (self.get_variable('cache', 'source_key'),
            self.get_variable('cache', 'source_value'))

  def _causal_cache(self, key, value):
    """Stores this step's keys/values and returns what the step attends to.

    The cache is created (zeros, index 0, one beam) by a call whose inputs
    have the maximum decode length; later calls take one position each. It
    holds 'cached_key' [batch, n, h, length * beams] (transposed) and
    'cached_value' [batch, n, length * beams, h] (position-major: slot j of
    position p at p * beams + j, so that a step writes one contiguous block
    and the slots filled so far are a prefix) and 'history' [batch, beams,
    length] int32 (see the class docstring).

    Args:
      key, value: [rows, t, n, h]: t = 1 for a step, rows = batch * beams.

    Returns:
      (keys [batch, n, h, length * beams], values [batch, n, length * beams,
      h], mask [rows, 1, 1, length * beams], number of filled slots) for a
      step; while the cache is created, the inputs' own keys [batch, n, h,
      length] and values [batch, n, length, h], the causal mask and None.
    """
    ready = self.has_variable('cache', 'cached_key')
    rows, length, heads, head_dim = key.shape
    cached_key = self.variable('cache', 'cached_key', jnp.zeros,
                               (rows, heads, head_dim, length), key.dtype)
    cached_value = self.variable('cache', 'cached_value', jnp.zeros,
                                 (rows, heads, length, head_dim), value.dtype)
    history = self.variable('cache', 'history', jnp.zeros, (rows, 1, length),
                            jnp.int32)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not ready:
      positions = jnp.arange(length)
      causal = positions[None, None, None] <= positions[:, None]
      return transposed_keys(key), heads_first(value), causal, None
    if length != 1:
      raise ValueError(f'Cached decoding takes one position per call, got '
                       f'{length}.')
    batch, beams, max_length = history.value.shape
    i = index.value

    def store(cached, new, axis):  # new: position i's `beams` slots on axis.
      return jax.lax.dynamic_update_slice_in_dim(cached, new, i * beams, axis)

    cached_key.value = store(
        cached_key.value,
        transposed_keys(key.reshape(batch, beams, heads, head_dim)), axis=3)
    cached_value.value = store(
        cached_value.value,
        heads_first(value.reshape(batch, beams, heads, head_dim)), axis=2)
    own_slot = jnp.broadcast_to(jnp.arange(beams)[None, :, None],
                                (batch, beams, 1))
    history.value = jax.lax.dynamic_update_slice_in_dim(
        history.value, own_slot, i, axis=2)
    index.value = i + 1
    # Hypothesis q sees slot j of position p if its history says so.
    slots = jnp.arange(beams)
    mask = ((history.value[:, :, :, None] == slots)
            & (jnp.arange(max_length) <= i)[:, None])  # [batch, q, p, j]
    return (cached_key.value, cached_value.value,
            mask.reshape(rows, 1, 1, max_length * beams), (i + 1) * beams)


# ------------------------------------------------- the cache of beams ---

def _leaf_name(path) -> str:
  return str(getattr(path[-1], 'key', path[-1]))


# The slot axis of each widened cache leaf (see `MultiHeadAttention`).
_BEAM_SLOT_AXES = {'cached_key': -1, 'cached_value': -2, 'history': -2}


def repeat_cache_for_beams(cache, beam_size: int):
  """Widens a one-beam decoding cache to `beam_size` hypotheses per
  sentence: cached self-attention keys [..., batch, n, h, length] ->
  [..., batch, n, h, length * beam], values [..., batch, n, length, h] ->
  [..., batch, n, length * beam, h] and their history [..., batch, 1,
  length] -> [..., batch, beam, length] (a leading layers axis with scanned
  layers). Source keys/values stay one copy per sentence."""
  def repeat(path, leaf):
    axis = _BEAM_SLOT_AXES.get(_leaf_name(path))
    return leaf if axis is None else jnp.repeat(leaf, beam_size, axis=axis)
  return jax.tree_util.tree_map_with_path(repeat, cache)


def select_beam_histories(cache, parents: jax.Array):
  """Beam i of each sentence continues hypothesis parents[b, i]: it takes over
  that hypothesis's history of cached positions. parents: [batch, beam]
  int."""
  def select(path, leaf):
    if _leaf_name(path) != 'history':
      return leaf
    index = parents.reshape((1,) * (leaf.ndim - 3) + parents.shape + (1,))
    return jnp.take_along_axis(leaf, index, axis=-2)
  return jax.tree_util.tree_map_with_path(select, cache)
