"""COMET scores in JAX: a `comet.Comet` (comet.py reads it) over source,
translation and (regression_metric) reference sentences.

Each sentence is encoded alone by jaxformer's `PooledEncoder` (the XLM-R
of bert.py's table); the embeddings' output and every layer's are taken
with Flax's `capture_intermediates`, mixed by the layer-wise attention
(gamma * sum_k softmax(w)_k * states_k, each states_k normalized per
sentence over its real tokens and features where layer_norm), pooled
(avg: the mean over real tokens; cls: the first; max), and the
estimator reads
  regression_metric:             [mt, ref, mt*ref, |mt-ref|, mt*src, |mt-src|]
  referenceless_regression_metric: [mt, src, mt*src, |mt-src|].
unified_metric (CometKiwi) encodes the sentences joined into one sequence
(<s> mt </s></s> src </s>, each cut alone first, the whole cut to the
encoder's positions as comet cuts it) and the estimator reads its first
token's mixed states; with src and ref, the score is the mean of those of
mt:src, mt:ref and mt:src:ref.
"""
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.interop import comet
from jaxformer.model.transformer import EncoderLayer, PooledEncoder

ACTIVATIONS = {'tanh': jnp.tanh, 'sigmoid': jax.nn.sigmoid,
               'softplus': jax.nn.softplus, 'softsign': jax.nn.soft_sign}
def sparsemax(z: jax.Array) -> jax.Array:
  """[n] -> the Euclidean projection of z onto the simplex (Martins &
  Astudillo 2016): max(z - tau, 0), tau set so that the sum is 1."""
  ordered = jnp.sort(z)[::-1]
  ks = jnp.arange(1, z.shape[0] + 1, dtype=z.dtype)
  sums = jnp.cumsum(ordered)
  support = (1 + ks * ordered > sums).sum()
  tau = (sums[support - 1] - 1) / support
  return jnp.maximum(z - tau, 0)


TRANSFORMATIONS = {'softmax': jax.nn.softmax, 'sparsemax': sparsemax}
# COMET's layer norm of the mix: its epsilon, under the square root.
MIX_EPSILON = 1e-12


def _captured(module, method_name: str) -> bool:
  return method_name == '__call__' and (
      isinstance(module, EncoderLayer) or module.name == 'embedding_norm')


def hidden_states(model: comet.Comet, ids: jax.Array) -> jax.Array:
  """[batch, s] ids -> [layers + 1, batch, s, d]: the embeddings' output
  (after their norm) and each layer's."""
  config = model.encoder_config
  _, state = PooledEncoder(config).apply(
      {'params': model.encoder_params}, ids, capture_intermediates=_captured,
      mutable=['intermediates'])
  encoder = state['intermediates']['encoder']
  states = [encoder['embedding_norm']['__call__'][0]]
  states += [encoder[f'layer_{i}']['__call__'][0][0]
             for i in range(config.num_encoder_layers)]
  return jnp.stack(states).astype(jnp.float32)


def _normalized(states: jax.Array, mask: jax.Array) -> jax.Array:
  """[layers, batch, s, d] -> the same, each sentence's states normalized
  by their mean and variance over its real tokens and all features."""
  weights = mask[None, :, :, None]
  count = mask.sum(1)[None, :, None, None] * states.shape[-1]
  mean = (states * weights).sum((2, 3), keepdims=True) / count
  variance = (((states - mean) * weights) ** 2).sum(
      (2, 3), keepdims=True) / count
  return (states - mean) / jnp.sqrt(variance + MIX_EPSILON)


def sentence_embeddings(model: comet.Comet, ids: jax.Array) -> jax.Array:
  """[batch, s] ids (padded with the tokenizer's pad id) -> [batch, d]."""
  states = hidden_states(model, ids)
  mask = (ids != model.encoder_config.pad_id).astype(jnp.float32)
  if model.layer is not None:
    mixed = states[model.layer]
  else:
    if model.layer_norm:
      states = _normalized(states, mask)
    weights = TRANSFORMATIONS[model.transformation](
        jnp.asarray(model.mix_weights))
    mixed = model.gamma * jnp.einsum('l,lbsd->bsd', weights, states)
  if model.pool == 'cls':
    return mixed[:, 0]
  if model.pool == 'max':
    return jnp.where(mask[..., None] > 0, mixed, -jnp.inf).max(1)
  return (mixed * mask[..., None]).sum(1) / mask.sum(1)[:, None]


def estimate(model: comet.Comet, features: jax.Array) -> jax.Array:
  """[batch, in] -> [batch] scores through the estimator."""
  x = features
  for i, (kernel, bias) in enumerate(model.estimator):
    x = x @ jnp.asarray(kernel) + jnp.asarray(bias)
    if i < len(model.estimator) - 1:
      x = ACTIVATIONS[model.activation](x)
  if model.final_activation is not None:
    x = ACTIVATIONS[model.final_activation](x)
  return x[:, 0]


def _features(kind: str, mt, src, ref) -> jax.Array:
  if kind == 'referenceless_regression_metric':
    return jnp.concatenate([mt, src, mt * src, jnp.abs(mt - src)], 1)
  return jnp.concatenate([mt, ref, mt * ref, jnp.abs(mt - ref),
                          mt * src, jnp.abs(mt - src)], 1)


def token_ids(model: comet.Comet, texts: Sequence[str]) -> list[list[int]]:
  """Texts -> ids with the tokenizer's special tokens, cut (its end token
  kept) to what the encoder's positions allow, as comet's encoders cut."""
  limit = model.encoder_config.max_len - 2
  eos = model.tokenizer.eos_id
  return [ids if len(ids) <= limit else ids[:limit - 1] + [eos]
          for ids in model.tokenizer.encode(list(texts))]


def joined(model: comet.Comet, *segments: list[int]) -> list[int]:
  """One sequence of several sentences' ids (each with its own <s> and
  </s>): <s> a </s></s> b </s> ..., cut to the encoder's positions
  (comet: where the sentences are longer than the positions less the
  special tokens, the first positions are kept, the last </s> too)."""
  start, end = segments[0][0], segments[0][-1]
  ids = segments[0]
  for segment in segments[1:]:
    ids = [start, *ids[1:-1], end, end, *segment[1:-1], end]
  limit = model.encoder_config.max_len
  lengths = sum(len(s) - 2 for s in segments)
  if lengths > limit - (1 + 2 * len(segments)):
    ids = ids[:limit]
  return ids


def padded(model: comet.Comet, rows: list[list[int]]) -> np.ndarray:
  """[batch, s] int32, padded with the encoder's pad id."""
  width = max(map(len, rows))
  pad = model.encoder_config.pad_id
  return np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)


def token_rows(model: comet.Comet, texts: Sequence[str]) -> np.ndarray:
  return padded(model, token_ids(model, texts))


def _arrays(model: comet.Comet):
  """The model's weights: the jitted programs' arguments."""
  return model.encoder_params, model.mix_weights, model.estimator


def _spec(model: comet.Comet) -> comet.Comet:
  """The model without its weights or tokenizer (hashable): a jitted
  program's static part, so that one program serves every call and the
  weights are never baked in as constants."""
  return model._replace(encoder_params=None, mix_weights=None,
                        estimator=None, tokenizer=None)


def _whole(spec: comet.Comet, arrays) -> comet.Comet:
  encoder_params, mix_weights, estimator = arrays
  return spec._replace(encoder_params=encoder_params,
                       mix_weights=mix_weights, estimator=estimator)


@functools.partial(jax.jit, static_argnums=0)
def _embedded(spec, arrays, ids):
  return sentence_embeddings(_whole(spec, arrays), ids)


@functools.partial(jax.jit, static_argnums=0)
def _estimated(spec, arrays, ids):
  model = _whole(spec, arrays)
  return estimate(model, sentence_embeddings(model, ids))


def sentence_scores(model: comet.Comet, sources: Sequence[str],
                    translations: Sequence[str],
                    references: Sequence[str] | None = None,
                    batch_size: int = 16) -> list[float]:
  """One score per translation, in order."""
  if model.kind == 'unified_metric':
    return _unified_scores(model, sources, translations, references,
                           batch_size)
  if 'ref' in model.segments and references is None:
    raise comet.CometError(f'{model.kind} needs references')
  embed = functools.partial(_embedded, _spec(model), _arrays(model))
  scores = []
  for start in range(0, len(translations), batch_size):
    part = slice(start, start + batch_size)
    mt = embed(token_rows(model, translations[part]))
    src = embed(token_rows(model, sources[part]))
    ref = (embed(token_rows(model, references[part]))
           if 'ref' in model.segments else None)
    scores += np.asarray(estimate(model, _features(model.kind, mt, src, ref))
                         ).tolist()
  return scores


def _unified_scores(model: comet.Comet, sources, translations, references,
                    batch_size: int) -> list[float]:
  """CometKiwi's scores: of mt joined with its segments (src, ref where
  given), or with src and ref, the mean of mt:src, mt:ref, mt:src:ref."""
  given = {'src': sources, 'ref': references}
  names = [n for n in model.segments if given[n] is not None]
  if not names:
    raise comet.CometError(f'{model.kind} of input_segments '
                           f'{["mt", *model.segments]} needs sources')
  orders = ([['src'], ['ref'], ['src', 'ref']] if len(names) == 2
            else [names])
  score = functools.partial(_estimated, _spec(model), _arrays(model))
  scores = []
  for start in range(0, len(translations), batch_size):
    part = slice(start, start + batch_size)
    mt = token_ids(model, translations[part])
    ids = {n: token_ids(model, given[n][part]) for n in names}
    runs = [score(padded(model, [joined(model, *row) for row in zip(
        mt, *(ids[n] for n in order))])) for order in orders]
    scores += np.asarray(jnp.mean(jnp.stack(runs), 0)).tolist()
  return scores


def corpus_report(model: comet.Comet, sources: Sequence[str],
                  translations: Sequence[str],
                  references: Sequence[str] | None = None) -> dict:
  """{'comet': the system score (the mean), 'comet_sentences': [...]}."""
  scores = sentence_scores(model, sources, translations, references)
  return {'comet': float(np.mean(scores)) if scores else 0.0,
          'comet_sentences': scores}
