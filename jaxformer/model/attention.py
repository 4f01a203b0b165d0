"""Multi-head attention: self, causal self and cross attention, with
grouped-query attention (fewer key/value heads than query heads), rotary
positions, and a decoding cache; the attention itself is `dot_product`'s.

Shapes: `batch` b, query length t, key length s, query heads n, key/value
heads k, head features h.
"""
import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.model import backend, rotary
from jaxformer.model.config import ModelConfig
from jaxformer.model.dot_product import (einsum_attention, heads_first,
                                         kernel_attention, prefix_attention,
                                         shared_key_attention,
                                         transposed_keys)
from jaxformer.model.layers import Linear, apply_linears
from jaxformer.model.masks import dense_mask


class MultiHeadAttention(nn.Module):
  """Multi-head attention of one kind: 'self', 'causal' (masked self) or 'cross'.

  With rotary positions (config.position_embedding='rope'), 'self' and
  'causal' rotate their queries and keys by the tokens' positions.

  In decode mode, 'causal' keeps keys and values of earlier steps in the
  'cache' collection (k heads each, rotated) and takes one query position per
  call: with decode=True all rows at the same position (the cache's index),
  with decode='rows' each row at its own (`positions`), after a first call
  that may read a whole prompt at once (`_row_cache`); 'cross' computes
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
  decode: bool | str = False  # False, True or 'rows'.

  def _project(self, x, names):
    """[batch, length, d_model] -> [batch, length, n or k, h] for each
    projection in `names`, computed together."""
    return apply_linears(x, [self._projection(name) for name in names])

  def _projection(self, name: str) -> Linear:
    cfg = self.config
    heads = cfg.num_heads if name == 'query' else cfg.kv_heads
    # Fewer key/value heads than query heads have an axis of their own,
    # which the mesh splits only where it divides them (parallel/mesh.py).
    axis = 'heads' if heads == cfg.num_heads else 'kv_heads'
    biased = cfg.use_bias or cfg.qkv_bias
    if name == 'key':
      # A key bias adds the same q.b to every logit of a query, which
      # softmax ignores (zero gradient, no effect); only rotated keys turn
      # it into a different vector at each position.
      biased = biased and cfg.position_embedding == 'rope'
    return Linear((heads, cfg.head_features), (axis, 'kv', 'embed'), cfg,
                  use_bias=biased, projection=name[0],
                  deterministic=self.deterministic, name=name)

  @nn.compact
  def __call__(self, query_inputs, kv_inputs, mask, positions=None):
    """Attends from `query_inputs` to `kv_inputs`.

    Args:
      query_inputs: [batch, t, d_model].
      kv_inputs: [batch, s, d_model]; ignored by 'cross' once its cache exists;
        for 'self' and 'causal', query_inputs itself.
      mask: bool broadcastable to [batch, heads, t, s]; for 'causal' in decode
        mode it is ignored (the cache decides).
      positions: [batch, t] int, the queries' (and for 'self' and 'causal',
        the keys') positions: needed by rotary positions only.

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
      if cfg.position_embedding == 'rope':
        query, key = self._rotate(query, key, positions)
      if self.decode and self.kind == 'causal':
        key_t, value, mask, filled = self._causal_cache(key, value,
                                                        positions)
        if filled is None:
          out, weights = shared_key_attention(query, key_t, value, mask)
        else:
          out, weights = prefix_attention(query, key_t, value, mask, filled)
      else:
        out, weights = self._attend(query, key, value, mask)
    if weights is not None:
      self.sow('intermediates', 'attention_weights', weights)
    return Linear((cfg.d_model,), ('embed', 'heads', 'kv'), cfg, in_ndim=2,
                  use_bias=cfg.use_bias, projection='o',
                  deterministic=self.deterministic, name='out')(out)

  def _rotate(self, query, key, positions):
    """Queries and keys [batch, t, n or k, h] rotated by `positions`."""
    if positions is None:
      raise ValueError("model.position_embedding='rope' needs the tokens' "
                       f'positions in {self.kind} attention.')
    inv_freq = rotary.inverse_frequencies(self.config)
    return (rotary.rotate(query, positions, inv_freq),
            rotary.rotate(key, positions, inv_freq))

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
    """Source keys [batch, k, h, s] (transposed) and values [batch, k, s, h],
    projected once when the cache is created."""
    if not self.has_variable('cache', 'source_key'):
      key, value = self._project(kv_inputs, ['key', 'value'])
      self.put_variable('cache', 'source_key', transposed_keys(key))
      self.put_variable('cache', 'source_value', heads_first(value))
    return (self.get_variable('cache', 'source_key'),
            self.get_variable('cache', 'source_value'))

  def _causal_cache(self, key, value, positions):
    """Stores this step's keys/values and returns what the step attends to.

    The cache is created (zeros, index 0, one beam) by a call whose inputs
    have the maximum decode length; later calls take one position each. It
    holds 'cached_key' [batch, k, h, length * beams] (transposed) and
    'cached_value' [batch, k, length * beams, h] (position-major: slot j of
    position p at p * beams + j, so that a step writes one contiguous block
    and the slots filled so far are a prefix) and 'history' [batch, beams,
    length] int32 (see the class docstring).

    Args:
      key, value: [rows, t, k, h]: t = 1 for a step, rows = batch * beams.
      positions: [rows, t] int, read with decode='rows' only.

    Returns:
      (keys [batch, k, h, length * beams], values [batch, k, length * beams,
      h], mask [rows, 1, 1, length * beams], number of filled slots) for a
      step; while the cache is created, the inputs' own keys [batch, k, h,
      length] and values [batch, k, length, h], the causal mask and None.
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
    if self.decode == 'rows':
      return _row_cache(cached_key, cached_value, key, value, positions)
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


def _row_cache(cached_key, cached_value, key, value, positions):
  """`_causal_cache` of decode='rows' (one beam), each row at its own
  position, the slot of position p being p.

  A call of t > 1 positions is a prefill: the rows' inputs from position 0,
  whose keys/values fill slots 0..t-1 at once and which attend causally among
  themselves (a row's padding after its prompt fills slots that its later
  steps overwrite before they see them). A call of one position p_r per row
  writes slot p_r of row r and attends to its slots 0..p_r.

  Args:
    cached_key, cached_value: the cache's variables, [rows, k, h, length]
      and [rows, k, length, h].
    key, value: [rows, t, k, h]; positions: [rows, t] int.
  """
  key_t, value = transposed_keys(key), heads_first(value)
  rows, _, _, length = key_t.shape
  if length > 1:
    cached_key.value = jax.lax.dynamic_update_slice_in_dim(
        cached_key.value, key_t, 0, axis=3)
    cached_value.value = jax.lax.dynamic_update_slice_in_dim(
        cached_value.value, value, 0, axis=2)
    slots = jnp.arange(length)
    return key_t, value, slots[None, None, None] <= slots[:, None], None
  slot = positions[:, 0]

  def store(cached, new, axis):  # Row r's new slot at slot[r] of `axis`.
    return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(
        c, n, s, axis - 1))(cached, new, slot)

  cached_key.value = store(cached_key.value, key_t, 3)
  cached_value.value = store(cached_value.value, value, 2)
  max_length = cached_value.value.shape[2]
  mask = jnp.arange(max_length)[None] <= slot[:, None]
  return (cached_key.value, cached_value.value,
          mask.reshape(rows, 1, 1, max_length), jnp.max(slot) + 1)


# ------------------------------------------------- the cache of beams ---

def _leaf_name(path) -> str:
  return str(getattr(path[-1], 'key', path[-1]))


# The slot axis of each widened cache leaf (see `MultiHeadAttention`).
_BEAM_SLOT_AXES = {'cached_key': -1, 'cached_value': -2, 'history': -2}


def repeat_cache_for_beams(cache, beam_size: int):
  """Widens a one-beam decoding cache to `beam_size` hypotheses per
  sentence: cached self-attention keys [..., batch, k, h, length] ->
  [..., batch, k, h, length * beam], values [..., batch, k, length, h] ->
  [..., batch, k, length * beam, h] and their history [..., batch, 1,
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
