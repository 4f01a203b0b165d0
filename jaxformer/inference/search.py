"""Autoregressive decoding with the models' key/value cache: the lengths and
the token-by-token loop the searches share, and greedy search for
`EncoderDecoder`. Beam search is in `beam_search.py`; continuations of
prompts from a `DecoderLM` (greedy and sampling) in `generation.py`.

Each search is one `jax.lax.while_loop`, compiled once per config and shapes
(sentences, source length, decode length, beam size); eos_id and alpha are
traced values, so changing them does not recompile.
Sources are padded with the model's `pad_id`, the decoder starts from its
`decoder_start_id` (jaxformer's vocabularies: 0 for both, `token_ids.py`);
the end-of-sentence id is an argument (`eos_id`, by default the model's;
-1 never ends a sentence, so every step runs). Shapes:
`batch` b, decode length `length`, source length s, vocabulary v.

On CPU, where they were measured to pay, the argmax, the greedy output layer
and the batch take the kernels of `model/cpu_kernels.py`
(`backend.cpu_kernel_applies` says where); their results are the same.
"""
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.model import backend, cpu_kernels
from jaxformer.model.config import ModelConfig
from jaxformer.model.incremental import (StepFn, encoder_outputs, init_cache,
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


def _check_decode_length(config: ModelConfig, max_decode_len: int):
  if not 1 <= max_decode_len <= config.max_len:
    raise ValueError(f'max_decode_len={max_decode_len} must be in '
                     f'[1, model max_len={config.max_len}].')


def translation_arguments(config: ModelConfig, inputs,
                          max_decode_len: int | None, eos_id: int | None,
                          forced_ids=None):
  """A translation search's arguments with their defaults filled in and
  checked: (inputs [batch, s] int32, max_decode_len (by default
  `max_decode_length` of the inputs, within the model's max_len), eos_id
  (by default config.eos_id), forced_ids [batch, p] int32: the first p
  tokens of each translation, -1 where none (from one id, [batch] ids or
  [batch, p] ids))."""
  if max_decode_len is None:
    max_decode_len = max_decode_length(inputs, max_len=config.max_len,
                                       pad_id=config.pad_id)
  eos_id = config.eos_id if eos_id is None else eos_id
  _check_decode_length(config, max_decode_len)
  inputs = jnp.asarray(inputs, jnp.int32)
  forced_ids = jnp.asarray(-1 if forced_ids is None else forced_ids, jnp.int32)
  forced_ids = jnp.broadcast_to(
      forced_ids.reshape(forced_ids.shape + (1,) * (2 - forced_ids.ndim)),
      (inputs.shape[0], max([1, *forced_ids.shape[1:]])))
  if 1 < forced_ids.shape[1] >= max_decode_len:
    raise ValueError(f'A target prefix of {forced_ids.shape[1]} tokens leaves '
                     f'nothing to decode in {max_decode_len} positions; '
                     'shorten the prefix.')
  return inputs, max_decode_len, eos_id, forced_ids


def forced_at(forced_ids: jax.Array, step: jax.Array) -> jax.Array:
  """The tokens forced at `step`: forced_ids [b, p] (or [b]: p = 1) column
  `step`, -1 past the prefix. -> [b] int32."""
  forced_ids = forced_ids.reshape(forced_ids.shape[0], -1)
  width = forced_ids.shape[1]
  column = jax.lax.dynamic_index_in_dim(
      forced_ids, jnp.minimum(step, width - 1), axis=1, keepdims=False)
  return jnp.where(step < width, column, -1)


def forcing_prefix(choose_fn, forced_ids: jax.Array):
  """`choose_fn` whose first tokens are forced_ids [b, p] where those are
  not -1: a target prefix (CTranslate2's target_prefix), whose first token
  is a many-to-many model's target language (Hugging Face's
  forced_bos_token_id), per sentence."""
  def choose(logits, step):
    tokens = choose_fn(logits, step)
    forced = forced_at(forced_ids, step)
    return jnp.where(forced >= 0, forced, tokens)
  return choose


def previous_tokens(tokens: jax.Array, step: jax.Array,
                    start_id=PAD_ID) -> jax.Array:
  """The decoder input at `step`: tokens[..., step - 1], or `start_id` (the
  model's decoder_start_id, or [...] ids of each row) at step 0.
  tokens: [..., length] -> [...]."""
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
               start_id=PAD_ID, pad_id: int = PAD_ID, stop_fn=None):
  """Decodes one token per row and step until every row has emitted EOS or
  `max_decode_len` tokens.

  Args:
    choose_fn: (step_fn's logits [b, v], step) -> next tokens [b] int32;
      the identity where step_fn returns the tokens themselves.
    finished: [b] bool, rows that produce nothing (all-padding sources).
    record_shape: (shape, dtype) of step_fn's per-step record, or None.
    start_id: the first decoder input (an id, or [b] ids); pad_id: what
      follows EOS.
    stop_fn: (next tokens [b], step) -> [b] bool, the rows that end with
      this step's token; by default those whose token is eos_id.

  Returns:
    (tokens [b, max_decode_len] int32, pad_id after EOS; records
    [max_decode_len, b, ...] zero after EOS, or None).
  """
  batch = finished.shape[0]
  records = None
  if record_shape is not None:
    shape, dtype = record_shape
    records = jnp.zeros((max_decode_len, *shape), dtype)

  if stop_fn is None:
    stop_fn = lambda tokens, step: tokens == eos_id  # noqa: E731

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
        finished=state.finished | stop_fn(next_tokens, state.step),
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
def _greedy_decode(params, inputs, forced_ids, config, max_decode_len, eos_id,
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
  choose_fn = forcing_prefix(choose_fn, forced_ids)
  tokens, records = token_loop(step_fn, choose_fn, cache, ~has_source,
                               max_decode_len, eos_id, record_shape,
                               config.decoder_start_id, config.pad_id)
  if not return_attention:
    return tokens
  return tokens, jnp.transpose(records, (1, 2, 3, 0, 4))


def greedy_decode(params, config: ModelConfig, inputs, *,
                  max_decode_len: int | None = None,
                  eos_id: int | None = None, return_attention: bool = False,
                  batch_parts: int | None = None, forced_ids=None):
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
    forced_ids: [batch, p] int (or [batch], or one int) the first tokens of
      each sentence are, -1 (the default) where they are chosen: a target
      prefix, starting with a many-to-many model's target language token
      (Hugging Face's forced_bos_token_id).

  Returns:
    tokens [batch, max_decode_len] int32: EOS included, pad_id after it; with
    `return_attention`, (tokens, weights [batch, layers, heads,
    max_decode_len, s] float32, zero after EOS).
  """
  inputs, max_decode_len, eos_id, forced_ids = translation_arguments(
      config, inputs, max_decode_len, eos_id, forced_ids)
  params = meta.unbox(params)
  return cpu_kernels.search_in_parts(
      lambda rows: _greedy_decode(params, *rows, config, max_decode_len,
                                  jnp.int32(eos_id), return_attention),
      (inputs, forced_ids), batch_parts, fill=(config.pad_id, -1))
