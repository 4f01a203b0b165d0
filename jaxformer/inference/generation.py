"""Continuations of prompts from a decoder-only language model (`DecoderLM`),
greedy or sampled (temperature, then top-k, then top-p): the search behind
`jaxformer generate` (`predict.py` turns texts into prompts and back).

A prompt is the model's inputs from position 0: for a model jaxformer
trained, its `decoder_start_id` and then the text's tokens; for an imported
Hugging Face model, the ids its tokenizer gives (with BOS where Hugging Face
adds one). The prompts of a batch are padded on the right, and all but
their last tokens go through the decoder in one call that fills the cache
(`lm_prefill`); then every row moves one position per step from its own
last prompt token, at its own positions (slot p of a row's cache holds its
position p). A row thus sees exactly the positions, keys and values it
would see alone, whatever the other rows' lengths and whatever the position
embedding (sinusoidal, learned, rotary).

A row ends with the first of `eos_ids` it generates (included) or after
`max_new_tokens` new tokens, or where the positions run out; the loop ends
when every row has. Temperature 0 is greedy: the lowest id of the largest
logits, as torch.argmax. Sampling draws the k-th new token of prompt i with
the key fold_in(fold_in(PRNGKey(seed), i), k), i counted over all prompts of
a stream (`first_row`): a prompt's samples do not depend on its batch.

Shapes: rows b, prefill width w, cache positions (and loop steps) `length`,
vocabulary v.
"""
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.inference.search import NEG_INF, greedy_choice, token_loop
from jaxformer.model.config import ModelConfig
from jaxformer.model.incremental import (init_lm_cache, lm_prefill,
                                         lm_step_fn)

# Prefill widths and cache lengths are rounded up to a multiple of this, and
# row counts to a power of two, so that the batches of a stream share a few
# compiled programs (one per prefill width, cache length and row count).
# A multiple rather than a power of two: a power of two would make fewer
# programs but compute up to twice the prompt, and the prefill is the
# largest matmul of a generation; with 16, at most 15 padding positions.
WIDTH_MULTIPLE = 16


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


def sample_choice(logits: jax.Array, keys: jax.Array, temperature, top_k,
                  top_p) -> jax.Array:
  """One token per row of [b, v] logits, row i drawn with keys[i] from
  softmax(logits / temperature) restricted by top-k, then top-p; temperature
  0 is the argmax. The filters (which sort the vocabulary) run only where
  they are on. -> [b] int32."""
  def keep(logits, _):
    return logits

  def draw(logits):
    logits = apply_temperature(logits, temperature)
    logits = jax.lax.cond(top_k > 0, top_k_filter, keep, logits, top_k)
    logits = jax.lax.cond(top_p < 1.0, top_p_filter, keep, logits, top_p)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)
  return jax.lax.cond(temperature > 0, draw, greedy_choice, logits)


# ------------------------------------------------------------ the search ---

@functools.partial(jax.jit, static_argnames=('config', 'length'))
def _generate(params, heads, last, lengths, limits, rows, key, eos_ids,
              temperature, top_k, top_p, config, length):
  """tokens [b, length]: row i's k-th new token in column k, config.pad_id
  after the row ends.

  heads: [b, w], each prompt but its last token, right-padded (w may be
  0); last: [b], each prompt's last token; lengths: [b], the prompts'
  lengths (0: none); limits: [b], the new tokens a row may have (0: none);
  rows: [b], each row's index among all prompts; length: the cache's
  positions, at least every row's prompt and new tokens but the last.
  """
  row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)

  def choose_fn(logits, step):
    keys = jax.vmap(jax.random.fold_in)(row_keys, jnp.broadcast_to(
        step, row_keys.shape[:1]))
    return sample_choice(logits, keys, temperature, top_k, top_p)

  def stop_fn(tokens, step):
    ends = jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)
    return ends | (step + 1 >= limits)

  cache = init_lm_cache(config, params, heads.shape[0], length)
  if heads.shape[1]:
    cache = lm_prefill(config, params, cache, heads)
  step_fn = lm_step_fn(config, params, jnp.maximum(lengths - 1, 0))
  tokens, _ = token_loop(step_fn, choose_fn, cache, limits <= 0, length, -1,
                         start_id=last, pad_id=config.pad_id, stop_fn=stop_fn)
  return tokens


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def check_settings(temperature: float, top_k: int, top_p: float) -> None:
  if temperature < 0 or top_k < 0 or not 0.0 < top_p <= 1.0:
    raise ValueError(f'temperature={temperature}, top_k={top_k}, '
                     f'top_p={top_p}: need temperature >= 0, top_k >= 0 and '
                     '0 < top_p <= 1.')


def new_token_limits(lengths: Sequence[int], max_new_tokens: int | None,
                     positions: int) -> list[int]:
  """How many tokens each prompt of `lengths` ids may add: max_new_tokens
  (None: no bound), and no more than its `positions` allow (the last new
  token is never fed back, so a prompt of p ids has positions - p + 1); an
  empty prompt has no input, so none."""
  bound = max_new_tokens if max_new_tokens is not None else positions
  return [min(bound, positions - n + 1) if n else 0 for n in lengths]


def generate_ids(params, config: ModelConfig,
                 prompts: Sequence[Sequence[int]], *,
                 max_new_tokens: int | None = None,
                 max_positions: int | None = None,
                 eos_ids: Sequence[int] | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, first_row: int = 0,
                 row_ids: Sequence[int] | None = None) -> list[list[int]]:
  """The new tokens of each prompt, up to and including the first of
  `eos_ids`.

  Args:
    params: `DecoderLM` parameters (boxed or plain).
    prompts: each the model's inputs from position 0, at most
      `max_positions` ids (an empty one generates nothing).
    max_new_tokens: per prompt (None: as many as the positions allow).
    max_positions: of a prompt and its continuation (default and at most
      config.max_len).
    eos_ids: the ids that end a row (default (config.eos_id,); () never).
    temperature: 0 is greedy; top_k: 0 is off; top_p: 1 is off.
    seed, first_row: the samples' keys (see the module docstring).
    row_ids: each prompt's index among all prompts, for the keys (default
      first_row, first_row + 1, ...).

  Returns:
    one list of ids per prompt, at most max_new_tokens long.
  """
  positions = config.max_len if max_positions is None else max_positions
  if not 1 <= positions <= config.max_len:
    raise ValueError(f'max_positions={positions} must be in [1, model '
                     f'max_len={config.max_len}].')
  lengths = [len(p) for p in prompts]
  if max(lengths, default=0) > positions:
    raise ValueError(f'a prompt of {max(lengths)} ids exceeds the '
                     f'{positions} positions; cut it first.')
  check_settings(temperature, top_k, top_p)
  limits = new_token_limits(lengths, max_new_tokens, positions)
  if not any(limits):
    return [[] for _ in prompts]
  rows = 1 << (len(prompts) - 1).bit_length()
  padded = lambda values: np.pad(  # noqa: E731
      np.asarray(values, np.int32), (0, rows - len(prompts)))
  lengths, limits = padded(lengths), padded(limits)
  length = min(positions, _round_up(int(np.max(lengths + limits)) - 1,
                                    WIDTH_MULTIPLE))
  width = min(_round_up(int(np.max(lengths)) - 1, WIDTH_MULTIPLE), length)
  heads = np.full((rows, width), config.pad_id, np.int32)
  last = np.full((rows,), config.pad_id, np.int32)
  for i, prompt in enumerate(prompts):
    if prompt:
      heads[i, :len(prompt) - 1] = prompt[:-1]
      last[i] = prompt[-1]
  eos_ids = (config.eos_id,) if eos_ids is None else tuple(eos_ids)
  numbers = np.arange(first_row, first_row + rows, dtype=np.int32)
  if row_ids is not None:
    numbers[:len(prompts)] = row_ids
  tokens = np.asarray(_generate(
      meta.unbox(params), heads, last, lengths, limits, numbers,
      jax.random.PRNGKey(seed), np.array(eos_ids, np.int32).reshape(-1),
      jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
      config, length))
  return [until_end(tokens[i, :limit], eos_ids)
          for i, limit in enumerate(limits[:len(prompts)])]


def until_end(ids, eos_ids: Sequence[int]) -> list[int]:
  """ids [n] up to and including the first of `eos_ids`."""
  ids = [int(t) for t in ids]
  ends = [i for i, t in enumerate(ids) if t in eos_ids]
  return ids[:ends[0] + 1] if ends else ids
