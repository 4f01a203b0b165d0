"""The models' cached decoding, as functions for a search to call: the
decoding cache of a batch, a `DecoderLM`'s prefill of its prompts, and one
decoder position for every row, `step_fn(cache, previous_tokens, step)`
(see `search.py` for the searches).
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxformer.model.config import ModelConfig
from jaxformer.model.transformer import DecoderLM, EncoderDecoder

# step_fn(cache, previous_tokens [rows], step []) -> (logits [rows, v], cache,
# record): one decoder position for every row; `record` is an optional per-step
# array (or None) that the loop stores, e.g. attention weights.
StepFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any, Any]]


def encoder_outputs(config: ModelConfig, params, inputs: jax.Array):
  """inputs [b, s], padded with config.pad_id -> (encoded [b, s, d_model],
  segment ids [b, s])."""
  segment_ids = (inputs != config.pad_id).astype(jnp.int32)
  encoded = EncoderDecoder(config).apply(
      {'params': params}, inputs, segment_ids, method='encode')
  return encoded, segment_ids


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


def lm_prefill(config: ModelConfig, params, cache, inputs: jax.Array):
  """The cache of `init_lm_cache` after a `DecoderLM` read inputs [b, w]
  (w <= the cache's length) from position 0 in one call, as
  `lm_step_fn(..., start_positions)` continues it: slot p of a row holds
  its keys/values at position p. A row's padding after its prompt writes
  slots that its steps overwrite before they attend to them."""
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  _, variables = DecoderLM(config, decode='rows').apply(
      {'params': params, 'cache': cache}, inputs, jnp.ones_like(inputs),
      positions, method='decode_logits', mutable=['cache'])
  return variables['cache']


def lm_step_fn(config: ModelConfig, params,
               start_positions: jax.Array | None = None) -> StepFn:
  """Cached `DecoderLM` step: every row at position `step`, or with
  start_positions [rows] (after `lm_prefill`) row r at start_positions[r]
  + step."""
  model = DecoderLM(config, decode=True if start_positions is None
                    else 'rows')

  def step_fn(cache, previous_tokens, step):
    ones = jnp.ones((previous_tokens.shape[0], 1), jnp.int32)
    positions = ones * step
    if start_positions is not None:
      positions = positions + start_positions[:, None]
    logits, variables = model.apply(
        {'params': params, 'cache': cache}, previous_tokens[:, None], ones,
        positions, method='decode_logits', mutable=['cache'])
    return logits[:, 0], variables['cache'], None
  return step_fn
