"""The loss of the output layer computed over chunks of positions, so that
the [batch, length, vocab] logits never exist whole: `output_token_metrics`
returns `loss.token_metrics`' sums, with a gradient of its own
(`jax.custom_vjp`) that makes each chunk's logits once."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train.loss import is_top


# Each chunk's matmuls have at least this many rows per device (or the
# whole output, if it has fewer): a TPU's matrix units are 128 or 256 wide,
# and every iteration of the loop over chunks costs its own overhead.
MIN_CHUNK_ROWS = 256

# The most logits one chunk makes per device where the device's memory is
# unknown (CPUs): 16 MiB of float32 ([512, 8000] for the `small` config,
# which trains as fast as with the whole [2048, 8000] and needs 12% less
# temporary memory for its step).
CPU_CHUNK_LOGITS = 2 ** 22

# On an accelerator, one chunk's float32 logits take at most this share of
# its memory (a chunk also holds their exponentials and their gradient):
# 256 MiB of a v5e chip's 16 GiB, 1.5 GiB of a v5p's 95.
CHUNK_MEMORY_SHARE = 1 / 64


def chunk_logits_budget(memory_bytes: int | None) -> int:
  """The most float32 logits per device in one chunk of the output layer:
  CHUNK_MEMORY_SHARE of the device's memory, CPU_CHUNK_LOGITS if it is
  unknown (None: a CPU)."""
  if not memory_bytes:
    return CPU_CHUNK_LOGITS
  return max(CPU_CHUNK_LOGITS, int(memory_bytes * CHUNK_MEMORY_SHARE) // 4)


def chunk_span(rows_per_device: int, length: int, vocab: int,
               chunk_logits: int, min_rows: int = MIN_CHUNK_ROWS) -> int:
  """Positions per chunk of a [rows_per_device, length] output (its rows
  on one device): as few chunks as keep each one's [rows_per_device, span,
  vocab] logits within `chunk_logits`, but none of fewer than `min_rows`
  rows per device (one chunk of all `length` if that has fewer); the
  positions spread evenly over the chunks, so that the last pads least."""
  least = min(length, -(-min_rows // rows_per_device))
  most = max(least, chunk_logits // (rows_per_device * vocab))
  chunks = min(-(-length // most), max(1, length // least))
  return -(-length // chunks)


@dataclasses.dataclass(frozen=True)
class OutputChunking:
  """How `output_token_metrics` splits a [batch, length] output."""
  row_shards: int  # Parts the batch's rows are split into (data x fsdp).
  rows_per_device: int
  span: int  # Positions per chunk.
  chunks: int  # The loop's trip count.

  @property
  def chunk_rows_per_device(self) -> int:
    """Rows of each chunk's matmuls on one device."""
    return self.rows_per_device * self.span


def _traced_device():
  """The kind of device of the mesh being traced for (`mesh_lib.activate`),
  else the default device."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, 'abstract_device', None)
  return device or jax.devices()[0]


def output_chunking(batch: int, length: int, vocab: int,
                    chunk_logits: int | None = None,
                    min_rows: int = MIN_CHUNK_ROWS) -> OutputChunking:
  """The chunks of a [batch, length] output over `vocab` on the mesh that
  is current while tracing (`mesh_lib.activate`: its batch axes split the
  rows; one device without a mesh). chunk_logits: the most logits per
  device and chunk; None: `chunk_logits_budget` of the mesh's device."""
  mesh = jax.sharding.get_abstract_mesh()
  shards = 1
  if not mesh.empty and set(mesh_lib.BATCH_SPEC[0]) <= set(mesh.axis_names):
    shards = mesh_lib.row_shards(mesh)
  if batch % shards:
    shards = 1  # Not split over the batch axes as a whole.
  rows = batch // shards
  if chunk_logits is None:
    chunk_logits = chunk_logits_budget(
        mesh_lib.device_memory_bytes(_traced_device()))
  span = chunk_span(rows, length, vocab, chunk_logits, min_rows)
  return OutputChunking(shards, rows, span, -(-length // span))


def output_token_metrics(x: jax.Array, kernel: jax.Array, bias, targets,
                         weights, label_smoothing: float,
                         chunk_logits: int | None = None,
                         min_rows: int = MIN_CHUNK_ROWS):
  """`token_metrics` of the logits x kernel^T + bias, computed over chunks of
  positions so that the [batch, length, vocab] logits never exist whole.

  Chunks are sized per device (`output_chunking`): at least `min_rows`
  rows of each device's share of the batch, more up to the device's logits
  budget, the whole output when it fits. The table is gathered whole
  (under FSDP) once, before the loop.

  Differentiated, each chunk's logits are made once: the forward pass also
  computes the gradient of the loss sums with respect to x, kernel and bias
  (the softmax minus the target, times the output layer), and the backward
  pass only scales it. The matmuls take their operands in the dtype of x
  and the kernel (bfloat16 where the model computes in it) and accumulate
  in float32. Each device sums its own rows' kernel and bias gradients over
  the chunks ([row_shards, vocab, d] in the loop's carry), reduced over
  devices once, after the loop (`wmt14_ende_big` on a v5p-64, fsdp=32,
  compiled: 0.14 GiB of all-reduces per step, where chunks sized by the
  global batch, 256 of 3 rows per chip, all-reduced 144 MiB each, 36 GiB
  per step). A train step holds neither the logits nor
  their gradient: measured, its temporary memory falls from 563 to 494 MiB
  for the `small` config and from 2,261 to 1,886 MiB for `base` (32 x
  (64+64) on CPU), and 65,536 rows of the quickstart fit in 8.0 GiB per v5e
  chip, where their logits alone took 21 GiB. Equal to `token_metrics` of
  the full logits up to float rounding (tests/train/test_chunked_loss.py).

  Args:
    x: [batch, length, d] (the last hidden states); kernel: [vocab, d];
      bias: [vocab] or None; targets: [batch, length] int; weights:
      [batch, length] float32; chunk_logits, min_rows: see
      `output_chunking`.

  Returns:
    token_metrics' sums: 'loss', 'nll', 'correct', 'weight'.
  """
  batch, length, _ = x.shape
  chunking = output_chunking(batch, length, kernel.shape[0], chunk_logits,
                             min_rows)
  span = chunking.span
  pad = chunking.chunks * span - length
  if pad:  # Padded positions weigh 0.
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    weights = jnp.pad(weights, ((0, 0), (0, pad)))
  kernel = nn.with_logical_constraint(kernel, ('vocab', None))
  with jax.named_scope('output_layer'):
    loss, nll, correct = _chunked_output_sums(
        x, kernel, bias, targets, weights.astype(jnp.float32),
        float(label_smoothing), span, chunking.row_shards)
  return {'loss': loss, 'nll': nll, 'correct': correct,
          'weight': jnp.sum(weights)}


def _by_chunk(a: jax.Array, span: int) -> jax.Array:
  """[batch, chunks * span, ...] -> [chunks, batch, span, ...]: the scan runs
  over positions, so a batch sharded over devices stays sharded."""
  return jnp.swapaxes(a.reshape(a.shape[0], -1, span, *a.shape[2:]), 0, 1)


def _from_chunks(a: jax.Array) -> jax.Array:
  a = jnp.swapaxes(a, 0, 1)
  return a.reshape(a.shape[0], -1, *a.shape[3:])


def _by_shard(a: jax.Array, shards: int) -> jax.Array:
  """[batch, ...] -> [shards, batch / shards, ...]: a device's rows."""
  return a.reshape(shards, -1, *a.shape[1:])


def _output_chunk(x, kernel, bias, targets, weights, label_smoothing,
                  with_grads, shards):
  """One chunk's (loss, nll, correct) sums and, with_grads, the gradient of
  the nll sum with respect to x [b, s, d] (float32) and, per row shard, to
  the kernel [shards, vocab, d] and bias [shards, vocab]."""
  with jax.named_scope(f'logits_v{kernel.shape[0]}'):  # hlo.output_layer
    logits = jnp.einsum('bsd,vd->bsv', x, kernel,
                        preferred_element_type=jnp.float32)
  if bias is not None:
    logits += bias.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - top)
  total = jnp.sum(exp, axis=-1)
  log_normalizer = top[..., 0] + jnp.log(total)
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  nll = log_normalizer - target_logit
  loss = nll
  if label_smoothing:
    loss = nll + label_smoothing * (target_logit - jnp.mean(logits, axis=-1))
  correct = is_top(target_logit, top[..., 0])
  sums = (jnp.sum(loss * weights), jnp.sum(nll * weights),
          jnp.sum(correct * weights))
  if not with_grads:
    return sums, None
  vocab = jnp.arange(kernel.shape[0], dtype=targets.dtype)
  # d nll / d logits = weight * (softmax - one_hot(target)).
  d_logits = weights[..., None] * (
      exp / total[..., None] - (targets[..., None] == vocab))
  d_bias = (jnp.zeros((shards, kernel.shape[0]), jnp.float32) if bias is None
            else jnp.sum(_by_shard(d_logits, shards), axis=(1, 2)))
  d_logits = d_logits.astype(jnp.result_type(x.dtype, kernel.dtype))
  d_x = jnp.einsum('bsv,vd->bsd', d_logits, kernel,
                   preferred_element_type=jnp.float32)
  d_kernel = jnp.einsum('nbsv,nbsd->nvd', _by_shard(d_logits, shards),
                        _by_shard(x, shards),
                        preferred_element_type=jnp.float32)
  return sums, (d_x, d_kernel, d_bias)


def _scan_chunks(x, kernel, bias, targets, weights, label_smoothing, span,
                 shards, with_grads):
  def body(carry, chunk):
    sums, grads = _output_chunk(*chunk[:1], kernel, bias, *chunk[1:],
                                label_smoothing, with_grads, shards)
    carry = jax.tree.map(jnp.add, carry,
                         (sums, grads[1:] if with_grads else ()))
    return carry, grads[0] if with_grads else None
  zero = jnp.zeros((), jnp.float32)
  per_shard = ()
  if with_grads:  # Each device's own sums: no reduction inside the loop.
    per_shard = (nn.with_logical_constraint(
        jnp.zeros((shards, *kernel.shape), jnp.float32),
        ('batch', 'vocab', None)),
                 nn.with_logical_constraint(
                     jnp.zeros((shards, kernel.shape[0]), jnp.float32),
                     ('batch', 'vocab')))
  (sums, per_shard), d_x = jax.lax.scan(
      body, ((zero, zero, zero), per_shard),
      (_by_chunk(x, span), _by_chunk(targets, span),
       _by_chunk(weights, span)))
  if not with_grads:
    return sums, None
  # Reduced over the row shards into the table's own sharding: under FSDP
  # a reduce-scatter, not an all-reduce.
  d_kernel = nn.with_logical_constraint(jnp.sum(per_shard[0], axis=0),
                                        ('vocab', 'embed'))
  d_bias = nn.with_logical_constraint(jnp.sum(per_shard[1], axis=0),
                                      ('vocab',))
  return sums, (_from_chunks(d_x), d_kernel, d_bias)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _chunked_output_sums(x, kernel, bias, targets, weights, label_smoothing,
                         span, shards):
  return _scan_chunks(x, kernel, bias, targets, weights, label_smoothing,
                      span, shards, with_grads=False)[0]


def _chunked_output_sums_fwd(x, kernel, bias, targets, weights,
                             label_smoothing, span, shards):
  sums, grads = _scan_chunks(x, kernel, bias, targets, weights,
                             label_smoothing, span, shards, with_grads=True)
  return sums, (grads, x, kernel, bias, targets, weights)


def _chunked_output_sums_bwd(label_smoothing, span, shards, residuals,
                             cotangents):
  """The nll gradient, scaled by the loss and nll cotangents, plus the label
  smoothing term of the loss: d loss / d logits = d nll / d logits
  + eps * weight * (one_hot(target) - 1 / vocab), whose products with x and
  the kernel are a gather and a scatter-add instead of matmuls."""
  del span, shards
  (d_x, d_kernel, d_bias), x, kernel, bias, targets, weights = residuals
  d_loss, d_nll, _ = cotangents
  scale = d_loss + d_nll
  d_x, d_kernel, d_bias = scale * d_x, scale * d_kernel, scale * d_bias
  if label_smoothing:
    eps = d_loss * label_smoothing
    vocab = kernel.shape[0]
    k = kernel.astype(jnp.float32)
    w = weights[..., None]
    d_x += eps * w * (jnp.take(k, targets, axis=0) - jnp.mean(k, axis=0))
    wx = (w * x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    d_kernel += eps * (
        jnp.zeros_like(d_kernel).at[targets.reshape(-1)].add(wx)
        - jnp.sum(wx, axis=0) / vocab)
    d_bias += eps * (
        jnp.zeros_like(d_bias).at[targets.reshape(-1)].add(weights.reshape(-1))
        - jnp.sum(weights) / vocab)
  return (d_x.astype(x.dtype), d_kernel.astype(kernel.dtype),
          None if bias is None else d_bias.astype(bias.dtype), None, None)


_chunked_output_sums.defvjp(_chunked_output_sums_fwd, _chunked_output_sums_bwd)
