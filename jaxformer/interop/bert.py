"""`jaxformer import` of a Hugging Face BERT, RoBERTa or XLM-RoBERTa
folder (config.json model_type 'bert', 'roberta', 'xlm-roberta') -> a
jaxformer export of an encoder-only classifier or regressor
(`EncoderClassifier` / `EncoderRegressor`), with the folder's tokenizer
(hf_folders.load_tokenizer) travelling in it.

The family is one architecture in jaxformer's options: word + learned
position (RoBERTa: counted from padding_idx + 1, model.position_offset) +
token-type embeddings and their LayerNorm (model.embedding_norm), post-LN
layers with biases, exact GELU, the first token pooled through a tanh
dense layer (model.pooler: BERT's pooler, RoBERTa's classifier.dense) and
a linear head. A `*ForSequenceClassification` folder brings its head
(id2label -> data.labels; num_labels 1 or problem_type 'regression': a
regressor); a base model (`*Model`, or the body of a masked-LM or
pre-training checkpoint, whose language-model heads are left behind) gets
a fresh head of --num-labels classes. Heads jaxformer lacks (token
classification, question answering, multiple choice, causal LM) are
refused by name.

`weight_table` is the one table of names: their tensor -> our parameter,
with both shapes; hf_bert.py writes with the same table. Every shape is
checked before any value is copied, and the export is written whole or
not at all (folders.write_export).
"""
import dataclasses
import os
from typing import NamedTuple

import numpy as np

from jaxformer.interop import bart_weights, folders, hf_folders
from jaxformer.interop import weight_table as weight_table_lib
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model.config import ModelConfig
from jaxformer.storage.errors import InteropError

MODEL_TYPES = ('bert', 'roberta', 'xlm-roberta')
# model_type -> the prefix of the body's tensors in a model with a head.
PREFIXES = {'bert': 'bert', 'roberta': 'roberta', 'xlm-roberta': 'roberta'}
# hidden_act -> model.activation.
ACTIVATIONS = {'gelu': 'gelu_exact', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu', 'relu': 'relu'}
# How an architecture name ends -> what is imported (None: refused).
HEADS = {'ForSequenceClassification': 'head', 'Model': 'base',
         'ForMaskedLM': 'base', 'ForPreTraining': 'base',
         'ForTokenClassification': None, 'ForQuestionAnswering': None,
         'ForMultipleChoice': None, 'ForCausalLM': None,
         'ForNextSentencePrediction': None}
# Tensors of the heads a base import leaves behind, and computed buffers.
LEFT_BEHIND = ('cls.', 'lm_head.')
BUFFERS = ('embeddings.position_ids', 'embeddings.token_type_ids')
INIT_STDDEV = 0.02  # A fresh head's weights, as initializer_range.


class BertImportError(InteropError):
  """The folder cannot be imported; the message names the file or key."""


class Head(NamedTuple):
  """What sits on the body: 'classification' or 'regression', its width,
  the class names, and whether the folder has its weights."""
  task: str
  size: int
  labels: tuple[str, ...]
  present: bool


# --------------------------------------------------------------- config ---

def _architecture(hf: dict, folder: str) -> str:
  """'head' or 'base' from config.json's architectures."""
  names = hf.get('architectures') or ['Model']
  for name in names:
    for ending, kind in HEADS.items():
      if name.endswith(ending):
        if kind is None:
          raise BertImportError(
              f'{folder}/config.json: {name} has a head jaxformer lacks '
              f'({ending[3:]}); jaxformer imports *ForSequenceClassification '
              'models and base models (a fresh classifier head)')
        return kind
  raise BertImportError(f'{folder}/config.json: architectures {names} are '
                        'not a BERT-family model jaxformer imports')


def head(hf: dict, folder: str, num_labels: int | None) -> Head:
  """The head of the folder's model (its own), or a fresh one on a base
  model: of `num_labels` classes named '0', '1', ... (1: a regressor), or
  by default of 2 unnamed ones (the train TSV names them)."""
  if _architecture(hf, folder) == 'base':
    if num_labels == 1:
      return Head('regression', 1, (), False)
    if num_labels is None:  # Labels (and their number) from the train TSV.
      return Head('classification', 2, (), False)
    return Head('classification', num_labels,
                tuple(map(str, range(num_labels))), False)
  if num_labels is not None:
    raise BertImportError(f'--num-labels {num_labels}: {folder} has its own '
                          'classifier head (config.json id2label)')
  labels = hf.get('id2label') or {}
  count = hf.get('num_labels', len(labels) or 2)
  kind = hf.get('problem_type')
  if kind == 'multi_label_classification':
    raise BertImportError(f'{folder}/config.json: problem_type {kind!r} '
                          '(jaxformer classifies into one class per text)')
  if kind == 'regression' or count == 1:
    return Head('regression', count, (), True)
  names = tuple(str(labels.get(str(i), labels.get(i, f'LABEL_{i}')))
                for i in range(count))
  return Head('classification', count, names, True)


def refusals(hf: dict) -> list[str]:
  """What config.json asks that jaxformer cannot compute, one per key."""
  reasons = []
  act = hf.get('hidden_act', 'gelu')
  if act not in ACTIVATIONS:
    reasons.append(f'hidden_act={act!r} (supported: {", ".join(ACTIVATIONS)})')
  kind = hf.get('position_embedding_type', 'absolute')
  if kind != 'absolute':
    reasons.append(f'position_embedding_type={kind!r} (supported: absolute)')
  for key in ('is_decoder', 'add_cross_attention'):
    if hf.get(key):
      reasons.append(f'{key}=true (jaxformer imports encoders)')
  return reasons


def model_config(hf: dict, model_type: str, tokenizer, head_: Head
                 ) -> ModelConfig:
  """The ModelConfig of config.json (`refusals` empty) with the
  tokenizer's special ids and `head_`."""
  offset = 0 if model_type == 'bert' else hf.get('pad_token_id', 1) + 1
  dropout = float(hf.get('hidden_dropout_prob', 0.1))
  try:
    return ModelConfig(
        vocab_size=hf['vocab_size'], d_model=hf['hidden_size'],
        num_heads=hf['num_attention_heads'], d_ff=hf['intermediate_size'],
        num_encoder_layers=hf['num_hidden_layers'], num_decoder_layers=0,
        max_len=hf['max_position_embeddings'] - offset,
        position_offset=offset, position_embedding='learned',
        type_vocab_size=hf.get('type_vocab_size', 2), embedding_norm=True,
        pooler=True, pooling='first', norm_position='post',
        norm_type='layer', layer_norm_epsilon=float(
            hf.get('layer_norm_eps', 1e-12)),
        activation=ACTIVATIONS[hf.get('hidden_act', 'gelu')],
        scale_embedding=False, share_embeddings='all', use_bias=True,
        embedding_dropout=dropout, residual_dropout=dropout,
        attention_dropout=float(hf.get('attention_probs_dropout_prob', 0.1)),
        ffn_dropout=0.0, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
        num_classes=head_.size if head_.task == 'classification' else 2,
        regression_dim=head_.size if head_.task == 'regression' else 1)
  except KeyError as e:
    raise BertImportError(f'config.json has no {e.args[0]!r}') from None
  except (ValueError, TypeError) as e:
    raise BertImportError(f'config.json: {e}') from None


# ------------------------------------------------------------ the table ---

def _dense(name: str, path: tuple, out: int, inputs: int) -> list[Tensor]:
  return [tensor(f'{name}.weight', (*path, 'kernel'), (out, inputs)),
          tensor(f'{name}.bias', (*path, 'bias'), (out,))]


def _norm(name: str, path: tuple, d: int) -> list[Tensor]:
  return [tensor(f'{name}.weight', (*path, 'scale'), (d,)),
          tensor(f'{name}.bias', (*path, 'bias'), (d,))]


def _layer(config: ModelConfig, theirs: str, ours: tuple) -> list[Tensor]:
  d, f, n = config.d_model, config.d_ff, config.num_heads
  h = config.head_features
  attention = (*ours, 'self_attention')
  rows = []
  for name, our_name in (('query', 'query'), ('key', 'key'),
                         ('value', 'value')):
    prefix, path = f'{theirs}.attention.self.{name}', (*attention, our_name)
    rows.append(tensor(f'{prefix}.weight', (*path, 'kernel'), (d, d),
                       (n, h, d)))
    # jaxformer has no key bias: q.b_k is the same for every key of a
    # query, which the softmax cancels; it is read, checked and dropped.
    rows.append(tensor(f'{prefix}.bias', None if name == 'key' else (
        *path, 'bias'), (d,), (n, h)))
  rows.append(tensor(f'{theirs}.attention.output.dense.weight',
                     (*attention, 'out', 'kernel'), (d, d), (d, n, h)))
  rows.append(tensor(f'{theirs}.attention.output.dense.bias',
                     (*attention, 'out', 'bias'), (d,)))
  return (rows + _norm(f'{theirs}.attention.output.LayerNorm',
                       (*ours, 'self_attention_norm'), d)
          + _dense(f'{theirs}.intermediate.dense', (*ours, 'ffn', 'wi'), f, d)
          + _dense(f'{theirs}.output.dense', (*ours, 'ffn', 'wo'), d, f)
          + _norm(f'{theirs}.output.LayerNorm', (*ours, 'ffn_norm'), d))


def body_table(config: ModelConfig, prefix: str) -> list[Tensor]:
  """The encoder's tensors (names after `prefix`, '' or 'bert.' ...)."""
  d, body = config.d_model, ('body',)
  encoder = (*body, 'encoder')
  embeddings = f'{prefix}embeddings'
  rows = [tensor(f'{embeddings}.word_embeddings.weight',
                 (*body, 'embed', 'embedding'), (config.vocab_size, d)),
          tensor(f'{embeddings}.position_embeddings.weight',
                 (*encoder, 'positions', 'position_embedding'),
                 (config.max_len + config.position_offset, d))]
  if config.type_vocab_size:
    rows.append(tensor(f'{embeddings}.token_type_embeddings.weight',
                       (*encoder, 'token_types', 'embedding'),
                       (config.type_vocab_size, d)))
  rows += _norm(f'{embeddings}.LayerNorm', (*encoder, 'embedding_norm'), d)
  for i in range(config.num_encoder_layers):
    rows += _layer(config, f'{prefix}encoder.layer.{i}',
                   (*encoder, f'layer_{i}'))
  return rows


def head_table(config: ModelConfig, model_type: str, task: str
               ) -> list[Tensor]:
  """The pooler and the head of a *ForSequenceClassification model."""
  d, name = config.d_model, 'classifier' if task == 'classification' else (
      'regressor')
  size = config.num_classes if task == 'classification' else (
      config.regression_dim)
  if model_type == 'bert':
    return (_dense('bert.pooler.dense', ('body', 'pooler'), d, d)
            + _dense('classifier', (name,), size, d))
  return (_dense('classifier.dense', ('body', 'pooler'), d, d)
          + _dense('classifier.out_proj', (name,), size, d))


def weight_table(config: ModelConfig, model_type: str, task: str,
                 with_head: bool, prefix: str | None = None) -> list[Tensor]:
  """Every tensor of the Hugging Face model of `config`: the body (its
  names after `prefix`; by default the head model's, e.g. 'bert.') and,
  `with_head`, the pooler and head."""
  if prefix is None:
    prefix = PREFIXES[model_type] + '.'
  rows = body_table(config, prefix)
  return rows + head_table(config, model_type, task) if with_head else rows


def _prefix(weights, model_type: str, folder: str) -> str:
  """'' (a base model saved alone) or 'bert.' / 'roberta.'."""
  for prefix in (PREFIXES[model_type] + '.', ''):
    if f'{prefix}embeddings.word_embeddings.weight' in weights:
      return prefix
  raise BertImportError(f'{folder}: the weights have no '
                        'embeddings.word_embeddings.weight; is this a '
                        f'{model_type} checkpoint?')


def _fresh(shape: tuple, rng: np.random.RandomState) -> np.ndarray:
  if len(shape) == 1:
    return np.zeros(shape, np.float32)
  return (INIT_STDDEV * rng.standard_normal(shape)).astype(np.float32)


def params_from_weights(weights: dict, config: ModelConfig, model_type: str,
                        head_: Head, folder: str, seed: int = 0) -> dict:
  """`EncoderClassifier`/`EncoderRegressor(config)` parameters (numpy
  float32): every tensor of the table checked present with its shape
  before any is copied, nothing left over but a base model's pre-training
  heads; a base model's missing pooler and its head are drawn fresh."""
  prefix = _prefix(weights, model_type, folder)
  table = body_table(config, prefix)
  fresh = head_table(config, model_type, head_.task)
  if head_.present:
    table, fresh = table + fresh, []
  elif f'{prefix}pooler.dense.weight' in weights:
    table += _dense(f'{prefix}pooler.dense', ('body', 'pooler'),
                    config.d_model, config.d_model)
    fresh = fresh[2:]
  read_from = weight_table_lib.check(
      weights, table, BertImportError,
      f'a {model_type} model of this config.json',
      lambda n: n.endswith(BUFFERS) or (
          not head_.present and n.startswith(LEFT_BEHIND)))
  params = weight_table_lib.read(weights, table, read_from)
  rng = np.random.RandomState(seed)
  for row in fresh:
    weight_table_lib.place(params, row.path, _fresh(row.our_shape, rng))
  return params


# --------------------------------------------------------------- import ---

def run_config(base, config: ModelConfig, tokenizer, head_: Head):
  """The saved run config: `base` (default_config()) as a classifier or
  regressor of `config` on TSV files, with the tokenizer's size."""
  run = base
  run.task = head_.task
  run.model.update(dataclasses.asdict(config))
  run.data.tokenizer.update(joint=True, vocab_size=tokenizer.vocab_size)
  run.data.update(source='tsv', labels=list(head_.labels),
                  max_source_length=config.max_len)
  return run


def read_config(folder: str) -> tuple[dict, str]:
  """(config.json, its model_type) of a BERT-family folder."""
  return hf_folders.checked_config(folder, MODEL_TYPES,
                                  lambda hf, _: refusals(hf), BertImportError)


def _check_ids(hf: dict, tokenizer, folder: str) -> None:
  pad = hf.get('pad_token_id')
  if pad is not None and pad != tokenizer.pad_id:
    raise BertImportError(f'{folder}: config.json pad_token_id is {pad} but '
                          f'the tokenizer pads with {tokenizer.pad_id}; the '
                          'tokenizer files do not belong to this model')


def import_folder(folder: str, out: str, base_config,
                  num_labels: int | None = None,
                  keep_provenance: bool = False, adapt=None
                  ) -> tuple[ModelConfig, str, str]:
  """Writes the jaxformer export of the BERT-family model in `folder` to
  `out` (which must not exist); returns its ModelConfig, model_type and
  task ('classification' or 'regression'). `adapt` (config, params,
  table) -> (config, params) adds adapters (peft.py)."""
  folder = os.path.abspath(folder)
  try:
    out = folders.check_new(out)
  except ValueError as e:
    raise BertImportError(str(e)) from None
  hf, model_type = read_config(folder)
  head_ = head(hf, folder, num_labels)
  try:
    tokenizer = hf_folders.load_tokenizer(folder, hf.get('vocab_size'))
  except hf_folders.FolderError as e:
    raise BertImportError(str(e)) from None
  _check_ids(hf, tokenizer, folder)
  config = model_config(hf, model_type, tokenizer, head_)
  weights = bart_weights.read_weights(folder, BertImportError)
  params = params_from_weights(weights, config, model_type, head_, folder)
  if adapt:
    config, params = adapt(config, params, weight_table(
        config, model_type, head_.task, True,
        _prefix(weights, model_type, folder)))
  run = run_config(base_config, config, tokenizer, head_)
  folders.write_import(out, params, run, [tokenizer], folder, keep_provenance)
  return config, model_type, head_.task


def report(config: ModelConfig, model_type: str, task: str, out: str) -> str:
  what = (f'{config.num_classes} classes' if task == 'classification'
          else f'regression, {config.regression_dim} value(s)')
  return (f'Imported a {model_type} encoder ({config.num_encoder_layers} '
          f'layers, d_model {config.d_model}, {config.num_heads} heads, '
          f'vocabulary {config.vocab_size}, {what}) to {out}; use it like a '
          'workdir:\n'
          f'  jaxformer predict --workdir {out} --input FILE --jsonl\n'
          f'  jaxformer export --format hf --from {out} --out DIR')
