"""Autoregressive decoding with the models' key/value cache: greedy search and
beam search for `EncoderDecoder`, and sampling (temperature, top-k, top-p) for
`DecoderLM`.

Each search is one `jax.lax.while_loop`, compiled once per config and shapes
(sentences, source length, decode length, beam size); eos_id, alpha and the
sampling settings are traced values, so changing them does not recompile.
Token 0 is padding and the decoder's start token; the end-of-sentence id is an
argument (`eos_id`; -1 never ends a sentence, so every step runs). Shapes:
`batch` b, `beam` k, decode length `length`, source length s, vocabulary v.

On CPU a decoding step is bound by memory traffic, and the output layer is the
largest matrix it reads: greedy search ranks the vocabulary with an int8 copy
of it instead, and computes float32 logits only for the tokens that can win
(`screened_argmax`). A step is also a chain of operations too small to keep
every core busy: on a single CPU device a batch is decoded as one part per
core, the parts' searches running side by side (`search_in_parts`).
"""
import concurrent.futures
import functools
import os
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.model.backend import cpu_decoding_tricks
from jaxformer.model.config import ModelConfig
from jaxformer.model.layers import FEW_ROWS, matmuls_by_transposed
from jaxformer.model.transformer import DecoderLM, EncoderDecoder

PAD_ID = 0  # Also the decoder's start token.
EOS_ID = 1
NEG_INF = -np.inf

# step_fn(cache, previous_tokens [rows], step []) -> (logits [rows, v], cache,
# record): one decoder position for every row; `record` is an optional per-step
# array (or None) that the loop stores, e.g. attention weights.
StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any, Any]]


# ---------------------------------------------------------------- lengths ---

def max_decode_length(inputs, extra: int = 50,
                      max_len: int | None = None) -> int:
  """Longest real (non-padding) source in the batch plus `extra`, capped at
  `max_len` (the model's `max_len`, as positions beyond it have no
  embedding). Host-side: `inputs` must be concrete. inputs: [batch, s] int."""
  longest = int(np.max(np.sum(np.asarray(inputs) != PAD_ID, axis=-1),
                       initial=0))
  length = longest + extra
  return max(1, length if max_len is None else min(length, max_len))


def length_penalty(length, alpha: float):
  """GNMT's ((5 + |Y|) / 6) ** alpha; |Y| counts the EOS token."""
  return ((5.0 + length) / 6.0) ** alpha


def _check_decode_length(config: ModelConfig, max_decode_len: int):
  if not 1 <= max_decode_len <= config.max_len:
    raise ValueError(f'max_decode_len={max_decode_len} must be in '
                     f'[1, model max_len={config.max_len}].')


# ------------------------------------------------------------------ cache ---

def init_cache(model_config: ModelConfig, params, encoded: jax.Array,
               inputs_segment_ids: jax.Array, max_decode_len: int):
  """The decoding cache of an `EncoderDecoder` for one batch of sources.

  Self-attention keys/values are zeros of length `max_decode_len` (index 0,
  one beam); cross-attention keys/values are projected from `encoded` here,
  once.

  Args:
    encoded: [batch, s, d_model] encoder output.
    inputs_segment_ids: [batch, s] int.
  """
  batch = encoded.shape[0]
  decoder_inputs = jnp.zeros((batch, max_decode_len), jnp.int32)
  # Only shapes matter to the cache this call creates.
  positions = jnp.zeros_like(decoder_inputs)
  _, variables = EncoderDecoder(model_config, decode=True).apply(
      {'params': params}, encoded, inputs_segment_ids, decoder_inputs,
      jnp.ones_like(decoder_inputs), positions, method='decode_logits',
      mutable=['cache'])
  return variables['cache']


def init_lm_cache(model_config: ModelConfig, params, batch_size: int,
                  max_decode_len: int):
  """The decoding cache of a `DecoderLM`: zero keys/values, index 0."""
  decoder_inputs = jnp.zeros((batch_size, max_decode_len), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(max_decode_len), decoder_inputs.shape)
  _, variables = DecoderLM(model_config, decode=True).apply(
      {'params': params}, decoder_inputs, jnp.ones_like(decoder_inputs),
      positions, method='decode_logits', mutable=['cache'])
  return variables['cache']


def _leaf_name(path) -> str:
  return str(getattr(path[-1], 'key', path[-1]))


# The slot axis of each widened cache leaf (see MultiHeadAttention).
_BEAM_SLOT_AXES = {'cached_key': -1, 'cached_value': -2, 'history': -2}


def repeat_cache_for_beams(cache, beam_size: int):
  """Widens a one-beam cache to `beam_size` hypotheses per sentence: cached
  self-attention keys [..., batch, n, h, length] -> [..., batch, n, h,
  length * beam], values [..., batch, n, length, h] -> [..., batch, n,
  length * beam, h] and their history [..., batch, 1, length] -> [..., batch,
  beam, length] (a leading layers axis with scanned layers). Source
  keys/values stay one copy per sentence."""
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


# ------------------------------------------------------------------ steps ---

def cross_attention_weights(intermediates, config: ModelConfig) -> jax.Array:
  """Cross-attention weights of one decode step from the 'intermediates'
  collection: [batch, layers, heads, s]."""
  decoder = intermediates['decoder']
  if config.scan_layers:
    (weights,) = decoder['layers']['cross_attention']['attention_weights']
    return jnp.moveaxis(weights[:, :, :, 0], 0, 1)  # [layers, b, n, 1, s]
  return jnp.stack([
      decoder[f'layer_{i}']['cross_attention']['attention_weights'][0][:, :, 0]
      for i in range(config.num_decoder_layers)], axis=1)


def translation_step_fn(config: ModelConfig, params,
                        inputs_segment_ids: jax.Array,
                        record_attention: bool = False,
                        output_fn=None) -> StepFn:
  """Cached `EncoderDecoder` step. inputs_segment_ids: [rows, s]; with
  `record_attention` the step also returns cross-attention weights
  [rows, layers, heads, s]; with `output_fn` (see `Decoder`) it returns that
  function's result [rows, 1, ...] at position 0 in place of the logits."""
  model = EncoderDecoder(config, decode=True)
  mutable = ['cache', 'intermediates'] if record_attention else ['cache']

  def step_fn(cache, previous_tokens, step):
    ones = jnp.ones((previous_tokens.shape[0], 1), jnp.int32)
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, None, inputs_segment_ids,
        previous_tokens[:, None], ones, ones * step, output_fn,
        method='decode_logits', mutable=mutable)
    record = None
    if record_attention:
      record = cross_attention_weights(variables['intermediates'], config)
    return logits[:, 0], variables['cache'], record
  return step_fn


def lm_step_fn(config: ModelConfig, params) -> StepFn:
  """Cached `DecoderLM` step."""
  model = DecoderLM(config, decode=True)

  def step_fn(cache, previous_tokens, step):
    ones = jnp.ones((previous_tokens.shape[0], 1), jnp.int32)
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, previous_tokens[:, None], ones,
        ones * step, method='decode_logits', mutable=['cache'])
    return logits[:, 0], variables['cache'], None
  return step_fn


def previous_tokens(tokens: jax.Array, step: jax.Array) -> jax.Array:
  """The decoder input at `step`: tokens[..., step - 1], or PAD (the start
  token) at step 0. tokens: [..., length] -> [...]."""
  last = jax.lax.dynamic_index_in_dim(tokens, jnp.maximum(step - 1, 0),
                                      axis=-1, keepdims=False)
  return jnp.where(step > 0, last, PAD_ID)


def encode_sources(config: ModelConfig, params, inputs: jax.Array):
  """inputs [b, s] -> (encoded [b, s, d_model], segment ids [b, s])."""
  segment_ids = (inputs != PAD_ID).astype(jnp.int32)
  encoded = EncoderDecoder(config).apply(
      {'params': params}, inputs, segment_ids, method='encode')
  return encoded, segment_ids


# ---------------------------------------------------- token-by-token loop ---

class TokenLoopState(NamedTuple):
  step: jax.Array      # [] int32: the position being decoded.
  tokens: jax.Array    # [batch, length] int32.
  finished: jax.Array  # [batch] bool: EOS emitted (or nothing to decode).
  cache: Any
  records: Any         # [length, batch, ...] per-step records, or None.


def token_loop(step_fn: StepFn, choose_fn, cache, finished: jax.Array,
               max_decode_len: int, eos_id: int, record_shape=None):
  """Decodes one token per row and step until every row has emitted EOS or
  `max_decode_len` tokens.

  Args:
    choose_fn: (step_fn's logits [b, v], step) -> next tokens [b] int32;
      the identity where step_fn returns the tokens themselves.
    finished: [b] bool, rows that produce nothing (all-padding sources).
    record_shape: (shape, dtype) of step_fn's per-step record, or None.

  Returns:
    (tokens [b, max_decode_len] int32, 0 after EOS; records
    [max_decode_len, b, ...] zero after EOS, or None).
  """
  batch = finished.shape[0]
  records = None
  if record_shape is not None:
    shape, dtype = record_shape
    records = jnp.zeros((max_decode_len, *shape), dtype)

  def not_done(state):
    return (state.step < max_decode_len) & ~jnp.all(state.finished)

  def body(state):
    logits, cache, record = step_fn(
        state.cache, previous_tokens(state.tokens, state.step), state.step)
    next_tokens = jnp.where(state.finished, PAD_ID,
                            choose_fn(logits, state.step))
    records = state.records
    if records is not None:
      live = ~state.finished.reshape((batch,) + (1,) * (record.ndim - 1))
      records = records.at[state.step].set(jnp.where(live, record, 0))
    return TokenLoopState(
        step=state.step + 1,
        tokens=state.tokens.at[:, state.step].set(next_tokens),
        finished=state.finished | (next_tokens == eos_id),
        cache=cache, records=records)

  state = TokenLoopState(jnp.array(0, jnp.int32),
                         jnp.zeros((batch, max_decode_len), jnp.int32),
                         finished, cache, records)
  state = jax.lax.while_loop(not_done, body, state)
  return state.tokens, state.records


def greedy_choice(logits: jax.Array, step=None) -> jax.Array:
  """[b, v] -> [b] int32: the first index of each row's maximum, a NaN
  counting as the maximum, as `jnp.argmax`.

  XLA's CPU backend reduces floats one element at a time (a NaN-propagating
  max does not vectorise), but vectorises elementwise maxima: halving the
  vocabulary with them first takes a [8, 8000] argmax from ~170 us to ~35.
  The halves are taken on the vocabulary-major view, the layout in which
  decoding on CPU computes logits (`layers.matmuls_by_transposed`). NaNs are
  ranked apart, so the result does not depend on how a max reduction treats
  them. Off the CPU (`backend.cpu_decoding_tricks`), plain `jnp.argmax`.
  """
  del step
  if not cpu_decoding_tricks():
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
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
  """`greedy_choice` of the logits x kernel^T, computing float32 logits for
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
    return greedy_choice(matmuls_by_transposed(
        x, [kernel], preferred_element_type=jnp.float32)[0])

  case = jnp.where(jnp.all(count == 1), 0,
                   jnp.where(jnp.all((count >= 1) & (count <= 2)), 1, 2))
  return jax.lax.switch(case, [lambda: first, best_of_two, best_of_all])


def screens_greedy(config: ModelConfig, batch: int) -> bool:
  """Whether greedy decoding picks its tokens with `screened_argmax`: on CPU
  (where a decoding step is bound by memory traffic), for few rows, in
  float32, with the output layer tied to the embedding (so without bias)."""
  return (cpu_decoding_tricks() and batch <= FEW_ROWS
          and config.compute_dtype == jnp.float32
          and config.share_embeddings != 'none')


def _screened_tokens(x, kernel, bias):
  """`Decoder` output_fn: next tokens [b, t] int32 from x [b, t, d]."""
  assert bias is None, 'screened_argmax takes an output layer without bias'
  batch, length, features = x.shape
  tokens = screened_argmax(x.reshape(-1, features), kernel)
  return tokens.reshape(batch, length)


# ---------------------------------------------------- concurrent parts ---

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
  if (isinstance(inputs, jax.core.Tracer) or not cpu_decoding_tricks()
      or jax.device_count() > 1):
    return 1
  return max(1, min(inputs.shape[0], _cpu_cores()))


@functools.cache
def _part_threads() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(
      max(2, _cpu_cores()), thread_name_prefix='jaxformer-decode')


def search_in_parts(search: Callable[[jax.Array], Any], inputs: jax.Array,
                    parts: int | None = None):
  """`search(inputs)` run on `parts` equal blocks of rows concurrently, one
  execution per block; the last block is filled up with all-padding rows.

  Args:
    search: [rows, s] int -> a pytree of [rows, ...] arrays and scalars; an
      all-padding row must not change the other rows' results.
    inputs: [batch, s] int.
    parts: >= 1; None for `default_batch_parts(inputs)`.

  Returns:
    the pytree for the whole batch: arrays joined along rows, scalars (a step
    count) the largest of the blocks'.
  """
  if parts is None:
    parts = default_batch_parts(inputs)
  if parts < 1:
    raise ValueError(f'batch_parts must be at least 1 (1 decodes the batch in '
                     f'one piece), got {parts}.')
  if parts == 1:
    return search(inputs)
  batch = inputs.shape[0]
  rows = -(-batch // parts)
  inputs = jnp.pad(inputs, ((0, rows * parts - batch), (0, 0)))
  blocks = [inputs[i * rows:(i + 1) * rows] for i in range(parts)]
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


# ---------------------------------------------------------------- greedy ---

@functools.partial(jax.jit, static_argnames=(
    'config', 'max_decode_len', 'return_attention'))
def _greedy_decode(params, inputs, config, max_decode_len, eos_id,
                   return_attention):
  encoded, segment_ids = encode_sources(config, params, inputs)
  cache = init_cache(config, params, encoded, segment_ids, max_decode_len)
  choose_fn, output_fn = greedy_choice, None
  if screens_greedy(config, inputs.shape[0]):
    choose_fn, output_fn = (lambda tokens, step: tokens), _screened_tokens
  step_fn = translation_step_fn(config, params, segment_ids, return_attention,
                                output_fn)
  record_shape = None
  if return_attention:
    record_shape = ((inputs.shape[0], config.num_decoder_layers,
                     config.num_heads, inputs.shape[1]), jnp.float32)
  has_source = jnp.any(inputs != PAD_ID, axis=-1)
  tokens, records = token_loop(step_fn, choose_fn, cache, ~has_source,
                               max_decode_len, eos_id, record_shape)
  if not return_attention:
    return tokens
  return tokens, jnp.transpose(records, (1, 2, 3, 0, 4))


def greedy_decode(params, config: ModelConfig, inputs, *,
                  max_decode_len: int | None = None, eos_id: int = EOS_ID,
                  return_attention: bool = False,
                  batch_parts: int | None = None):
  """Greedy translation of a batch of sources.

  Args:
    params: `EncoderDecoder` parameters (boxed or plain).
    inputs: [batch, s] int source tokens, right-padded with 0; an all-padding
      row decodes to zeros.
    max_decode_len: defaults to `max_decode_length(inputs, 50, config.max_len)`.
    eos_id: end-of-sentence id; -1 never stops (every step runs).
    return_attention: also return cross-attention weights.
    batch_parts: decode this many blocks of sentences concurrently
      (`search_in_parts`); defaults to `default_batch_parts(inputs)`.

  Returns:
    tokens [batch, max_decode_len] int32: EOS included, 0 after it; with
    `return_attention`, (tokens, weights [batch, layers, heads,
    max_decode_len, s] float32, zero after EOS).
  """
  if max_decode_len is None:
    max_decode_len = max_decode_length(inputs, max_len=config.max_len)
  _check_decode_length(config, max_decode_len)
  inputs = jnp.asarray(inputs, jnp.int32)
  params = meta.unbox(params)
  return search_in_parts(
      lambda rows: _greedy_decode(params, rows, config, max_decode_len,
                                  jnp.int32(eos_id), return_attention),
      inputs, batch_parts)


# ------------------------------------------------------------ beam search ---

class BeamState(NamedTuple):
  step: jax.Array             # [] int32: the position being decoded.
  alive_tokens: jax.Array     # [batch, beam, length] int32, no EOS yet.
  alive_logprob: jax.Array    # [batch, beam] float32.
  finished_tokens: jax.Array  # [batch, beam, length] int32, ending in EOS.
  finished_score: jax.Array   # [batch, beam] float32, -inf for empty slots.
  done: jax.Array             # [batch] bool: finished set can't change.
  cache: Any                  # rows are batch * beam, sentence-major.


def take_beams(values: jax.Array, indices: jax.Array) -> jax.Array:
  """values [batch, n, ...], indices [batch, m] int -> [batch, m, ...]."""
  return jax.vmap(lambda v, i: v[i])(values, indices)


def blocked_top_k(values: jax.Array, k: int, block: int = 64):
  """`jax.lax.top_k` over the last axis of [rows, n], ties included: the k
  largest lie in the k blocks with the largest maxima, so a sort of k * block
  candidates replaces one of n (XLA's CPU top-k is slow for beam * vocab).
  Off the CPU (`backend.cpu_decoding_tricks`), plain `jax.lax.top_k`.

  Returns:
    ([rows, k] values, [rows, k] int32 indices), largest first.
  """
  rows, n = values.shape
  if n <= k * block or not cpu_decoding_tricks():
    return jax.lax.top_k(values, k)
  padded = jnp.pad(values, ((0, 0), (0, -n % block)),
                   constant_values=-jnp.inf)
  blocks = padded.reshape(rows, -1, block)
  _, best_blocks = jax.lax.top_k(blocks.max(axis=-1), k)
  # In index order, so that ties between candidates go to the lower index.
  best_blocks = jnp.sort(best_blocks, axis=-1)
  candidates = take_beams(blocks, best_blocks).reshape(rows, k * block)
  top, position = jax.lax.top_k(candidates, k)
  block_start = jnp.take_along_axis(best_blocks, position // block, -1) * block
  return top, block_start + position % block


def top_beams(scores: jax.Array, tokens: jax.Array, count: int):
  """The `count` best of [batch, n] scores with their [batch, n, length]
  tokens, best first."""
  best_scores, best = jax.lax.top_k(scores, count)
  return best_scores, take_beams(tokens, best), best


def best_possible_score(alive_logprob: jax.Array, step: jax.Array,
                        max_decode_len: int, alpha: float) -> jax.Array:
  """Upper bound on the final score of any continuation of the live beams:
  log-probabilities only fall, and the penalty is largest at one end of the
  reachable lengths [step + 2, max_decode_len]. -> [batch]."""
  largest_penalty = jnp.maximum(length_penalty(step + 2.0, alpha),
                                length_penalty(float(max_decode_len), alpha))
  return jnp.max(alive_logprob, axis=-1) / largest_penalty


def beam_search_step(state: BeamState, step_fn: StepFn, *, alpha, eos_id,
                     max_decode_len: int, early_exit=True) -> BeamState:
  """Extends every live beam by one token.

  The 2 * beam best extensions are enough to keep `beam` live ones, as at most
  one extension per beam ends in EOS. Extensions ending in EOS that rank among
  the best `beam` enter the finished set with score log p / length_penalty.
  """
  batch, beam, _ = state.alive_tokens.shape
  step = state.step
  logits, cache, _ = step_fn(
      state.cache,
      previous_tokens(state.alive_tokens, step).reshape(batch * beam), step)
  log_probs = jax.nn.log_softmax(logits).reshape(batch, beam, -1)
  vocab = log_probs.shape[-1]

  candidate_logprob = (state.alive_logprob[..., None] + log_probs).reshape(
      batch, beam * vocab)
  top_logprob, top_index = blocked_top_k(candidate_logprob, 2 * beam)
  parent = top_index // vocab
  token = (top_index % vocab).astype(jnp.int32)
  top_tokens = take_beams(state.alive_tokens, parent).at[:, :, step].set(token)
  ends = token == eos_id

  alive_logprob, alive_tokens, alive_pick = top_beams(
      jnp.where(ends, NEG_INF, top_logprob), top_tokens, beam)
  # As in a beam of `beam` hypotheses, only the `beam` best extensions may
  # end; so a single beam ends where greedy search does.
  ends &= jnp.arange(2 * beam) < beam
  cache = select_beam_histories(cache, take_beams(parent, alive_pick))

  ended_score = jnp.where(
      ends, top_logprob / length_penalty(step + 1.0, alpha), NEG_INF)
  finished_score, finished_tokens, _ = top_beams(
      jnp.concatenate([state.finished_score, ended_score], axis=1),
      jnp.concatenate([state.finished_tokens, top_tokens], axis=1), beam)
  finished_score = jnp.where(state.done[:, None], state.finished_score,
                             finished_score)
  finished_tokens = jnp.where(state.done[:, None, None], state.finished_tokens,
                              finished_tokens)
  cannot_improve = jnp.min(finished_score, axis=-1) >= best_possible_score(
      alive_logprob, step, max_decode_len, alpha)
  done = state.done | (early_exit & cannot_improve)
  return BeamState(step + 1, alive_tokens, alive_logprob, finished_tokens,
                   finished_score, done, cache)


def initial_beam_state(cache, has_source: jax.Array, beam_size: int,
                       max_decode_len: int) -> BeamState:
  """One live beam per sentence (the others at -inf, so the first step
  expands only it); all-padding rows start done, with an empty (all 0, score
  0) result."""
  batch = has_source.shape[0]
  tokens = jnp.zeros((batch, beam_size, max_decode_len), jnp.int32)
  first_beam = jnp.arange(beam_size) == 0
  return BeamState(
      step=jnp.array(0, jnp.int32),
      alive_tokens=tokens,
      alive_logprob=jnp.broadcast_to(jnp.where(first_beam, 0.0, NEG_INF),
                                     (batch, beam_size)),
      finished_tokens=tokens,
      finished_score=jnp.where(has_source[:, None], NEG_INF,
                               jnp.zeros((batch, beam_size))),
      done=~has_source,
      cache=repeat_cache_for_beams(cache, beam_size))


def final_beams(state: BeamState, max_decode_len: int, alpha: float):
  """Finished hypotheses, with the live beams of sentences not done competing
  as if truncated at `max_decode_len`. -> (tokens [b, k, length] best first,
  scores [b, k])."""
  beam = state.alive_logprob.shape[1]
  truncated_score = jnp.where(
      state.done[:, None], NEG_INF,
      state.alive_logprob / length_penalty(float(max_decode_len), alpha))
  scores, tokens, _ = top_beams(
      jnp.concatenate([state.finished_score, truncated_score], axis=1),
      jnp.concatenate([state.finished_tokens, state.alive_tokens], axis=1),
      beam)
  return tokens, scores


@functools.partial(jax.jit, static_argnames=(
    'config', 'beam_size', 'max_decode_len'))
def _beam_search(params, inputs, config, beam_size, alpha, max_decode_len,
                 eos_id, early_exit):
  encoded, segment_ids = encode_sources(config, params, inputs)
  cache = init_cache(config, params, encoded, segment_ids, max_decode_len)
  step_fn = translation_step_fn(
      config, params, jnp.repeat(segment_ids, beam_size, axis=0))
  state = initial_beam_state(cache, jnp.any(inputs != PAD_ID, axis=-1),
                             beam_size, max_decode_len)
  step = functools.partial(beam_search_step, step_fn=step_fn, alpha=alpha,
                           eos_id=eos_id, max_decode_len=max_decode_len,
                           early_exit=early_exit)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_decode_len) & ~jnp.all(s.done), step, state)
  return (*final_beams(state, max_decode_len, alpha), state.step)


def beam_search(params, config: ModelConfig, inputs, *, beam_size: int = 4,
                alpha: float = 0.6, max_decode_len: int | None = None,
                eos_id: int = EOS_ID, early_exit: bool = True,
                return_steps: bool = False, batch_parts: int | None = None):
  """Beam search translation with GNMT's length penalty.

  A hypothesis scores log p(Y | X) / ((5 + |Y|) / 6) ** alpha, |Y| counting
  EOS. A sentence stops once no live beam can beat its worst finished
  hypothesis; the loop stops when every sentence has, or after
  `max_decode_len` steps, when live beams compete as truncated hypotheses of
  length `max_decode_len`. With alpha=0, beam_size=1 is greedy search; with
  alpha > 0 a single beam may search on past greedy's EOS while a longer
  hypothesis could still score better.

  Args:
    params: `EncoderDecoder` parameters; inputs: [batch, s] int, right-padded
      with 0 (an all-padding row returns zeros with score 0).
    max_decode_len: defaults to `max_decode_length(inputs, 50, config.max_len)`.
    eos_id: -1 never ends a hypothesis (every step runs).
    early_exit: False runs every step and never freezes a sentence (for
      testing that stopping early changes nothing).
    return_steps: also return how many steps ran ([] int32; with several
      `batch_parts`, the most any part ran).
    batch_parts: decode this many blocks of sentences concurrently
      (`search_in_parts`); defaults to `default_batch_parts(inputs)`.

  Returns:
    (tokens [batch, beam, max_decode_len] int32, best first, 0 after EOS;
    scores [batch, beam] float32), then the step count if `return_steps`.
  """
  if max_decode_len is None:
    max_decode_len = max_decode_length(inputs, max_len=config.max_len)
  _check_decode_length(config, max_decode_len)
  inputs = jnp.asarray(inputs, jnp.int32)
  if beam_size * 2 > config.output_vocab_size:
    raise ValueError('beam_size must be at most half the vocabulary.')
  params = meta.unbox(params)
  tokens, scores, steps = search_in_parts(
      lambda rows: _beam_search(
          params, rows, config, beam_size, jnp.float32(alpha),
          max_decode_len, jnp.int32(eos_id), jnp.bool_(early_exit)),
      inputs, batch_parts)
  return (tokens, scores, steps) if return_steps else (tokens, scores)


# --------------------------------------------------------------- sampling ---

def apply_temperature(logits: jax.Array, temperature) -> jax.Array:
  """logits / temperature; temperature 0 leaves them as they are (the
  caller takes the argmax)."""
  return logits / jnp.where(temperature > 0, temperature, 1.0)


def sorted_descending(logits: jax.Array) -> jax.Array:
  """[..., v] sorted largest first along the last axis."""
  return -jnp.sort(-logits, axis=-1)


def top_k_filter(logits: jax.Array, k) -> jax.Array:
  """Keeps the k largest of [..., v] logits (and ties with the k-th), -inf
  elsewhere; k <= 0 keeps all."""
  vocab = logits.shape[-1]
  kth_largest = jnp.take(sorted_descending(logits), jnp.clip(k, 1, vocab) - 1,
                         axis=-1)[..., None]
  return jnp.where((k > 0) & (logits < kth_largest), NEG_INF, logits)


def top_p_filter(logits: jax.Array, p) -> jax.Array:
  """Nucleus filtering: keeps the smallest set of most probable tokens whose
  probabilities sum to >= p (and ties with its least probable member), -inf
  elsewhere; p >= 1 keeps all. logits: [..., v]."""
  sorted_logits = sorted_descending(logits)
  probs = jax.nn.softmax(sorted_logits, axis=-1)
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  in_nucleus = (mass_before < p).at[..., 0].set(True)
  threshold = jnp.min(jnp.where(in_nucleus, sorted_logits, jnp.inf), axis=-1,
                      keepdims=True)
  return jnp.where((p < 1.0) & (logits < threshold), NEG_INF, logits)


def sample_choice(logits: jax.Array, rng: jax.Array, temperature, top_k,
                  top_p) -> jax.Array:
  """One token per row of [b, v] logits: temperature, then top-k, then top-p;
  temperature 0 is the argmax."""
  filtered = top_p_filter(top_k_filter(apply_temperature(logits, temperature),
                                       top_k), top_p)
  sampled = jax.random.categorical(rng, filtered).astype(jnp.int32)
  return jnp.where(temperature > 0, sampled, greedy_choice(logits))


@functools.partial(jax.jit, static_argnames=('config', 'max_decode_len'))
def _sample(params, prompt_tokens, rng, config, max_decode_len, temperature,
            top_k, top_p, eos_id):
  batch, prompt_width = prompt_tokens.shape
  prompt = jnp.pad(prompt_tokens, ((0, 0), (0, max_decode_len - prompt_width)))
  prompt_length = jnp.sum(prompt_tokens != PAD_ID, axis=-1)

  def choose_fn(logits, step):
    sampled = sample_choice(logits, jax.random.fold_in(rng, step),
                            temperature, top_k, top_p)
    return jnp.where(step < prompt_length, prompt[:, step], sampled)

  cache = init_lm_cache(config, params, batch, max_decode_len)
  tokens, _ = token_loop(lm_step_fn(config, params), choose_fn, cache,
                         jnp.zeros((batch,), bool), max_decode_len, eos_id)
  return tokens


def sample(params, config: ModelConfig, prompt_tokens, rng, *,
           max_decode_len: int, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, eos_id: int = EOS_ID):
  """Samples continuations of prompts from a `DecoderLM`.

  The prompt is fed through the cache one position at a time (the cache takes
  one position per call), then tokens are drawn from
  softmax(logits / temperature) restricted by top-k, then top-p.

  Args:
    prompt_tokens: [batch, p] int, right-padded with 0 (a row of zeros samples
      unconditionally); prompts should not contain EOS.
    rng: a PRNG key; the same key gives the same samples.
    max_decode_len: length of the result, prompt included (<= model max_len).
    temperature: 0 picks the argmax (greedy).
    top_k: 0 disables; top_p: 1.0 disables.

  Returns:
    tokens [batch, max_decode_len] int32: prompt, then samples up to and
    including EOS, then 0.
  """
  _check_decode_length(config, max_decode_len)
  prompt_tokens = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt_tokens.shape[1] > max_decode_len:
    raise ValueError(f'prompt width {prompt_tokens.shape[1]} exceeds '
                     f'max_decode_len={max_decode_len}.')
  if temperature < 0 or not 0.0 < top_p <= 1.0:
    raise ValueError('Need temperature >= 0 and 0 < top_p <= 1.')
  return _sample(meta.unbox(params), prompt_tokens, rng, config,
                 max_decode_len, jnp.float32(temperature), jnp.int32(top_k),
                 jnp.float32(top_p), jnp.int32(eos_id))
