"""Autoregressive decoding with the models' key/value cache: greedy search and
beam search for `EncoderDecoder`, and sampling (temperature, top-k, top-p) for
`DecoderLM`.

Each search is one `jax.lax.while_loop`, compiled once per config and shapes
(sentences, source length, decode length, beam size); eos_id, alpha and the
sampling settings are traced values, so changing them does not recompile.
Sources are padded with the model's `pad_id`, the decoder starts from its
`decoder_start_id` (jaxformer's vocabularies: 0 for both, `token_ids.py`);
the end-of-sentence id is an argument (`eos_id`, by default the model's;
-1 never ends a sentence, so every step runs). Shapes:
`batch` b, `beam` k, decode length `length`, source length s, vocabulary v.

On CPU, where they were measured to pay, the argmax, the beams' top-k, the
greedy output layer and the batch take the kernels of `model/cpu_kernels.py`
(`backend.cpu_kernel_applies` says where); their results are the same.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.model import backend, cpu_kernels
from jaxformer.model.attention import (repeat_cache_for_beams,
                                       select_beam_histories)
from jaxformer.model.config import ModelConfig
from jaxformer.model.incremental import (StepFn, encoder_outputs, init_cache,
                                      init_lm_cache, lm_step_fn,
                                      translation_step_fn)
from jaxformer.data.token_ids import EOS_ID, PAD_ID  # EOS_ID: re-exported.

NEG_INF = -np.inf
# Defaults of the `decode` config section and of the searches.
BEAM_SIZE = 4
ALPHA = 0.6
MAX_EXTRA_LEN = 50  # Output tokens beyond the longest source.

# ---------------------------------------------------------------- lengths ---

def decode_length(length: int, extra: int = MAX_EXTRA_LEN,
                  max_len: int | None = None, multiple: int = 1) -> int:
  """How many tokens to decode for sources of up to `length` tokens:
  length + extra, rounded up to a multiple of `multiple` (so that few
  lengths compile), capped at `max_len` (the model's `max_len`, as positions
  beyond it have no embedding); at least 1."""
  length = -(-(length + extra) // multiple) * multiple
  return max(1, length if max_len is None else min(length, max_len))


def max_decode_length(inputs, extra: int = MAX_EXTRA_LEN,
                      max_len: int | None = None, pad_id: int = PAD_ID) -> int:
  """`decode_length` of the longest real (non-`pad_id`) source in the batch.
  Host-side: `inputs` must be concrete. inputs: [batch, s] int."""
  longest = int(np.max(np.sum(np.asarray(inputs) != pad_id, axis=-1),
                       initial=0))
  return decode_length(longest, extra, max_len)


def length_penalty(length, alpha: float):
  """GNMT's ((5 + |Y|) / 6) ** alpha; |Y| counts the EOS token."""
  return ((5.0 + length) / 6.0) ** alpha


def _check_decode_length(config: ModelConfig, max_decode_len: int):
  if not 1 <= max_decode_len <= config.max_len:
    raise ValueError(f'max_decode_len={max_decode_len} must be in '
                     f'[1, model max_len={config.max_len}].')


def previous_tokens(tokens: jax.Array, step: jax.Array,
                    start_id: int = PAD_ID) -> jax.Array:
  """The decoder input at `step`: tokens[..., step - 1], or `start_id` (the
  model's decoder_start_id) at step 0. tokens: [..., length] -> [...]."""
  last = jax.lax.dynamic_index_in_dim(tokens, jnp.maximum(step - 1, 0),
                                      axis=-1, keepdims=False)
  return jnp.where(step > 0, last, start_id)


# ---------------------------------------------------- token-by-token loop ---

class TokenLoopState(NamedTuple):
  step: jax.Array      # [] int32: the position being decoded.
  tokens: jax.Array    # [batch, length] int32.
  finished: jax.Array  # [batch] bool: EOS emitted (or nothing to decode).
  cache: Any
  records: Any         # [length, batch, ...] per-step records, or None.


def token_loop(step_fn: StepFn, choose_fn, cache, finished: jax.Array,
               max_decode_len: int, eos_id: int, record_shape=None,
               start_id: int = PAD_ID, pad_id: int = PAD_ID):
  """Decodes one token per row and step until every row has emitted EOS or
  `max_decode_len` tokens.

  Args:
    choose_fn: (step_fn's logits [b, v], step) -> next tokens [b] int32;
      the identity where step_fn returns the tokens themselves.
    finished: [b] bool, rows that produce nothing (all-padding sources).
    record_shape: (shape, dtype) of step_fn's per-step record, or None.
    start_id: the first decoder input; pad_id: what follows EOS.

  Returns:
    (tokens [b, max_decode_len] int32, pad_id after EOS; records
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
        state.cache, previous_tokens(state.tokens, state.step, start_id),
        state.step)
    next_tokens = jnp.where(state.finished, pad_id,
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
                         jnp.full((batch, max_decode_len), pad_id, jnp.int32),
                         finished, cache, records)
  state = jax.lax.while_loop(not_done, body, state)
  return state.tokens, state.records


# ---------------------------------------------------------------- greedy ---

def greedy_choice(logits: jax.Array, step=None) -> jax.Array:
  """[b, v] -> [b] int32: the first index of each row's maximum, a NaN
  counting as the maximum, as `jnp.argmax` (on CPU by
  `cpu_kernels.halving_argmax`)."""
  del step
  if not backend.cpu_kernel_applies('halving_argmax',
                                    backend.platform(logits)):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return cpu_kernels.halving_argmax(logits)


def screens_greedy(config: ModelConfig, inputs: jax.Array) -> bool:
  """Whether greedy decoding of `inputs` [b, s] picks its tokens with
  `cpu_kernels.screened_argmax`: on CPU (where a decoding step is bound by
  memory traffic), for few rows, in float32, with the output layer tied to
  the embedding and without bias."""
  return (backend.cpu_kernel_applies('int8_screen', backend.platform(inputs),
                                     rows=inputs.shape[0])
          and config.compute_dtype == jnp.float32
          and config.share_embeddings != 'none' and not config.output_bias)


@functools.partial(jax.jit, static_argnames=(
    'config', 'max_decode_len', 'return_attention'))
def _greedy_decode(params, inputs, config, max_decode_len, eos_id,
                   return_attention):
  encoded, segment_ids = encoder_outputs(config, params, inputs)
  cache = init_cache(config, params, encoded, segment_ids, max_decode_len)
  choose_fn, output_fn = greedy_choice, None
  if screens_greedy(config, inputs):
    choose_fn = lambda tokens, step: tokens  # noqa: E731
    output_fn = cpu_kernels.screened_tokens
  step_fn = translation_step_fn(config, params, segment_ids, return_attention,
                                output_fn)
  record_shape = None
  if return_attention:
    record_shape = ((inputs.shape[0], config.num_decoder_layers,
                     config.num_heads, inputs.shape[1]), jnp.float32)
  has_source = jnp.any(inputs != config.pad_id, axis=-1)
  tokens, records = token_loop(step_fn, choose_fn, cache, ~has_source,
                               max_decode_len, eos_id, record_shape,
                               config.decoder_start_id, config.pad_id)
  if not return_attention:
    return tokens
  return tokens, jnp.transpose(records, (1, 2, 3, 0, 4))


def greedy_decode(params, config: ModelConfig, inputs, *,
                  max_decode_len: int | None = None,
                  eos_id: int | None = None, return_attention: bool = False,
                  batch_parts: int | None = None):
  """Greedy translation of a batch of sources.

  Args:
    params: `EncoderDecoder` parameters (boxed or plain).
    inputs: [batch, s] int source tokens, right-padded with config.pad_id;
      an all-padding row decodes to pad_id only.
    max_decode_len: defaults to `max_decode_length(inputs,
      max_len=config.max_len)`.
    eos_id: end-of-sentence id (default config.eos_id); -1 never stops
      (every step runs).
    return_attention: also return cross-attention weights.
    batch_parts: decode this many blocks of sentences concurrently
      (`cpu_kernels.search_in_parts`); defaults to
      `cpu_kernels.default_batch_parts(inputs)`.

  Returns:
    tokens [batch, max_decode_len] int32: EOS included, pad_id after it; with
    `return_attention`, (tokens, weights [batch, layers, heads,
    max_decode_len, s] float32, zero after EOS).
  """
  if max_decode_len is None:
    max_decode_len = max_decode_length(inputs, max_len=config.max_len,
                                       pad_id=config.pad_id)
  eos_id = config.eos_id if eos_id is None else eos_id
  _check_decode_length(config, max_decode_len)
  inputs = jnp.asarray(inputs, jnp.int32)
  params = meta.unbox(params)
  return cpu_kernels.search_in_parts(
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


def top_k(values: jax.Array, k: int):
  """`jax.lax.top_k` over the last axis of [rows, n] (on CPU by
  `cpu_kernels.blocked_top_k`): ([rows, k] values, [rows, k] int32
  indices), largest first."""
  if not backend.cpu_kernel_applies('blocked_top_k', backend.platform(values)):
    return jax.lax.top_k(values, k)
  return cpu_kernels.blocked_top_k(values, k)


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
                     max_decode_len: int, early_exit=True,
                     start_id: int = PAD_ID) -> BeamState:
  """Extends every live beam by one token.

  The 2 * beam best extensions are enough to keep `beam` live ones, as at most
  one extension per beam ends in EOS. Extensions ending in EOS that rank among
  the best `beam` enter the finished set with score log p / length_penalty.
  """
  batch, beam, _ = state.alive_tokens.shape
  step = state.step
  logits, cache, _ = step_fn(
      state.cache,
      previous_tokens(state.alive_tokens, step, start_id).reshape(
          batch * beam), step)
  log_probs = jax.nn.log_softmax(logits).reshape(batch, beam, -1)
  vocab = log_probs.shape[-1]

  candidate_logprob = (state.alive_logprob[..., None] + log_probs).reshape(
      batch, beam * vocab)
  top_logprob, top_index = top_k(candidate_logprob, 2 * beam)
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
                       max_decode_len: int, pad_id: int = PAD_ID) -> BeamState:
  """One live beam per sentence (the others at -inf, so the first step
  expands only it); all-padding rows start done, with an empty (all pad_id,
  score 0) result."""
  batch = has_source.shape[0]
  tokens = jnp.full((batch, beam_size, max_decode_len), pad_id, jnp.int32)
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
  encoded, segment_ids = encoder_outputs(config, params, inputs)
  cache = init_cache(config, params, encoded, segment_ids, max_decode_len)
  step_fn = translation_step_fn(
      config, params, jnp.repeat(segment_ids, beam_size, axis=0))
  state = initial_beam_state(
      cache, jnp.any(inputs != config.pad_id, axis=-1), beam_size,
      max_decode_len, config.pad_id)
  step = functools.partial(beam_search_step, step_fn=step_fn, alpha=alpha,
                           eos_id=eos_id, max_decode_len=max_decode_len,
                           early_exit=early_exit,
                           start_id=config.decoder_start_id)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_decode_len) & ~jnp.all(s.done), step, state)
  return (*final_beams(state, max_decode_len, alpha), state.step)


def beam_search(params, config: ModelConfig, inputs, *,
                beam_size: int = BEAM_SIZE, alpha: float = ALPHA,
                max_decode_len: int | None = None,
                eos_id: int | None = None, early_exit: bool = True,
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
      with config.pad_id (an all-padding row returns pad_id with score 0).
    max_decode_len: defaults to `max_decode_length(inputs,
      max_len=config.max_len)`.
    eos_id: default config.eos_id; -1 never ends a hypothesis (every step
      runs).
    early_exit: False runs every step and never freezes a sentence (for
      testing that stopping early changes nothing).
    return_steps: also return how many steps ran ([] int32; with several
      `batch_parts`, the most any part ran).
    batch_parts: decode this many blocks of sentences concurrently
      (`cpu_kernels.search_in_parts`); defaults to
      `cpu_kernels.default_batch_parts(inputs)`.

  Returns:
    (tokens [batch, beam, max_decode_len] int32, best first, pad_id after EOS;
    scores [batch, beam] float32), then the step count if `return_steps`.
  """
  if max_decode_len is None:
    max_decode_len = max_decode_length(inputs, max_len=config.max_len,
                                       pad_id=config.pad_id)
  eos_id = config.eos_id if eos_id is None else eos_id
  _check_decode_length(config, max_decode_len)
  inputs = jnp.asarray(inputs, jnp.int32)
  if beam_size * 2 > config.output_vocab_size:
    raise ValueError('beam_size must be at most half the vocabulary.')
  params = meta.unbox(params)
  tokens, scores, steps = cpu_kernels.search_in_parts(
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
  prompt = jnp.pad(prompt_tokens, ((0, 0), (0, max_decode_len - prompt_width)),
                   constant_values=config.pad_id)
  prompt_length = jnp.sum(prompt_tokens != config.pad_id, axis=-1)

  def choose_fn(logits, step):
    sampled = sample_choice(logits, jax.random.fold_in(rng, step),
                            temperature, top_k, top_p)
    return jnp.where(step < prompt_length, prompt[:, step], sampled)

  cache = init_lm_cache(config, params, batch, max_decode_len)
  tokens, _ = token_loop(lm_step_fn(config, params), choose_fn, cache,
                         jnp.zeros((batch,), bool), max_decode_len, eos_id,
                         start_id=config.decoder_start_id,
                         pad_id=config.pad_id)
  return tokens


def sample(params, config: ModelConfig, prompt_tokens, rng, *,
           max_decode_len: int, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0, eos_id: int | None = None):
  """Samples continuations of prompts from a `DecoderLM`.

  The prompt is fed through the cache one position at a time (the cache takes
  one position per call), then tokens are drawn from
  softmax(logits / temperature) restricted by top-k, then top-p.

  Args:
    prompt_tokens: [batch, p] int, right-padded with config.pad_id (a row of
      padding samples unconditionally); prompts should not contain EOS.
    rng: a PRNG key; the same key gives the same samples.
    max_decode_len: length of the result, prompt included (<= model max_len).
    temperature: 0 picks the argmax (greedy).
    top_k: 0 disables; top_p: 1.0 disables.

  Returns:
    tokens [batch, max_decode_len] int32: prompt, then samples up to and
    including EOS (default config.eos_id), then pad_id.
  """
  eos_id = config.eos_id if eos_id is None else eos_id
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
