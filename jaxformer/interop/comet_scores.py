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
"""
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.interop import comet
from jaxformer.model.transformer import EncoderLayer, PooledEncoder

ACTIVATIONS = {'tanh': jnp.tanh, 'sigmoid': jax.nn.sigmoid,
               'relu': jax.nn.relu,
               'gelu': functools.partial(jax.nn.gelu, approximate=False)}
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
    weights = jax.nn.softmax(jnp.asarray(model.mix_weights))
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


def token_rows(model: comet.Comet, texts: Sequence[str]) -> np.ndarray:
  """Texts -> [batch, s] ids with the tokenizer's special tokens, cut (its
  end token kept) to what the encoder's positions allow, padded."""
  limit = model.encoder_config.max_len - 2  # As COMET's encoders cut.
  eos = model.tokenizer.eos_id
  rows = [ids if len(ids) <= limit else ids[:limit - 1] + [eos]
          for ids in model.tokenizer.encode(list(texts))]
  width = max(map(len, rows))
  pad = model.encoder_config.pad_id
  return np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)


def sentence_scores(model: comet.Comet, sources: Sequence[str],
                    translations: Sequence[str],
                    references: Sequence[str] | None = None,
                    batch_size: int = 16) -> list[float]:
  """One score per translation, in order."""
  if 'ref' in model.inputs and references is None:
    raise comet.CometError(f'{model.kind} needs references')
  embed = jax.jit(functools.partial(sentence_embeddings, model))
  scores = []
  for start in range(0, len(translations), batch_size):
    part = slice(start, start + batch_size)
    mt = embed(token_rows(model, translations[part]))
    src = embed(token_rows(model, sources[part]))
    ref = (embed(token_rows(model, references[part]))
           if 'ref' in model.inputs else None)
    scores += np.asarray(estimate(model, _features(model.kind, mt, src, ref))
                         ).tolist()
  return scores


def corpus_report(model: comet.Comet, sources: Sequence[str],
                  translations: Sequence[str],
                  references: Sequence[str] | None = None) -> dict:
  """{'comet': the system score (the mean), 'comet_sentences': [...]}."""
  scores = sentence_scores(model, sources, translations, references)
  return {'comet': float(np.mean(scores)) if scores else 0.0,
          'comet_sentences': scores}
