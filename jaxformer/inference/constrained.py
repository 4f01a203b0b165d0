"""Lexically constrained beam search (`translate --constraints`): every
translation contains each of its target phrases, by dynamic beam
allocation (Post & Vilar 2018; Hu et al. 2019, as fairseq's
`--constraints` does).

Each hypothesis carries which of its sentence's phrases it has met and the
phrase it is in the middle of (`met` [b, k, c], `current`, `position`):
a token that continues the current phrase advances it, one that starts an
unmet phrase starts it, any other leaves none in progress. At each step the
candidates are the 2 * beam best extensions (those of plain beam search)
and, for every hypothesis, the next token of each phrase and its own best
token (other than EOS). Candidates are
grouped in banks by how many phrase tokens they have met, and the beam is
filled round robin across the banks, fullest first: the best of every
bank, then the second best, ... So a hypothesis that meets one more token
always keeps a place. EOS is allowed only once every phrase is met, and
only such hypotheses finish or compete when the length runs out. A row
without phrases decodes as plain beam search does.

The search takes an ensemble's members as `ensemble.py`'s searches do
(the mean of their log-probabilities) and forced first tokens as
`beam_search` does (a target prefix, a many-to-many model's language
token); a forced token meets a phrase as any other token does.

Shapes: batch b, beam k, phrases c (per sentence, -1 padded), phrase
tokens l, decode length `length`, vocabulary v.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.inference import beam_search as beams
from jaxformer.inference import ensemble, search, target_prefix
from jaxformer.inference.search import NEG_INF, decode_length, previous_tokens
from jaxformer.model.attention import select_beam_histories
from jaxformer.model.config import ModelConfig


class ConstrainedState(NamedTuple):
  beam: beams.BeamState
  met: jax.Array       # [b, k, c] bool: phrase met.
  current: jax.Array   # [b, k] int32: the phrase in progress, -1 none.
  position: jax.Array  # [b, k] int32: its tokens met so far.


def advance(phrases, lengths, met, current, position, token):
  """The constraint state after `token`, elementwise over leading axes.
  phrases [..., c, l] int32 (-1 padded), lengths [..., c]; met [..., c],
  current, position, token [...] -> (met, current, position)."""
  c = phrases.shape[-2]
  index = jnp.maximum(current, 0)
  expected = jnp.take_along_axis(
      jnp.take_along_axis(phrases, index[..., None, None], axis=-2)[..., 0, :],
      jnp.minimum(position, phrases.shape[-1] - 1)[..., None], axis=-1)[..., 0]
  continues = (current >= 0) & (token == expected)
  starts = ~met & (phrases[..., 0] == token[..., None]) & (lengths > 0)
  first = jnp.argmax(starts, axis=-1).astype(jnp.int32)
  new_current = jnp.where(continues, current,
                          jnp.where(starts.any(-1), first, -1))
  new_position = jnp.where(continues, position + 1,
                           jnp.where(starts.any(-1), 1, 0))
  length = jnp.take_along_axis(lengths, jnp.maximum(new_current, 0)[..., None],
                               axis=-1)[..., 0]
  done = (new_current >= 0) & (new_position >= length)
  met = met | (done[..., None] & (jnp.arange(c) == new_current[..., None]))
  return (met, jnp.where(done, -1, new_current),
          jnp.where(done, 0, new_position))


def met_tokens(lengths, met, position):
  """How many phrase tokens a hypothesis has met: its bank. -> [...]."""
  return jnp.sum(jnp.where(met, lengths, 0), -1) + position


def _rank_in_bank(bank, score):
  """Each candidate's rank by score among those of its bank (ties: the
  earlier first). bank, score [b, n] -> [b, n] int32."""
  n = bank.shape[-1]
  order = jnp.arange(n)
  same = bank[:, :, None] == bank[:, None, :]
  better = (score[:, None, :] > score[:, :, None]) | (
      (score[:, None, :] == score[:, :, None]) & (order < order[:, None]))
  return jnp.sum(same & better, -1).astype(jnp.int32)


def constrained_step(state: ConstrainedState, step_fn, phrases, lengths, *,
                     alpha, eos_id, max_decode_len: int, start_id: int,
                     forced_ids=None, log_probs_fn=jax.nn.log_softmax
                     ) -> ConstrainedState:
  """Extends every live hypothesis by one token (the module docstring);
  forced_ids and log_probs_fn as `beam_search.beam_search_step` takes
  them (a forced token meets phrases as any other does)."""
  old = state.beam
  batch, beam, _ = old.alive_tokens.shape
  step = old.step
  logits, cache, _ = step_fn(
      old.cache, previous_tokens(old.alive_tokens, step, start_id).reshape(
          batch * beam), step)
  log_probs = beams.forcing(log_probs_fn(logits).reshape(batch, beam, -1),
                            forced_ids, step)
  vocab = log_probs.shape[-1]
  all_met = jnp.all(state.met | (lengths[:, None, :] == 0), -1)
  log_probs = jnp.where((jnp.arange(vocab) == eos_id) & ~all_met[..., None],
                        NEG_INF, log_probs)
  scores = old.alive_logprob[..., None] + log_probs
  top_score, top_index = beams.top_k(scores.reshape(batch, beam * vocab),
                                     2 * beam)
  # The next token of each phrase, from every hypothesis.
  index = jnp.where(state.current[..., None] >= 0,
                    state.current[..., None], jnp.arange(phrases.shape[1]))
  position = jnp.where(state.current[..., None] >= 0,
                       state.position[..., None], 0)
  phrase_token = jnp.take_along_axis(
      jnp.take_along_axis(phrases[:, None], index[..., None], axis=2),
      position[..., None], axis=3)[..., 0]  # [b, k, c]
  usable = (phrase_token >= 0) & jnp.where(
      state.current[..., None] >= 0,
      jnp.arange(phrases.shape[1]) == 0, ~state.met)
  phrase_score = jnp.where(usable, jnp.take_along_axis(
      scores, jnp.maximum(phrase_token, 0), axis=-1), NEG_INF)
  # And each hypothesis's best token other than EOS, so that every one may
  # go on (one that met all its phrases may rank low overall).
  own_token = jnp.argmax(jnp.where(jnp.arange(vocab) == eos_id, NEG_INF,
                                   scores), -1).astype(jnp.int32)
  own_score = jnp.take_along_axis(scores, own_token[..., None], -1)[..., 0]
  beam_ids = jnp.broadcast_to(jnp.arange(beam), (batch, beam))
  parent = jnp.concatenate([
      top_index // vocab,
      jnp.repeat(beam_ids, phrases.shape[1], axis=1), beam_ids], axis=1)
  token = jnp.concatenate([
      top_index % vocab, jnp.maximum(phrase_token, 0).reshape(batch, -1),
      own_token], axis=1).astype(jnp.int32)
  score = jnp.concatenate([top_score, phrase_score.reshape(batch, -1),
                           own_score], axis=1)
  n = score.shape[1]
  # A (parent, token) met before (as a candidate) is the same hypothesis.
  seen = jnp.any((parent[:, :, None] == parent[:, None, :])
                 & (token[:, :, None] == token[:, None, :])
                 & (jnp.arange(n)[None, :] < jnp.arange(n)[:, None])
                 & jnp.isfinite(score)[:, None, :], -1)
  score = jnp.where(seen, NEG_INF, score)

  take = lambda values: beams.take_beams(values, parent)  # noqa: E731
  met, current, position = advance(
      phrases[:, None], lengths[:, None], take(state.met),
      take(state.current), take(state.position), token)
  # As in plain beam search, only the `beam` best extensions may end.
  live = jnp.where(token == eos_id, NEG_INF, score)
  ends = (token == eos_id) & (jnp.arange(n) < beam)
  bank = met_tokens(lengths[:, None], met, position)
  rank = _rank_in_bank(bank, live)
  most = jnp.sum(lengths, -1, keepdims=True) + 1
  key = jnp.where(jnp.isfinite(live), rank * most + (most - 1 - bank),
                  jnp.iinfo(jnp.int32).max // 2 + jnp.arange(n))
  _, chosen = jax.lax.top_k(-key, beam)
  tokens = take(old.alive_tokens).at[:, :, step].set(token)
  alive_tokens = beams.take_beams(tokens, chosen)
  alive_logprob = beams.take_beams(live, chosen)
  cache = select_beam_histories(cache, beams.take_beams(parent, chosen))

  ended_score = jnp.where(
      ends, score / beams.length_penalty(step + 1.0, alpha), NEG_INF)
  finished_score, finished_tokens, _ = beams.top_beams(
      jnp.concatenate([old.finished_score, ended_score], axis=1),
      jnp.concatenate([old.finished_tokens, tokens], axis=1), beam)
  finished_score = jnp.where(old.done[:, None], old.finished_score,
                             finished_score)
  finished_tokens = jnp.where(old.done[:, None, None], old.finished_tokens,
                              finished_tokens)
  cannot_improve = jnp.min(finished_score, axis=-1) >= (
      beams.best_possible_score(alive_logprob, step, max_decode_len, alpha))
  pick = lambda values: beams.take_beams(values, chosen)  # noqa: E731
  return ConstrainedState(
      beams.BeamState(step + 1, alive_tokens, alive_logprob, finished_tokens,
                      finished_score, old.done | cannot_improve, cache),
      pick(met), pick(current), pick(position))


@functools.partial(jax.jit, static_argnames=('configs', 'beam_size',
                                             'max_decode_len'))
def _search(params, inputs, phrases, forced_ids, configs, beam_size, alpha,
            max_decode_len, eos_id):
  lengths = jnp.sum(phrases >= 0, -1).astype(jnp.int32)
  cache, step_fn, log_probs_fn = ensemble.member_steps(
      configs, params, inputs, max_decode_len, beam_size)
  batch, c = phrases.shape[:2]
  config = configs[0]
  state = ConstrainedState(
      beams.initial_beam_state(
          cache, jnp.any(inputs[0] != config.pad_id, axis=-1), beam_size,
          max_decode_len, config.pad_id),
      jnp.zeros((batch, beam_size, c), bool),
      jnp.full((batch, beam_size), -1, jnp.int32),
      jnp.zeros((batch, beam_size), jnp.int32))
  step = functools.partial(
      constrained_step, step_fn=step_fn, phrases=phrases, lengths=lengths,
      alpha=alpha, eos_id=eos_id, max_decode_len=max_decode_len,
      start_id=config.decoder_start_id, forced_ids=forced_ids,
      log_probs_fn=log_probs_fn)
  state = jax.lax.while_loop(
      lambda s: (s.beam.step < max_decode_len) & ~jnp.all(s.beam.done),
      step, state)
  all_met = jnp.all(state.met | (lengths[:, None, :] == 0), -1)
  final = state.beam._replace(alive_logprob=jnp.where(
      all_met, state.beam.alive_logprob, NEG_INF))
  return beams.final_beams(final, max_decode_len, alpha)


def constrained_beam_search(params, config, inputs, phrases, *,
                            beam_size: int, alpha: float,
                            max_decode_len: int, eos_id: int | None = None,
                            forced=None):
  """Beam search whose translations contain every phrase of their row.

  Args:
    params, config, inputs: one model's, or a sequence of them, one per
      member of an ensemble (`ensemble.py`), inputs [batch, s_m] int source
      rows (padded with the config's pad_id).
    phrases: [batch, c, l] int target-token phrases, -1 padded (a row or a
      phrase of only -1: none).
    max_decode_len: at least the longest row's forced and phrase tokens + 1,
      so that every phrase fits.
    forced: the tokens every translation starts with, as
      `evaluate.decode_tokens` takes them (None: none).

  Returns:
    (tokens [batch, beam, max_decode_len] best first, scores [batch, beam]).
  """
  if isinstance(config, ModelConfig):
    params, config, inputs = (params,), (config,), (inputs,)
  configs = tuple(config)
  _, max_decode_len, eos_id, forced = search.translation_arguments(
      configs[0], inputs[0], max_decode_len, eos_id,
      -1 if forced is None else forced)
  return _search(tuple(meta.unbox(p) for p in params),
                 tuple(jnp.asarray(rows, jnp.int32) for rows in inputs),
                 jnp.asarray(phrases, jnp.int32), forced, configs, beam_size,
                 jnp.float32(alpha), max_decode_len, jnp.int32(eos_id))


def phrases_of(target_tok, lines, rows: int) -> np.ndarray:
  """The phrases of `lines` (each: tab-separated target phrases, '' for
  none) as target tokens [rows, c, l], -1 padded (without a language
  token: a many-to-many model's is forced first)."""
  phrases = [[target_text for target_text in (line or '').split('\t')
              if target_text.strip()] for line in lines]
  ids = [[target_prefix.text_ids(target_tok, text) for text in row]
         for row in phrases]
  # Multiples of 4 phrases and tokens, so that few shapes compile.
  width = -(-max([1] + [len(row) for row in ids]) // 4) * 4
  length = -(-max([1] + [len(p) for row in ids for p in row]) // 4) * 4
  out = np.full((rows, width, length), -1, np.int32)
  for r, row in enumerate(ids):
    for c, phrase in enumerate(row):
      out[r, c, :len(phrase)] = phrase
  return out


def decode_rows(params, configs, rows, phrases: np.ndarray, *,
                beam_size: int, alpha: float, max_extra_len: int,
                forced=None) -> np.ndarray:
  """Best tokens [batch, length] of each member's source rows [batch, s_m]
  (`params`, `configs` and `rows`: one per member) containing the
  `phrases` [batch, c, l] of each row, after the `forced` tokens
  (`target_prefix.forced_ids`); decoding up to max_extra_len tokens beyond
  the longest source or prefix, and at least a row's forced and phrase
  tokens + 1 (rounded up to a multiple of 16)."""
  max_len = min(config.max_len for config in configs)
  longest = max([int((r != c.pad_id).sum(1).max(initial=0))
                 for r, c in zip(rows, configs)]
                + [target_prefix.width(forced)])
  needed = (int((phrases >= 0).sum((1, 2)).max(initial=0)) + 1
            + (0 if forced is None else target_prefix.width(forced)))
  if needed > max_len:
    raise ValueError(f'--constraints: a line\'s phrases (and prefix) have '
                     f'{needed - 1} tokens, more than the model\'s max_len='
                     f'{max_len} positions allow; shorten them.')
  length = max(decode_length(longest, max_extra_len, max_len, 16), needed)
  tokens, _ = constrained_beam_search(params, configs, rows, phrases,
                                      beam_size=beam_size, alpha=alpha,
                                      max_decode_len=length, forced=forced)
  return np.asarray(tokens)[:, 0]
