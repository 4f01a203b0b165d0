"""`jaxformer import` of a Hugging Face many-to-many translator: config.json
model_type 'm2m_100', which M2M100 and the dense NLLB-200 checkpoints share
(their tokenizers differ: M2M100Tokenizer, NllbTokenizer).

M2M100 is a pre-LN Transformer with final LayerNorms on both stacks, ReLU,
embeddings scaled by sqrt(d_model) and shared by encoder, decoder and the
output layer (no output bias), and fairseq's sinusoid ('tensor2tensor'
layout) counted from padding_idx + 1 (position_offset). Its decoder starts
from </s>; the first generated token is the target language's, which
`translate` forces (Hugging Face's forced_bos_token_id). What else a
config.json asks that jaxformer cannot compute is refused, naming the key.

`weight_table` is the one table of names (the layers' rows are
bart_weights.py's, shared with Marian); hf_m2m100.py writes with it.
Every shape is checked before anything is written; the export is written
whole or not at all. The tokenizer (data/language_tokenizer.py) travels in
the export.
"""
import dataclasses
import os

import numpy as np

from jaxformer.data import sources
from jaxformer.data import language_tokenizer, vocab_tokenizer
from jaxformer.interop import bart_weights, config_bounds, folders, hf_folders
from jaxformer.interop import weight_table as weight_table_lib
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model.config import ModelConfig
from jaxformer.storage.errors import DataError, InteropError

MODEL_TYPE = 'm2m_100'
ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu_exact', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu', 'swish': 'swish', 'silu': 'swish'}
# M2M100's config key -> must equal this one (jaxformer has one of each).
SAME = {'decoder_ffn_dim': 'encoder_ffn_dim',
        'decoder_attention_heads': 'encoder_attention_heads'}
# Sinusoid tables older checkpoints saved; computed, checked if present.
POSITION_TABLES = ('model.encoder.embed_positions.weights',
                   'model.decoder.embed_positions.weights',
                   'model.encoder.embed_positions._float_tensor',
                   'model.decoder.embed_positions._float_tensor')
FAMILY = 'M2M100/NLLB'


class M2M100ImportError(InteropError):
  """The folder cannot be imported; the message names the file or key."""


def read_config(folder: str) -> dict:
  """config.json, its sizes checked against the weights and the folder
  against links out of it (config_bounds.py)."""
  config_bounds.check_links(folder, M2M100ImportError)
  try:
    hf = hf_folders.read_json(folder, 'config.json')
  except hf_folders.FolderError as e:
    raise M2M100ImportError(str(e)) from None
  if hf.get('model_type') != MODEL_TYPE:
    raise M2M100ImportError(f'{folder}/config.json: model_type is '
                            f'{hf.get("model_type")!r}, not {MODEL_TYPE!r}')
  config_bounds.check_sizes(folder, hf, M2M100ImportError)
  return hf


def model_config(hf: dict) -> ModelConfig:
  """The ModelConfig of an M2M100 config.json; refuses what it cannot
  express, naming the key."""
  for key, other in SAME.items():
    if hf.get(key, hf.get(other)) != hf.get(other):
      raise M2M100ImportError(f'config.json: {key}={hf[key]} differs from '
                              f'{other}={hf.get(other)}; jaxformer has one '
                              'of each')
  activation = hf.get('activation_function', 'relu')
  if activation not in ACTIVATIONS:
    raise M2M100ImportError(f'config.json: activation_function={activation!r}'
                            f' is not supported (one of {sorted(ACTIVATIONS)})')
  dropout = float(hf.get('dropout', 0.1))
  try:
    pad = hf['pad_token_id']
    return ModelConfig(
        vocab_size=hf['vocab_size'], d_model=hf['d_model'],
        num_heads=hf['encoder_attention_heads'], d_ff=hf['encoder_ffn_dim'],
        num_encoder_layers=hf['encoder_layers'],
        num_decoder_layers=hf['decoder_layers'],
        max_len=hf['max_position_embeddings'], share_embeddings='all',
        norm_position='pre', activation=ACTIVATIONS[activation],
        position_embedding='sinusoidal', sinusoid_layout='tensor2tensor',
        position_offset=pad + 1,
        scale_embedding=bool(hf.get('scale_embedding', True)),
        output_bias=False, pad_id=pad, eos_id=hf['eos_token_id'],
        decoder_start_id=hf.get('decoder_start_token_id', hf['eos_token_id']),
        embedding_dropout=dropout, residual_dropout=dropout,
        attention_dropout=float(hf.get('attention_dropout', 0.0)),
        ffn_dropout=float(hf.get('activation_dropout', 0.0)),
        layer_norm_epsilon=1e-5, use_bias=True)
  except KeyError as e:
    raise M2M100ImportError(f'config.json has no {e.args[0]!r}') from None
  except (ValueError, TypeError) as e:
    raise M2M100ImportError(f'config.json: {e}') from None


def weight_table(config: ModelConfig) -> list[Tensor]:
  """Every tensor of `M2M100ForConditionalGeneration` of `config` (less
  the computed sinusoid tables)."""
  d = config.d_model
  rows = [tensor(('model.shared.weight', 'model.encoder.embed_tokens.weight',
                  'model.decoder.embed_tokens.weight', 'lm_head.weight'),
                 ('source_embed', 'embedding'), (config.vocab_size, d))]
  for side in ('encoder', 'decoder'):
    rows += bart_weights.linear_rows(f'model.{side}.layer_norm',
                                     (side, 'final_norm'), d, None)
  return rows + bart_weights.layer_rows(config)


def params_from_weights(weights, config: ModelConfig) -> dict:
  """`EncoderDecoder(config)` parameters from M2M100's tensors (numpy);
  raises M2M100ImportError naming a missing, misshapen, untied or
  unexpected tensor, or a saved sinusoid table that is not M2M100's."""
  from jaxformer.model.layers import sinusoidal_positions
  params = weight_table_lib.load(
      weights, weight_table(config), M2M100ImportError,
      f'a {FAMILY} checkpoint of config.json', POSITION_TABLES.__contains__)
  for name in POSITION_TABLES[:2]:
    if name in weights:
      table = np.array(weights[name])
      ours = sinusoidal_positions(table.shape[0], config.d_model,
                                  'tensor2tensor')
      ours[config.pad_id] = 0.0
      if table.shape != ours.shape or not np.allclose(table, ours, atol=1e-4):
        raise M2M100ImportError(f'{name} is not M2M100\'s sinusoid table')
  return params


# ------------------------------------------------------------ tokenizer ---

def _m2m100_tokenizer(hf, folder: str, config: ModelConfig):
  """M2M100Tokenizer: SentencePiece pieces looked up in vocab.json, then
  the language tokens, then fairseq's made-up words."""
  try:
    inner = vocab_tokenizer.VocabTokenizer(
        sources.read_bytes(hf.spm_file),
        vocab_tokenizer.vocabulary_list(hf.encoder, hf.vocab_file),
        name=hf.spm_file)
  except DataError as e:
    raise M2M100ImportError(str(e)) from None
  pieces = {i: token for token, i in hf.lang_token_to_id.items()}
  first = inner.vocab_size + len(pieces)
  pieces.update({i: f'madeupword{i - first}'
                 for i in range(first, config.vocab_size)})
  return language_tokenizer.LanguageTokenizer(
      inner, hf.lang_code_to_id, vocab_size=config.vocab_size,
      language=hf.src_lang, pieces=pieces, name=os.path.join(folder,
                                                             'vocab.json'))


def _nllb_tokenizer(hf, folder: str, config: ModelConfig):
  """NllbTokenizer: its tokenizer.json, encoding `pieces </s>`; the
  language tokens are its extra special tokens."""
  from tokenizers import processors
  codes = list(getattr(hf, 'extra_special_tokens', None) or
               getattr(hf, 'additional_special_tokens', None) or [])
  languages = {code: hf.convert_tokens_to_ids(code) for code in codes}
  eos = hf.eos_token
  hf.backend_tokenizer.post_processor = processors.TemplateProcessing(
      single=['$A', eos], pair=['$A', '$B', eos],
      special_tokens=[(eos, hf.eos_token_id)])
  inner = hf_folders.load_tokenizer(folder, config.vocab_size, hf)
  pieces = {i: f'madeupword{i - inner.vocab_size}'
            for i in range(inner.vocab_size, config.vocab_size)}
  return language_tokenizer.LanguageTokenizer(
      inner, languages, vocab_size=config.vocab_size,
      language=hf.src_lang, pieces=pieces,
      layout='suffix' if getattr(hf, 'legacy_behaviour', False) else 'prefix',
      name=inner.name)


def load_tokenizer(folder: str, config: ModelConfig
                   ) -> language_tokenizer.LanguageTokenizer:
  """The folder's M2M100 or NLLB tokenizer (by tokenizer_config.json's
  tokenizer_class, else by its files), as `LanguageTokenizer`."""
  kind = hf_folders.read_json(folder, 'tokenizer_config.json',
                              required=False).get('tokenizer_class') or ''
  nllb = kind.startswith('Nllb') or not kind and not os.path.isfile(
      os.path.join(folder, 'vocab.json')) and os.path.isfile(
          os.path.join(folder, 'tokenizer.json'))
  needed = ('tokenizer.json',) if nllb else ('vocab.json',
                                              'sentencepiece.bpe.model')
  for name in needed:
    if not os.path.isfile(os.path.join(folder, name)):
      raise M2M100ImportError(
          f'{os.path.join(folder, name)} is missing; an '
          f'{"NLLB" if nllb else "M2M100"} folder has '
          f'{" and ".join(needed)} (copy the model\'s tokenizer files)')
  try:
    hf = hf_folders.auto_tokenizer(folder, needed[0])
    tokenizer = (_nllb_tokenizer if nllb else _m2m100_tokenizer)(
        hf, folder, config)
  except (hf_folders.FolderError, DataError) as e:
    raise M2M100ImportError(str(e)) from None
  for what, theirs, ours, key in (
      ('</s>', tokenizer.eos_id, config.eos_id, 'eos_token_id'),
      ('<pad>', tokenizer.pad_id, config.pad_id, 'pad_token_id')):
    if theirs != ours:
      raise M2M100ImportError(f'{folder}: the tokenizer\'s {what} is {theirs} '
                              f'but config.json {key} says {ours}; the '
                              'tokenizer files do not belong to this model')
  return tokenizer


# --------------------------------------------------------------- import ---

def run_config(base, config: ModelConfig, tokenizer):
  """The saved run config: `base` (default_config()) with the model, the
  joint tokenizer's size, TSV data and the model's length."""
  run = base
  run.model.update(dataclasses.asdict(config))
  run.data.tokenizer.update(joint=True, vocab_size=tokenizer.vocab_size)
  run.data.update(source='tsv', max_source_length=config.max_len,
                  max_target_length=config.max_len)
  return run


def import_folder(folder: str, out: str, base_config,
                  keep_provenance: bool = False, adapt=None
                  ) -> tuple[ModelConfig, int]:
  """Writes the jaxformer export of the M2M100/NLLB model in `folder` to
  `out` (which must not exist; it records `folder` if keep_provenance);
  returns its ModelConfig and how many languages it has. `adapt` (config,
  params, table) -> (config, params) adds adapters (peft.py)."""
  folder = os.path.abspath(folder)
  try:
    out = folders.check_new(out)
  except ValueError as e:
    raise M2M100ImportError(str(e)) from None
  config = model_config(read_config(folder))
  tokenizer = load_tokenizer(folder, config)
  params = params_from_weights(
      bart_weights.read_weights(folder, M2M100ImportError), config)
  if adapt:
    config, params = adapt(config, params, weight_table(config))
  folders.write_import(out, params, run_config(base_config, config, tokenizer),
                       [tokenizer], folder, keep_provenance)
  return config, len(tokenizer.languages)


def report(config: ModelConfig, tokenizer_languages: int, out: str) -> str:
  return (f'Imported an M2M100/NLLB model (d_model {config.d_model}, '
          f'{config.num_encoder_layers}+{config.num_decoder_layers} layers, '
          f'vocabulary {config.vocab_size}, {tokenizer_languages} languages) '
          f'to {out}; use it like a workdir:\n'
          f'  jaxformer translate --workdir {out} --source-lang SRC '
          '--target-lang TGT\n'
          f'  jaxformer export --format hf --from {out} --out DIR')
