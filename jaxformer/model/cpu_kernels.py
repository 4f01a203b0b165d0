"""Decoding kernels for XLA's CPU backend (where each applies is decided in
`backend.cpu_kernel_applies`).

A decoding step on a CPU is bound by memory traffic and is a chain of
operations too small to keep every core busy; XLA's CPU backend also
reduces floats one element at a time, copies the right-hand operand of a
matmul at every call and sorts slowly. Each kernel here works around one of
these, was measured on CPUs only, and returns exactly what the plain path
(`jnp.argmax`, `lax.top_k`, `x @ kernel.T`, one whole-cache read, one
batch) returns. Off a CPU the plain path runs.

The platform is that of the program being built (`backend.platform`): a
decode step compiled on a CPU host for TPU devices takes the plain path.
"""
import concurrent.futures
import functools
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model import backend

# Cache slots per prefix bucket (measured: a 64-slot greedy cache is fastest
# read whole, a 256-slot beam cache in four buckets), and the most buckets.
SLOTS_PER_BUCKET = 64
MAX_BUCKETS = 4
# Candidates per block of `blocked_top_k`.
TOP_K_BLOCK = 64

# ------------------------------------------------------------ matmuls ---

def transposed_matmuls(x: jax.Array, kernels, preferred_element_type=None
                       ) -> list[jax.Array]:
  """x kernel^T for each kernel, as one product (K x^T)^T with K the kernels
  stacked: [rows, in] x [out_k, in] -> [rows, out_k].

  XLA's CPU matmul copies and transposes its right-hand operand at every
  call, which for weights costs more than the product itself, and one
  product streams the weights from memory faster than several small ones.
  The barriers keep XLA from folding the transposes back into the usual
  form; inside a decoding loop, XLA stacks the kernels once, before the loop.
  """
  stacked = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels)
  x_t = jax.lax.optimization_barrier(x.T)
  y = jax.lax.optimization_barrier(jnp.einsum(
      'oi,ir->or', stacked, x_t,
      preferred_element_type=preferred_element_type)).T
  ends = np.cumsum([kernel.shape[0] for kernel in kernels])
  return [y[:, end - kernel.shape[0]:end] for kernel, end in zip(kernels, ends)]


# ------------------------------------------------------------- argmax ---

def halving_argmax(logits: jax.Array) -> jax.Array:
  """`jnp.argmax` over the last axis of [b, v] (the first maximum, a NaN
  counting as the maximum) -> [b] int32.

  XLA's CPU backend reduces floats one element at a time (a NaN-propagating
  max does not vectorise), but vectorises elementwise maxima: halving the
  vocabulary with them first takes a [8, 8000] argmax from ~170 us to ~35.
  The halves are taken on the vocabulary-major view, the layout in which
  `transposed_matmuls` computes logits. NaNs are ranked apart, so the result
  does not depend on how a max reduction treats them.
  """
  by_token = logits.T  # [v, b]
  best = by_token
  while best.shape[0] % 2 == 0 and best.shape[0] > 128:
    half = best.shape[0] // 2
    best = jnp.maximum(best[:half], best[half:])
  best = best.max(axis=0)
  # Ranks: a NaN's index, else a maximum's index + v, else 2v.
  vocab = by_token.shape[0]
  index = jnp.arange(vocab, dtype=jnp.int32)[:, None]
  rank = jnp.where(jnp.isnan(by_token), index,
                   jnp.where(by_token == best, index + vocab, 2 * vocab))
  first = rank.min(axis=0)
  return jnp.where(first < vocab, first, first - vocab)


def int8_candidates(x: jax.Array, kernel: jax.Array):
  """The tokens that can have the largest float32 logit x kernel^T, screened
  by an int8 product, a quarter of the float32 one's memory traffic.

  With kernel rows w = s q + e and x = s_x p + e_x (q, p int8), each logit
  x.w differs from s s_x p.q by s_x p.e + e_x.w, at most
  B = |s_x p| max|e| + |e_x| max|w| (2-norms), and the float32 product from
  the exact one by at most r = 2 d 2^-24 |x| max|w| (which also covers the
  rounding of these statistics). So the token with the largest float32 logit
  has p.q >= max(p.q) - 2 (B + r) / (s s_x): it is among the tokens that pass
  that test. (p.q is exact in int32 for d < 133,000.)

  The int8 table depends on the kernel only: in a decoding loop XLA makes it
  once, before the loop.

  Args:
    x: [rows, d] float32; kernel: [v, d] float32.

  Returns:
    (count, first, last), [rows] int32 each: how many tokens pass, the first
    and the last of them; count is 0 where x or the kernel has NaN or inf.
  """
  vocab, features = kernel.shape
  scale = jnp.max(jnp.abs(kernel)) / 127
  scale = jnp.where(scale > 0, scale, 1.0)
  kernel_q = jnp.rint(kernel * (1 / scale))  # rint vectorises; round doesn't.
  kernel_error = jnp.max(jnp.linalg.norm(kernel - scale * kernel_q, axis=1))
  kernel_norm = jnp.max(jnp.linalg.norm(kernel, axis=1))

  x = jax.lax.optimization_barrier(x)  # Computed once, not in every use.
  x_scale = jnp.max(jnp.abs(x), axis=1, keepdims=True) / 127  # [rows, 1]
  x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
  x_q = jnp.rint(x * (1 / x_scale))
  bound = (jnp.linalg.norm(x_scale * x_q, axis=1) * kernel_error
           + jnp.linalg.norm(x - x_scale * x_q, axis=1) * kernel_norm
           + 2 * features * 2.0**-24 * jnp.linalg.norm(x, axis=1)
           * kernel_norm)  # [rows]
  slack = jnp.minimum(2 * bound / (scale * x_scale[:, 0]), 2.0**30)
  # kernel_q x_q^T: the int8 product that XLA's CPU backend runs natively.
  scores = jax.lax.dot_general(
      kernel_q.astype(jnp.int8), x_q.astype(jnp.int8), (((1,), (1,)), ((), ())),
      preferred_element_type=jnp.int32)  # [v, rows]
  passes = scores >= (jnp.max(scores, axis=0)
                      - jnp.ceil(slack).astype(jnp.int32) - 1)
  index = jnp.arange(vocab, dtype=jnp.int32)[:, None]
  count, first, last = jax.lax.reduce(  # One pass over the scores.
      (passes.astype(jnp.int32), jnp.where(passes, index, vocab),
       jnp.where(passes, index, -1)), (0, vocab, -1),
      lambda a, b: (a[0] + b[0], jnp.minimum(a[1], b[1]),
                    jnp.maximum(a[2], b[2])), (0,))
  return jnp.where(jnp.isfinite(bound), count, 0), first, last


def screened_argmax(x: jax.Array, kernel: jax.Array) -> jax.Array:
  """`halving_argmax` of the logits x kernel^T, computing float32 logits for
  at most two tokens a row: [rows, d] x [v, d] float32 -> [rows] int32.

  Where `int8_candidates` leaves one token in every row, that is the answer;
  where it leaves one or two, their float32 logits decide (ties to the
  first); otherwise (a near tie, NaN or inf) the step computes all the
  logits. Two logits within rounding error of each other may order
  differently than in the full product, as between any two matmul kernels.
  """
  count, first, last = int8_candidates(x, kernel)

  def best_of_two():
    candidates = jnp.take(kernel, jnp.stack([first, last], axis=1), axis=0,
                          mode='clip')  # [rows, 2, d]
    logits = jnp.einsum('rkd,rd->rk', candidates, x)
    return jnp.where(logits[:, 1] > logits[:, 0], last, first)

  def best_of_all():
    return halving_argmax(transposed_matmuls(
        x, [kernel], preferred_element_type=jnp.float32)[0])

  case = jnp.where(jnp.all(count == 1), 0,
                   jnp.where(jnp.all((count >= 1) & (count <= 2)), 1, 2))
  return jax.lax.switch(case, [lambda: first, best_of_two, best_of_all])


def screened_tokens(x: jax.Array, kernel: jax.Array, bias) -> jax.Array:
  """`Decoder` output_fn: next tokens [b, t] int32 from x [b, t, d], by
  `screened_argmax`."""
  if bias is not None:
    raise ValueError('screened_argmax takes an output layer without bias.')
  batch, length, features = x.shape
  tokens = screened_argmax(x.reshape(-1, features), kernel)
  return tokens.reshape(batch, length)


# -------------------------------------------------------------- top-k ---

def blocked_top_k(values: jax.Array, k: int, block: int = TOP_K_BLOCK):
  """`jax.lax.top_k` over the last axis of [rows, n], ties included: the k
  largest lie in the k blocks with the largest maxima, so a sort of k * block
  candidates replaces one of n (XLA's CPU top-k is slow for beam * vocab).

  Returns:
    ([rows, k] values, [rows, k] int32 indices), largest first.
  """
  rows, n = values.shape
  if n <= k * block:
    return jax.lax.top_k(values, k)
  padded = jnp.pad(values, ((0, 0), (0, -n % block)),
                   constant_values=-jnp.inf)
  blocks = padded.reshape(rows, -1, block)
  _, best_blocks = jax.lax.top_k(blocks.max(axis=-1), k)
  # In index order, so that ties between candidates go to the lower index.
  best_blocks = jnp.sort(best_blocks, axis=-1)
  candidates = jax.vmap(lambda v, i: v[i])(blocks, best_blocks).reshape(
      rows, k * block)
  top, position = jax.lax.top_k(candidates, k)
  block_start = jnp.take_along_axis(best_blocks, position // block, -1) * block
  return top, block_start + position % block


# ---------------------------------------------------- cache prefixes ---

def prefix_buckets(slots: int) -> int:
  """How many static prefix lengths a cache of `slots` slots is read in:
  one per `SLOTS_PER_BUCKET` slots, at most `MAX_BUCKETS`."""
  return min(MAX_BUCKETS, slots // SLOTS_PER_BUCKET)


def read_prefix(attend, query, key_t, value, mask, filled, buckets: int):
  """attend(query, key_t[..., :size], value[:, :, :size], mask[..., :size])
  for the smallest of `buckets` static sizes that covers `filled` slots, one
  `lax.switch` branch each, with its weights zero-padded to the whole cache.

  Each branch copies its prefix of the cache before its matmuls, which only
  pays on long caches (`prefix_buckets`); a decoding step then reads on
  average little more than half of the cache.

  Args:
    attend: (query, key_t, value, mask) -> (out, weights [rows, n, t, size]).
    key_t: [batch, n, h, s]; value: [batch, n, s, h]; mask: [..., s].
    filled: [] int, 1 <= filled <= s; slots beyond it must be masked out.
  """
  slots = value.shape[2]
  sizes = sorted({-(-slots * (j + 1) // buckets) for j in range(buckets)})

  def branch(size):
    def read(query, key_t, value, mask):
      out, weights = attend(query, key_t[..., :size], value[:, :, :size],
                            mask[..., :size])
      return out, jnp.pad(weights, [(0, 0)] * 3 + [(0, slots - size)])
    return read

  bucket = jnp.searchsorted(jnp.asarray(sizes), filled)
  return jax.lax.switch(bucket, [branch(size) for size in sizes],
                        query, key_t, value, mask)


# ------------------------------------------------------- batch parts ---

def _cpu_cores() -> int:
  if hasattr(os, 'sched_getaffinity'):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def default_batch_parts(inputs: jax.Array) -> int:
  """How many parts of a batch a search decodes side by side: one per core
  (at most one per sentence) on a single CPU device; 1 under a trace, on
  accelerators, and with several devices (whose batches are sharded over a
  mesh instead, and whose executions must run in the same order everywhere).

  A decoding step on CPU is a chain of small operations, none big enough to
  keep every core busy, so one search leaves cores idle between them;
  searches on parts of the batch, run as separate executions from separate
  threads, fill those gaps. On 2 cores (the decode benchmark), 2 parts made
  greedy search 1.3x and beam search 1.45x as fast; 4 parts were slower than
  one. No sentence's result depends on the rest of its batch, so the results
  are the same.
  """
  if (isinstance(inputs, jax.core.Tracer)
      or not backend.cpu_kernel_applies('batch_parts',
                                         backend.platform(inputs))
      or jax.device_count() > 1):
    return 1
  return max(1, min(inputs.shape[0], _cpu_cores()))


@functools.cache
def _part_threads() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(
      max(2, _cpu_cores()), thread_name_prefix='jaxformer-decode')


def search_in_parts(search: Callable[[jax.Array], Any], inputs: jax.Array,
                    parts: int | None = None, fill: Any = 0):
  """`search(inputs)` run on `parts` equal blocks of rows concurrently, one
  execution per block; the last block is filled up with all-padding rows.

  Args:
    search: [rows, s] int (or a pytree of [rows, ...] arrays, as `inputs`)
      -> a pytree of [rows, ...] arrays and scalars; an all-padding row must
      not change the other rows' results.
    inputs: [batch, s] int, or a pytree of [batch, ...] arrays whose first
      leaf is that.
    parts: >= 1; None for `default_batch_parts(inputs)`.
    fill: what the filler rows hold: one number, or one per leaf of
      `inputs` (the padding id for tokens).

  Returns:
    the pytree for the whole batch: arrays joined along rows, scalars (a step
    count) the largest of the blocks'.
  """
  first = jax.tree.leaves(inputs)[0]
  if parts is None:
    parts = default_batch_parts(first)
  if parts < 1:
    raise ValueError(f'batch_parts must be at least 1 (1 decodes the batch in '
                     f'one piece), got {parts}.')
  if parts == 1:
    return search(inputs)
  batch = first.shape[0]
  rows = -(-batch // parts)
  fill = jax.tree.map(lambda _: fill, inputs) if jnp.isscalar(fill) else fill
  inputs = jax.tree.map(lambda x, value: jnp.pad(
      x, ((0, rows * parts - batch),) + ((0, 0),) * (x.ndim - 1),
      constant_values=value), inputs, fill)
  blocks = [jax.tree.map(lambda x, i=i: x[i * rows:(i + 1) * rows], inputs)
            for i in range(parts)]
  # Each thread waits for its own execution: that is what makes them run
  # side by side rather than one after another.
  results = [future.result() for future in [
      _part_threads().submit(lambda b: jax.block_until_ready(search(b)), b)
      for b in blocks]]

  def join(*leaves):
    if leaves[0].ndim == 0:
      return functools.reduce(jnp.maximum, leaves)
    return jnp.concatenate(leaves)[:batch]
  return jax.tree.map(join, *results)
