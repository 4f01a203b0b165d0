"""Which keys each query may attend to: padding, packed examples and
causality, as a dense bool mask or as the segment ids kernels take.

Shapes: `batch` b, query length t, key length s, heads n.
"""
import jax
import jax.numpy as jnp
from flax import struct


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


def masked_value(dtype) -> float:
  """The logit of a masked key: large but finite, so that a fully masked row
  (a padding query) softmaxes to a uniform distribution instead of NaN, as
  jax.nn.dot_product_attention does."""
  return -0.7 * float(jnp.finfo(dtype).max)
