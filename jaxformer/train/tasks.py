"""What is trained: each task names its model and how a batch becomes loss
sums. The one train step, loop, sharding and checkpointing serve them all.

Batches are dicts of arrays. Translation: 'inputs', 'targets' and their
'*_segment_ids' / '*_positions'. Language model: 'targets' (+ segment ids,
positions, and with `data.lm_rows='prompt_response'` 'targets_loss_mask':
0 where no loss falls, e.g. on a prompt, and 'targets_start' [batch] int,
each row's first input, -1 for the model's start token). Classification:
'inputs' (+ ...), 'labels' [batch] int.
Regression: 'inputs' (+ ...), 'values' [batch, regression_dim] float.
The encoder-only tasks' batches carry 'inputs_token_types' [batch, s] int
when the model has token types (model.type_vocab_size).
"""
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from jaxformer.data.lm_rows import LOSS_MASK, MASKED_LAYOUTS, ROW_START
from jaxformer.model import (DecoderLM, EncoderClassifier, EncoderDecoder,
                             EncoderRegressor, ModelConfig)
from jaxformer.train import chunked_loss
from jaxformer.train import dev_metrics
from jaxformer.train import loss as losses


def _token_weights(batch, prefix):
  """[batch, length] float32: 1 at the tokens the loss falls on (real
  tokens, and of those only where a '{prefix}_loss_mask' is 1)."""
  segment_ids = batch.get(f'{prefix}_segment_ids')
  if segment_ids is None:
    weights = (batch[prefix] != 0).astype(jnp.float32)
  else:
    weights = (segment_ids != 0).astype(jnp.float32)
  mask = batch.get(f'{prefix}_loss_mask')
  return weights if mask is None else weights * mask.astype(jnp.float32)


def _packing(batch, prefix):
  return {f'{prefix}_segment_ids': batch.get(f'{prefix}_segment_ids'),
          f'{prefix}_positions': batch.get(f'{prefix}_positions')}


def _encoder_inputs(batch):
  """The encoder-only models' keyword arrays: packing, and the token types
  (sentence pairs) where the batch has them."""
  inputs = _packing(batch, 'inputs')
  if batch.get('inputs_token_types') is not None:
    inputs['inputs_token_types'] = batch['inputs_token_types']
  return inputs


def _example_weights(batch):
  """1 for real examples, 0 for padding rows (all-padding inputs)."""
  return (batch['inputs'] != 0).any(axis=-1).astype(jnp.float32)


def _output_metrics(batch, label_smoothing):
  """The decoder's output_fn that returns the token metric sums of its
  logits, computed without them (`chunked_loss.output_token_metrics`)."""
  def output_fn(x, kernel, bias):
    return chunked_loss.output_token_metrics(
        x, kernel, bias, batch['targets'], _token_weights(batch, 'targets'),
        label_smoothing)
  return output_fn


def translation_sums(model, params, batch, rngs, label_smoothing):
  return model.apply({'params': params}, batch['inputs'], batch['targets'],
                     **_packing(batch, 'inputs'), **_packing(batch, 'targets'),
                     output_fn=_output_metrics(batch, label_smoothing),
                     rngs=rngs)


def language_model_sums(model, params, batch, rngs, label_smoothing):
  return model.apply({'params': params}, batch['targets'],
                     **_packing(batch, 'targets'),
                     output_fn=_output_metrics(batch, label_smoothing),
                     targets_start=batch.get(ROW_START), rngs=rngs)


def _encoder_outputs(model, params, batch, rngs):
  """An encoder-only model's outputs [batch, ...]."""
  return model.apply({'params': params}, batch['inputs'],
                     **_encoder_inputs(batch), rngs=rngs)


def classification_sums(model, params, batch, rngs, label_smoothing,
                        rows=False):
  """The loss sums; with `rows`, (them, each row's 'predicted' class,
  'labels' and 'weight' [batch] for `dev_metrics`)."""
  log_probs = jax.nn.log_softmax(_encoder_outputs(model, params, batch, rngs))
  weights = _example_weights(batch)
  sums = losses.class_metrics(log_probs, batch['labels'], weights,
                              label_smoothing)
  if not rows:
    return sums
  return sums, {'predicted': jnp.argmax(log_probs, -1),
                'labels': batch['labels'], 'weight': weights}


def regression_sums(model, params, batch, rngs, label_smoothing, rows=False):
  """As `classification_sums`: the rows' 'predictions' and 'values'
  [batch, regression_dim] and 'weight' [batch]."""
  del label_smoothing
  predictions = _encoder_outputs(model, params, batch, rngs)
  weights = _example_weights(batch)
  sums = losses.regression_metrics(predictions, batch['values'], weights)
  if not rows:
    return sums
  return sums, {'predictions': predictions, 'values': batch['values'],
                'weight': weights}


def _class_names(outputs, config):
  """[batch, num_classes] logits -> the class names."""
  labels = config.data.labels  # Empty: a fresh head not trained yet.
  return [labels[i] if labels else str(i)
          for i in np.asarray(outputs).argmax(axis=-1)]


def _values(outputs, config):
  """[batch, regression_dim] predictions -> one list of floats each."""
  del config
  return np.asarray(outputs).tolist()


# The config length of each token array a batch may hold.
LENGTH_KEYS = {'inputs': 'max_source_length', 'targets': 'max_target_length'}


@dataclasses.dataclass(frozen=True)
class Task:
  """A task and everything the commands do differently for it.

  `batch_keys` are the token arrays [batch, length] the model reads
  ('inputs': through an encoder; 'targets': through a causal decoder that
  predicts them); `label` the per-example target array, if any, as
  (key, dtype, config key of its trailing width or None)."""
  name: str
  model_class: type[nn.Module]
  batch_keys: tuple[str, ...]  # Arrays `model.init` is called with.
  loss_sums: Callable
  label: tuple[str, type, str | None] | None = None
  # The decoder writes text: evaluated by decoding (BLEU on a split).
  translates: bool = False
  # Continues prompts (`jaxformer generate`).
  generates: bool = False
  # Model outputs [batch, ...] -> what `jaxformer predict` prints per text.
  prediction: Callable | None = None
  # `data.labels` (and `model.num_classes`) come from the train split.
  labels_from_data: bool = False
  # Rows of every example's prediction (`loss_sums(..., rows=True)`) ->
  # metrics computed on the host; None: the loss sums' metrics alone.
  dev_metrics: Callable | None = None
  # What evaluation reports (`checkpoint.best_metric` picks one); (): not
  # checked.
  eval_metrics: tuple[str, ...] = ()

  @property
  def decodes(self) -> bool:
    """Whether the model has a decoder (and so a decoding cache)."""
    return 'targets' in self.batch_keys

  def model(self, config: ModelConfig, deterministic: bool = True,
            decode: bool = False) -> nn.Module:
    if self.decodes:
      return self.model_class(config, deterministic=deterministic,
                              decode=decode)
    return self.model_class(config, deterministic=deterministic)

  def eval_sums(self, model: nn.Module, params, batch):
    """(loss sums, the rows `dev_metrics` takes ({} without it)) of an eval
    batch: no dropout, no label smoothing."""
    if self.dev_metrics is None:
      return self.loss_sums(model, params, batch, {}, 0.0), {}
    return self.loss_sums(model, params, batch, {}, 0.0, rows=True)

  def init_variables(self, model: nn.Module, rng: jax.Array, batch):
    return model.init(rng, *(batch[key] for key in self.batch_keys))

  def batch_shapes(self, config, rows: int, source: int, target: int
                   ) -> dict[str, tuple[tuple[int, ...], type]]:
    """(shape, dtype) of each array of a batch of `rows` rows: the token
    arrays [rows, source or target] int32 with their segment ids and
    positions (an encoder-only model's token types too, if it has them;
    prompt/response rows' loss mask [rows, target] and starts [rows]),
    and the label array (labels [rows] int32, values [rows, regression_dim]
    float32)."""
    width = {'inputs': source, 'targets': target}
    shapes = {key + suffix: ((rows, width[key]), np.int32)
              for key in self.batch_keys
              for suffix in ('', '_segment_ids', '_positions')}
    if self.batch_keys == ('inputs',) and config.model.get(
        'type_vocab_size', 0):
      shapes['inputs_token_types'] = ((rows, source), np.int32)
    if 'targets' in self.batch_keys and (
        config.data.get('lm_rows') in MASKED_LAYOUTS):
      shapes[LOSS_MASK] = ((rows, target), np.int32)
      shapes[ROW_START] = ((rows,), np.int32)
    if self.label:
      key, dtype, dim_key = self.label
      shapes[key] = ((rows,) + ((config.model[dim_key],) if dim_key else ()),
                     dtype)
    return shapes

  def example_batch(self, config) -> dict[str, np.ndarray]:
    """A one-row batch of the configured shapes, for shape inference:
    token arrays of ones, the label array of zeros."""
    shapes = self.batch_shapes(config, 1, config.data.max_source_length,
                               config.data.max_target_length)
    label_key = self.label[0] if self.label else None
    return {key: (np.zeros if key == label_key else np.ones)(shape, dtype)
            for key, (shape, dtype) in shapes.items()}

  def length_keys(self) -> tuple[str, ...]:
    """The `data.*` lengths of this task's token arrays."""
    return tuple(LENGTH_KEYS[key] for key in self.batch_keys)

  def shape_name(self, rows: int, source: int, target: int) -> str:
    """A batch shape for people: 'rows x (source + target)' or 'rows x width'."""
    widths = [{'inputs': source, 'targets': target}[k] for k in self.batch_keys]
    if len(widths) == 2:
      return f'{rows}x({widths[0]}+{widths[1]})'
    return f'{rows}x{widths[0]}'


TASKS = {
    'translation': Task('translation', EncoderDecoder, ('inputs', 'targets'),
                        translation_sums, translates=True),
    'language_model': Task('language_model', DecoderLM, ('targets',),
                           language_model_sums, generates=True),
    'classification': Task('classification', EncoderClassifier, ('inputs',),
                           classification_sums,
                           label=('labels', np.int32, None),
                           prediction=_class_names, labels_from_data=True,
                           dev_metrics=dev_metrics.class_metrics,
                           eval_metrics=('loss', 'nll', 'perplexity',
                                         'accuracy', 'macro_f1')),
    'regression': Task('regression', EncoderRegressor, ('inputs',),
                       regression_sums,
                       label=('values', np.float32, 'regression_dim'),
                       prediction=_values,
                       dev_metrics=dev_metrics.value_metrics,
                       eval_metrics=('loss', 'mse', 'pearson', 'spearman')),
}


def get_task(name: str) -> Task:
  if name not in TASKS:
    raise ValueError(f'task={name!r} is not one of {sorted(TASKS)}.')
  return TASKS[name]
