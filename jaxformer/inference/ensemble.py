"""Ensembles (`translate|evaluate --ensemble`): several translation models
of one target vocabulary decode together, each with its own encoder
outputs and cache, the search taking at each step the mean of their
log-probabilities (Marian's and fairseq's ensembles; no renormalisation,
so a model ensembled with itself decodes as it does alone). Greedy and
beam, with target prefixes as the single-model searches take them.

Each member encodes the sources with its own source vocabulary: the
searches take one rows array [batch, s_m] per member.
"""
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax.core import meta

from jaxformer.inference import beam_search, search
from jaxformer.model.incremental import (encoder_outputs, init_cache,
                                         translation_step_fn)


def check_same_target(names: Sequence[str], target_toks, model_configs
                      ) -> None:
  """Raises unless every member's target vocabulary (its pieces, EOS and
  padding ids) is the first one's; `names` say where each came from."""
  def pieces(tok):
    return [tok.id_to_piece(i) for i in range(tok.vocab_size)]
  first = pieces(target_toks[0])
  for name, tok, config in zip(names[1:], target_toks[1:], model_configs[1:]):
    same = (tok.vocab_size == target_toks[0].vocab_size and pieces(tok) == first
            and config.output_vocab_size == model_configs[0].output_vocab_size
            and (config.eos_id, config.pad_id) == (model_configs[0].eos_id,
                                                   model_configs[0].pad_id))
    if not same:
      raise ValueError(
          f'--ensemble {name}: its target vocabulary ({tok.vocab_size} '
          f'pieces) is not that of --workdir {names[0]} '
          f'({target_toks[0].vocab_size} pieces); ensemble models trained '
          'with the same target tokenizer.')


def mean_log_probs_step_fn(configs, params, segment_ids, beam: int = 1):
  """A `StepFn` over a tuple of caches (one per member) returning the mean
  of the members' log-probabilities [rows, v]; each member reads its own
  decoder start id at step 0."""
  steps = [translation_step_fn(config, p, jnp.repeat(s, beam, axis=0))
           for config, p, s in zip(configs, params, segment_ids)]

  def step_fn(caches, tokens, step):
    total, new_caches = None, []
    for config, member_step, cache in zip(configs, steps, caches):
      member_tokens = jnp.where(step > 0, tokens, config.decoder_start_id)
      logits, cache, _ = member_step(cache, member_tokens, step)
      log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
      total = log_probs if total is None else total + log_probs
      new_caches.append(cache)
    return total / len(configs), tuple(new_caches), None
  return step_fn


def _caches(configs, params, inputs, max_decode_len):
  """(each member's cache, each member's source segment ids)."""
  caches, segments = [], []
  for config, p, rows in zip(configs, params, inputs):
    encoded, segment_ids = encoder_outputs(config, p, rows)
    caches.append(init_cache(config, p, encoded, segment_ids, max_decode_len))
    segments.append(segment_ids)
  return tuple(caches), segments


def member_steps(configs, params, inputs, max_decode_len: int, beam: int):
  """(the cache, a `StepFn` of it, that StepFn's output -> log-probabilities)
  of the members' search: one model's own (logits, `jax.nn.log_softmax`),
  several models' mean of log-probabilities (the identity). Traced."""
  if len(configs) == 1:
    (config,), (p,), (rows,) = configs, params, inputs
    encoded, segment_ids = encoder_outputs(config, p, rows)
    cache = init_cache(config, p, encoded, segment_ids, max_decode_len)
    return cache, translation_step_fn(
        config, p, jnp.repeat(segment_ids, beam, axis=0)), jax.nn.log_softmax
  caches, segments = _caches(configs, params, inputs, max_decode_len)
  return (caches, mean_log_probs_step_fn(configs, params, segments, beam),
          lambda log_probs: log_probs)


@functools.partial(jax.jit, static_argnames=('configs', 'max_decode_len'))
def _greedy(params, inputs, forced_ids, configs, max_decode_len, eos_id):
  caches, segments = _caches(configs, params, inputs, max_decode_len)
  step_fn = mean_log_probs_step_fn(configs, params, segments)
  has_source = jnp.any(inputs[0] != configs[0].pad_id, axis=-1)
  return search.token_loop(
      step_fn, search.forcing_prefix(search.greedy_choice, forced_ids),
      caches, ~has_source, max_decode_len, eos_id,
      start_id=configs[0].decoder_start_id, pad_id=configs[0].pad_id)[0]


@functools.partial(jax.jit, static_argnames=('configs', 'beam_size',
                                             'max_decode_len'))
def _beam(params, inputs, forced_ids, configs, beam_size, alpha,
          max_decode_len, eos_id):
  caches, segments = _caches(configs, params, inputs, max_decode_len)
  step_fn = mean_log_probs_step_fn(configs, params, segments, beam_size)
  state = beam_search.initial_beam_state(
      caches, jnp.any(inputs[0] != configs[0].pad_id, axis=-1), beam_size,
      max_decode_len, configs[0].pad_id)
  step = functools.partial(
      beam_search.beam_search_step, step_fn=step_fn, alpha=alpha,
      eos_id=eos_id, max_decode_len=max_decode_len,
      start_id=configs[0].decoder_start_id, forced_ids=forced_ids,
      log_probs_fn=lambda log_probs: log_probs)
  state = jax.lax.while_loop(
      lambda s: (s.step < max_decode_len) & ~jnp.all(s.done), step, state)
  return beam_search.final_beams(state, max_decode_len, alpha)[0][:, 0]


def decode_tokens(params: Sequence, configs: Sequence, inputs: Sequence, *,
                  beam_size: int, alpha: float, max_decode_len: int,
                  forced=None) -> jax.Array:
  """The ensemble's best translation's tokens [batch, max_decode_len]
  (greedy if beam 1) of each member's source rows `inputs` [batch, s_m];
  forced as `evaluate.decode_tokens` takes it."""
  configs = tuple(configs)
  _, max_decode_len, eos_id, forced = search.translation_arguments(
      configs[0], inputs[0], max_decode_len, None,
      -1 if forced is None else forced)
  for config in configs:
    search.translation_arguments(config, inputs[0], max_decode_len, None)
  params = tuple(meta.unbox(p) for p in params)
  inputs = tuple(jnp.asarray(rows, jnp.int32) for rows in inputs)
  if beam_size <= 1:
    return _greedy(params, inputs, forced, configs, max_decode_len,
                   jnp.int32(eos_id))
  return _beam(params, inputs, forced, configs, beam_size, jnp.float32(alpha),
               max_decode_len, jnp.int32(eos_id))
