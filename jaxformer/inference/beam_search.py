"""Beam search translation for `EncoderDecoder` with GNMT's length penalty.

One `jax.lax.while_loop` over the positions, compiled once per config and
shapes (sentences, source length, decode length, beam size); eos_id and
alpha are traced values. Lengths, start and padding ids as in `search.py`,
whose defaults (`BEAM_SIZE`, `ALPHA`) these are. Shapes: `batch` b, `beam`
k, decode length `length`, source length s, vocabulary v.

On CPU the beams' top-k and the batch take the kernels of
`model/cpu_kernels.py` (`backend.cpu_kernel_applies` says where); their
results are the same.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax.core import meta

from jaxformer.model import backend, cpu_kernels
from jaxformer.model.attention import (repeat_cache_for_beams,
                                       select_beam_histories)
from jaxformer.model.config import ModelConfig
from jaxformer.model.incremental import (StepFn, encoder_outputs, init_cache,
                                         translation_step_fn)
from jaxformer.data.token_ids import PAD_ID
from jaxformer.inference.search import (ALPHA, BEAM_SIZE, NEG_INF, forced_at,
                                        previous_tokens, translation_arguments)


def length_penalty(length, alpha: float):
  """GNMT's ((5 + |Y|) / 6) ** alpha; |Y| counts the EOS token."""
  return ((5.0 + length) / 6.0) ** alpha


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


def forcing(log_probs: jax.Array, forced_ids, step) -> jax.Array:
  """log_probs [b, k, v] with the tokens forced at `step` (forced_ids
  [b, p], -1 where none; None: none) at log p 0 and every other token of
  their rows at -inf, as Hugging Face forces a token."""
  if forced_ids is None:
    return log_probs
  forced = forced_at(forced_ids, step)
  only = jnp.arange(log_probs.shape[-1]) == forced[:, None, None]
  return jnp.where((forced >= 0)[:, None, None],
                   jnp.where(only, 0.0, NEG_INF), log_probs)


def beam_search_step(state: BeamState, step_fn: StepFn, *, alpha, eos_id,
                     max_decode_len: int, early_exit=True,
                     start_id: int = PAD_ID, forced_ids=None,
                     log_probs_fn=jax.nn.log_softmax) -> BeamState:
  """Extends every live beam by one token.

  The 2 * beam best extensions are enough to keep `beam` live ones, as at most
  one extension per beam ends in EOS. Extensions ending in EOS that rank among
  the best `beam` enter the finished set with score log p / length_penalty.
  forced_ids: [batch, p] int32, the first tokens of each sentence (log p
  0, every other -inf, as Hugging Face forces a token), -1 where none.
  log_probs_fn: step_fn's output [rows, v] -> log-probabilities (the
  identity where step_fn returns them, as an ensemble's does).
  """
  batch, beam, _ = state.alive_tokens.shape
  step = state.step
  logits, cache, _ = step_fn(
      state.cache,
      previous_tokens(state.alive_tokens, step, start_id).reshape(
          batch * beam), step)
  log_probs = forcing(log_probs_fn(logits).reshape(batch, beam, -1),
                      forced_ids, step)
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
def _beam_search(params, inputs, forced_ids, config, beam_size, alpha,
                 max_decode_len, eos_id, early_exit):
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
                           start_id=config.decoder_start_id,
                           forced_ids=forced_ids)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_decode_len) & ~jnp.all(s.done), step, state)
  return (*final_beams(state, max_decode_len, alpha), state.step)


def beam_search(params, config: ModelConfig, inputs, *,
                beam_size: int = BEAM_SIZE, alpha: float = ALPHA,
                max_decode_len: int | None = None,
                eos_id: int | None = None, early_exit: bool = True,
                return_steps: bool = False, batch_parts: int | None = None,
                forced_ids=None):
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
    forced_ids: [batch, p] int (or [batch], or one int), each sentence's
      first tokens, -1 (the default) where searched (`search.greedy_decode`).

  Returns:
    (tokens [batch, beam, max_decode_len] int32, best first, pad_id after EOS;
    scores [batch, beam] float32), then the step count if `return_steps`.
  """
  inputs, max_decode_len, eos_id, forced_ids = translation_arguments(
      config, inputs, max_decode_len, eos_id, forced_ids)
  if beam_size * 2 > config.output_vocab_size:
    raise ValueError('beam_size must be at most half the vocabulary.')
  params = meta.unbox(params)
  tokens, scores, steps = cpu_kernels.search_in_parts(
      lambda rows: _beam_search(
          params, *rows, config, beam_size, jnp.float32(alpha),
          max_decode_len, jnp.int32(eos_id), jnp.bool_(early_exit)),
      (inputs, forced_ids), batch_parts, fill=(config.pad_id, -1))
  return (tokens, scores, steps) if return_steps else (tokens, scores)
