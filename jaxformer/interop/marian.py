"""`jaxformer import`: a Hugging Face Marian (OPUS-MT) folder -> a jaxformer
export, which `translate`, `evaluate`, `attention` and fine-tuning
(`--config.init.pretrained`) read like any other.

The folder holds config.json, model.safetensors or its shards (read with
safetensor_files.py, no torch) or pytorch_model.bin (needs torch), and the
tokenizer: source.spm, target.spm, vocab.json (and target_vocab.json for
separate vocabularies). Marian is the paper's post-LN Transformer; what
differs is said by model options (`ModelConfig`): the sinusoid layout
'halves', swish or exact GELU, scale_embedding, an output bias
(final_logits_bias) with tied embeddings, and the vocabulary's special ids
(EOS 0, UNK 1, PAD the last id, which also starts the decoder from a zero
vector: zero_pad_embedding). Anything else is refused, naming the key.

`WEIGHTS` is the one table of names: their name -> our path, transform.
Every shape is checked before anything is written; the export is written
to a temporary folder beside `out` and renamed when complete.
"""
import os
import sys
from typing import Callable

import numpy as np

from jaxformer.data import vocab_tokenizer
from jaxformer.interop import bart_weights, config_bounds, folders
from jaxformer.interop import weight_table as weight_table_lib
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model.config import ModelConfig
from jaxformer.storage.errors import DataError, InteropError

ACTIVATIONS = {'swish': 'swish', 'silu': 'swish', 'relu': 'relu',
               'gelu': 'gelu_exact', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu'}
# Options of other Marian-like configs that jaxformer cannot express, with
# the value it can.
UNSUPPORTED = {'normalize_before': False, 'add_final_layer_norm': False,
               'normalize_embedding': False, 'layernorm_embedding': False,
               'static_position_embeddings': True, 'add_bias_logits': False,
               'tie_word_embeddings': True, 'is_decoder': False}
# Marian's config key -> must equal this one (jaxformer has one of each).
SAME = {'decoder_ffn_dim': 'encoder_ffn_dim',
        'decoder_attention_heads': 'encoder_attention_heads'}


MODEL_TYPE = 'marian'
FAMILY = 'Marian'


class MarianImportError(InteropError):
  """The folder cannot be imported; the message names the file or key."""


def _read_config(folder: str) -> dict:
  """config.json, its sizes checked against the weights and the folder
  against links out of it (config_bounds.py)."""
  config_bounds.check_links(folder, MarianImportError)
  path = os.path.join(folder, 'config.json')
  if not os.path.isfile(path):
    raise MarianImportError(f'{folder} is not a Hugging Face Marian folder: no '
                       'config.json (download one with `huggingface-cli '
                       'download Helsinki-NLP/opus-mt-en-de --local-dir DIR`)')
  try:
    config = vocab_tokenizer.read_json(path)
  except DataError as e:
    raise MarianImportError(str(e)) from None
  if config.get('model_type') != MODEL_TYPE:
    raise MarianImportError(f'{path}: model_type is {config.get("model_type")!r}, '
                       "not 'marian'; only Marian (OPUS-MT) models import")
  config_bounds.check_sizes(folder, config, MarianImportError)
  return config


def model_config(hf: dict) -> ModelConfig:
  """The ModelConfig of a Marian config.json; refuses what it cannot
  express, naming the key."""
  for key, wanted in UNSUPPORTED.items():
    if key in hf and hf[key] != wanted:
      raise MarianImportError(f'config.json: {key}={hf[key]!r} is not supported '
                         f'(jaxformer imports Marian models with {key}='
                         f'{wanted!r})')
  for key, other in SAME.items():
    if hf.get(key, hf.get(other)) != hf.get(other):
      raise MarianImportError(f'config.json: {key}={hf[key]} differs from '
                         f'{other}={hf.get(other)}; jaxformer has one of each')
  activation = hf.get('activation_function', 'gelu')
  if activation not in ACTIVATIONS:
    raise MarianImportError(f'config.json: activation_function={activation!r} is '
                       f'not supported (one of {sorted(ACTIVATIONS)})')
  shared = hf.get('share_encoder_decoder_embeddings', True)
  vocab_size = hf['vocab_size']
  target_size = hf.get('decoder_vocab_size') or vocab_size
  if shared and target_size != vocab_size:
    raise MarianImportError(f'config.json: share_encoder_decoder_embeddings with '
                       f'decoder_vocab_size={target_size} != vocab_size='
                       f'{vocab_size}')
  dropout = float(hf.get('dropout', 0.1))
  try:
    return ModelConfig(
        vocab_size=vocab_size, target_vocab_size=0 if shared else target_size,
        d_model=hf['d_model'], num_heads=hf['encoder_attention_heads'],
        d_ff=hf['encoder_ffn_dim'], num_encoder_layers=hf['encoder_layers'],
        num_decoder_layers=hf['decoder_layers'],
        max_len=hf['max_position_embeddings'],
        share_embeddings='all' if shared else 'target',
        norm_position='post', activation=ACTIVATIONS[activation],
        position_embedding='sinusoidal', sinusoid_layout='halves',
        scale_embedding=bool(hf.get('scale_embedding', False)),
        output_bias=True, pad_id=hf['pad_token_id'],
        eos_id=hf['eos_token_id'],
        decoder_start_id=hf.get('decoder_start_token_id',
                                hf['pad_token_id']),
        zero_pad_embedding=True, embedding_dropout=dropout,
        residual_dropout=dropout,
        attention_dropout=float(hf.get('attention_dropout', 0.0)),
        ffn_dropout=float(hf.get('activation_dropout', 0.0)),
        layer_norm_epsilon=1e-5, use_bias=True)
  except KeyError as e:
    raise MarianImportError(f'config.json has no {e.args[0]!r}') from None
  except ValueError as e:
    raise MarianImportError(f'config.json: {e}') from None


# ------------------------------------------------------------ the table ---

def weight_table(config: ModelConfig) -> list[Tensor]:
  """Every tensor of `MarianMTModel` of `config` (less the computed
  sinusoid tables): the embeddings, the output layer and its bias, and the
  layers (`bart_weights.layer_rows`)."""
  d = config.d_model
  vocab, target = config.vocab_size, config.output_vocab_size
  if config.share_embeddings == 'all':
    rows = [tensor(('model.shared.weight', 'model.encoder.embed_tokens.weight',
                    'model.decoder.embed_tokens.weight', 'lm_head.weight'),
                   ('source_embed', 'embedding'), (vocab, d))]
  else:
    rows = [tensor(('model.encoder.embed_tokens.weight', 'model.shared.weight'),
                   ('source_embed', 'embedding'), (vocab, d))]
    if config.share_embeddings == 'none':
      rows += [tensor('model.decoder.embed_tokens.weight',
                      ('target_embed', 'embedding'), (target, d)),
               tensor('lm_head.weight', ('decoder', 'logits', 'kernel'),
                      (target, d))]
    else:
      rows.append(tensor(('model.decoder.embed_tokens.weight',
                          'lm_head.weight'),
                         ('target_embed', 'embedding'), (target, d)))
  bias = (('decoder', 'logits', 'bias') if config.share_embeddings == 'none'
          else ('decoder', 'output_bias'))
  rows.append(tensor('final_logits_bias', bias, (1, target), (target,)))
  return rows + bart_weights.layer_rows(config)


POSITION_TABLES = ('model.encoder.embed_positions.weight',
                   'model.decoder.embed_positions.weight')


def params_from_weights(weights: dict, config: ModelConfig,
                        warn: Callable[[str], None] = print) -> dict:
  """`EncoderDecoder(config)` parameters from Marian's tensors (numpy).

  Every tensor of the table must be present with its shape, tied names
  must hold equal tensors, and nothing may be left over (saved sinusoid
  tables must be Marian's); raises MarianImportError naming the tensor.
  """
  from jaxformer.model.layers import sinusoidal_positions
  params = weight_table_lib.load(
      weights, weight_table(config), MarianImportError,
      'a Marian checkpoint of config.json', POSITION_TABLES.__contains__)
  for name in POSITION_TABLES:
    if name in weights:
      table = weights[name]
      ours = sinusoidal_positions(table.shape[0], config.d_model, 'halves')
      if table.shape != ours.shape or not np.allclose(table, ours,
                                                      atol=1e-4):
        raise MarianImportError(f'{name} is not Marian\'s sinusoid table')
  _zero_pad_rows(params, config, warn)
  return params


def _zero_pad_rows(params: dict, config: ModelConfig, warn) -> None:
  """Marian and CTranslate2 start the decoder from a zero vector, Hugging
  Face from the pad row: equal when it is zero. jaxformer holds it at zero
  (zero_pad_embedding), so the written row is zero too."""
  for name in ('source_embed', 'target_embed'):
    if name not in params:
      continue
    table = params[name]['embedding']
    norm = float(np.linalg.norm(table[config.pad_id]))
    if norm:
      warn(f'warning: the pad row (id {config.pad_id}) of {name} has norm '
           f'{norm:.4g}, not zero: Hugging Face starts decoding from it, '
           'Marian, CTranslate2 and jaxformer from zeros; it is imported as '
           'zeros, so outputs may differ from Hugging Face\'s.')
      table[config.pad_id] = 0.0


def check_torch_version(version: str, path: str) -> None:
  """Raises unless torch `version` ('2.13.0+cpu') may unpickle `path`."""
  bart_weights.check_torch_version(version, path, MarianImportError)


def read_weights(folder: str) -> dict:
  """{name: float32 array} of model.safetensors or its shards (numpy
  only), else of pytorch_model.bin (torch at least TORCH_FLOOR)."""
  return bart_weights.read_weights(folder, MarianImportError)


# --------------------------------------------------------------- import ---

def _tokenizers(folder: str, config: ModelConfig):
  try:
    source, target = vocab_tokenizer.from_marian_folder(folder)
  except DataError as e:
    raise MarianImportError(f'{e} (BPE vocabularies are not supported)') from None
  checks = (('vocab.json', source.vocab_size, config.vocab_size,
             'vocab_size'),
            ('target vocabulary', target.vocab_size, config.output_vocab_size,
             'decoder_vocab_size'),
            ('vocab.json <pad>', source.pad_id, config.pad_id, 'pad_token_id'),
            ('target <pad>', target.pad_id, config.pad_id, 'pad_token_id'),
            ('target </s>', target.eos_id, config.eos_id, 'eos_token_id'))
  for what, theirs, ours, key in checks:
    if theirs != ours:
      raise MarianImportError(f'{folder}: {what} is {theirs} but config.json '
                         f'{key} says {ours}; the tokenizer files do not '
                         'belong to this model')
  return source, target


def run_config(base, config: ModelConfig, source, target):
  """The saved run config: `base` (default_config()) with the model, the
  tokenizers' sizes, TSV data and the model's length."""
  import dataclasses
  run = base
  run.model.update(dataclasses.asdict(config))
  run.data.tokenizer.update(joint=False, vocab_size=source.vocab_size,
                            target_vocab_size=target.vocab_size)
  # Evaluated and fine-tuned on the user's TSV files:
  # --config.data.tsv.test=FILE.
  run.data.update(source='tsv', max_source_length=config.max_len,
                  max_target_length=config.max_len)
  return run


def import_folder(folder: str, out: str, base_config,
                  warn: Callable[[str], None] = print,
                  keep_provenance: bool = False, adapt=None) -> ModelConfig:
  """Writes the jaxformer export of the Marian model in `folder` to `out`
  (which must not exist; it records `folder` if `keep_provenance`);
  returns its ModelConfig. `adapt` (config, params, table) -> (config,
  params) adds adapters (peft.py)."""
  folder = os.path.abspath(folder)
  out = os.path.abspath(out)
  if not os.path.isdir(folder):
    raise MarianImportError(f'--from {folder} is not a folder')
  if os.path.exists(out):
    raise MarianImportError(f'--out {out} already exists; choose another or '
                       'remove it first')
  config = model_config(_read_config(folder))
  source, target = _tokenizers(folder, config)
  params = params_from_weights(read_weights(folder), config, warn)
  if adapt:
    config, params = adapt(config, params, weight_table(config))
  run = run_config(base_config, config, source, target)
  folders.write_import(out, params, run, [source, target], folder,
                       keep_provenance)
  return config


def report(config: ModelConfig, out: str) -> str:
  return (f'Imported a Marian model (d_model {config.d_model}, '
          f'{config.num_encoder_layers}+{config.num_decoder_layers} layers, '
          f'vocabulary {config.vocab_size}'
          + (f'/{config.output_vocab_size}' if config.target_vocab_size
             else '') +
          f', {config.activation}) to {out}; use it like a workdir:\n'
          f'  jaxformer translate --workdir {out}\n'
          f'  jaxformer train --config configs/finetune.py --workdir RUN '
          f'--config.init.pretrained={out} --config.data.tsv.train=...')


def main_warn(text: str) -> None:
  print(text, file=sys.stderr, flush=True)
