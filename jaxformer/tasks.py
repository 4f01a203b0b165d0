"""What is trained: each task names its model and how a batch becomes loss
sums. The one train step, loop, sharding and checkpointing serve them all.

Batches are dicts of arrays. Translation: 'inputs', 'targets' and their
'*_segment_ids' / '*_positions'. Language model: 'targets' (+ segment ids,
positions). Classification: 'inputs' (+ ...), 'labels' [batch] int.
Regression: 'inputs' (+ ...), 'values' [batch, regression_dim] float.
"""
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.model import (DecoderLM, EncoderClassifier, EncoderDecoder,
                             EncoderRegressor, ModelConfig)
from jaxformer.train import loss as losses


def _token_weights(batch, prefix):
  segment_ids = batch.get(f'{prefix}_segment_ids')
  if segment_ids is None:
    return (batch[prefix] != 0).astype(jnp.float32)
  return (segment_ids != 0).astype(jnp.float32)


def _packing(batch, prefix):
  return {f'{prefix}_segment_ids': batch.get(f'{prefix}_segment_ids'),
          f'{prefix}_positions': batch.get(f'{prefix}_positions')}


def _example_weights(batch):
  """1 for real examples, 0 for padding rows (all-padding inputs)."""
  return (batch['inputs'] != 0).any(axis=-1).astype(jnp.float32)


def translation_sums(model, params, batch, rngs, label_smoothing):
  logits = model.apply({'params': params}, batch['inputs'], batch['targets'],
                       **_packing(batch, 'inputs'), **_packing(batch, 'targets'),
                       rngs=rngs)
  return losses.token_metrics(logits, batch['targets'],
                              _token_weights(batch, 'targets'), label_smoothing)


def language_model_sums(model, params, batch, rngs, label_smoothing):
  logits = model.apply({'params': params}, batch['targets'],
                       **_packing(batch, 'targets'), rngs=rngs)
  return losses.token_metrics(logits, batch['targets'],
                              _token_weights(batch, 'targets'), label_smoothing)


def classification_sums(model, params, batch, rngs, label_smoothing):
  log_probs = model.apply({'params': params}, batch['inputs'],
                          **_packing(batch, 'inputs'), rngs=rngs)
  return losses.class_metrics(log_probs, batch['labels'],
                              _example_weights(batch), label_smoothing)


def regression_sums(model, params, batch, rngs, label_smoothing):
  del label_smoothing
  predictions = model.apply({'params': params}, batch['inputs'],
                            **_packing(batch, 'inputs'), rngs=rngs)
  return losses.regression_metrics(predictions, batch['values'],
                                   _example_weights(batch))


@dataclasses.dataclass(frozen=True)
class Task:
  name: str
  model_class: type[nn.Module]
  batch_keys: tuple[str, ...]  # Arrays `model.init` is called with.
  loss_sums: Callable

  def model(self, config: ModelConfig, deterministic: bool = True,
            decode: bool = False) -> nn.Module:
    if self.model_class in (EncoderDecoder, DecoderLM):
      return self.model_class(config, deterministic=deterministic,
                              decode=decode)
    return self.model_class(config, deterministic=deterministic)

  def init_variables(self, model: nn.Module, rng: jax.Array, batch):
    return model.init(rng, *(batch[key] for key in self.batch_keys))


TASKS = {
    'translation': Task('translation', EncoderDecoder, ('inputs', 'targets'),
                        translation_sums),
    'language_model': Task('language_model', DecoderLM, ('targets',),
                           language_model_sums),
    'classification': Task('classification', EncoderClassifier, ('inputs',),
                           classification_sums),
    'regression': Task('regression', EncoderRegressor, ('inputs',),
                       regression_sums),
}


def get_task(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f'task={name!r} is not one of {sorted(TASKS)}.')
  return TASKS[name]
