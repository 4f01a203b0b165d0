"""A jaxformer translation model as a Hugging Face Marian folder, which
`MarianMTModel.from_pretrained` and `MarianTokenizer.from_pretrained` load
offline: `config.json`, `generation_config.json`, `model.safetensors`,
`source.spm`, `target.spm`, `vocab.json` (and `target_vocab.json` with
separate vocabularies) and `tokenizer_config.json`.

Hugging Face's Marian is one architecture: post-LN, the fixed sinusoid in
Marian's layout (sines then cosines; the table is computed, never saved),
LayerNorm epsilon 1e-5, every projection biased, as many key/value heads
as query heads, d_model / heads wide. A jaxformer model that differs in one
of these (or uses RMSNorm, rotary positions or a gated FFN) is refused,
naming the option (`blockers`); its FFN activation, embedding scale,
shared or separate vocabularies, tied or separate output layer, output
bias and special ids all map, and missing biases are written as zeros.
"""
import json
import os

import numpy as np

from jaxformer.interop import bart_weights, folders, layout, marian
from jaxformer.interop import weight_table
from jaxformer.model.config import ModelConfig

# jaxformer activation -> transformers' ACT2FN name.
ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu_new', 'gelu_exact': 'gelu',
               'swish': 'swish'}
MARIAN_EPSILON = 1e-5  # nn.LayerNorm's default, which Marian's layers keep.


def blockers(config: ModelConfig) -> list[str]:
  """Why `config` cannot be written as a Hugging Face Marian model: one
  reason per option (empty if it can)."""
  reasons = []
  if config.norm_position != 'post':
    reasons.append(f"model.norm_position={config.norm_position!r}: Marian's "
                   "layers are post-LN ('post')")
  if config.position_embedding != 'sinusoidal':
    reasons.append(f'model.position_embedding={config.position_embedding!r}: '
                   "Marian's positions are the fixed sinusoid ('sinusoidal')")
  elif config.sinusoid_layout != 'halves':
    reasons.append(
        "model.sinusoid_layout='interleaved' (the paper's table): Marian "
        "computes its own table, sines then cosines ('halves'), and loads "
        'none from a checkpoint')
  if config.layer_norm_epsilon != MARIAN_EPSILON:
    reasons.append(f'model.layer_norm_epsilon={config.layer_norm_epsilon:g}: '
                   f"Marian's LayerNorms use {MARIAN_EPSILON:g}")
  if config.activation not in ACTIVATIONS:
    reasons.append(f'model.activation={config.activation!r} has no Marian '
                   f'equivalent ({", ".join(ACTIVATIONS)} do)')
  return reasons + layout.paper_attention_blockers(config)


def marian_config(config: ModelConfig) -> dict:
  """The `MarianConfig` keyword arguments of `config`."""
  pad = config.pad_id
  eos = config.eos_id
  shared = config.share_embeddings == 'all'
  return dict(
      vocab_size=config.vocab_size,
      decoder_vocab_size=config.output_vocab_size,
      share_encoder_decoder_embeddings=shared,
      tie_word_embeddings=config.share_embeddings != 'none',
      d_model=config.d_model, max_position_embeddings=config.max_len,
      encoder_layers=config.num_encoder_layers,
      decoder_layers=config.num_decoder_layers,
      encoder_attention_heads=config.num_heads,
      decoder_attention_heads=config.num_heads,
      encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
      activation_function=ACTIVATIONS[config.activation],
      scale_embedding=config.scale_embedding,
      dropout=config.residual_dropout,
      attention_dropout=config.attention_dropout,
      activation_dropout=config.ffn_dropout,
      pad_token_id=pad, eos_token_id=eos,
      decoder_start_token_id=config.decoder_start_id,
      forced_eos_token_id=None, bos_token_id=None)


def state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """`MarianMTModel(MarianConfig(**marian_config(config)))`'s weights
  (without the computed position tables) as float32 arrays, written by
  marian.py's table: the embeddings as the model reads them (a zero pad
  row), zeros for the biases it has none of."""
  params = layout.numpy_tree(params)
  for side, count in (('encoder', config.num_encoder_layers),
                      ('decoder', config.num_decoder_layers)):
    params[side] = layout.looped(params[side], count)
  source, target = layout.embeddings(params, config)
  params['source_embed']['embedding'] = source
  if 'target_embed' in params:
    params['target_embed']['embedding'] = target
  state = weight_table.write(params, marian.weight_table(config))
  if config.share_embeddings != 'all':
    # The table reads a separate source table under either name; a model
    # that shares none has no model.shared.
    del state['model.shared.weight']
  return state


def _vocab(tokenizer, size: int) -> dict[str, int]:
  return {tokenizer.id_to_piece(i): i for i in range(size)}


def tokenizer_files(directory: str, source_tok, target_tok,
                    config: ModelConfig) -> None:
  """MarianTokenizer's files: the SentencePiece models, piece -> id
  vocabularies, and the special pieces."""
  separate = config.share_embeddings != 'all'
  files = {'source.spm': source_tok.sentencepiece_model,
           'target.spm': target_tok.sentencepiece_model}
  vocabularies = {'vocab.json': _vocab(source_tok, config.vocab_size)}
  if separate:
    vocabularies['target_vocab.json'] = _vocab(target_tok,
                                               config.output_vocab_size)
  target_piece = target_tok.id_to_piece
  tokenizer_config = dict(
      tokenizer_class='MarianTokenizer', separate_vocabs=separate,
      model_max_length=config.max_len,
      pad_token=target_piece(config.pad_id),
      eos_token=target_piece(config.eos_id),
      unk_token=target_piece(target_tok.unk_id))
  for name, contents in files.items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(contents)
  for name, contents in dict(vocabularies, **{
      'tokenizer_config.json': tokenizer_config}).items():
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      json.dump(contents, f, ensure_ascii=False, indent=1)


def marian_model(params, config: ModelConfig):
  """The `transformers.MarianMTModel` (float32, eval mode) of `params`."""
  from transformers import MarianConfig, MarianMTModel
  model = bart_weights.load_into_torch(
      MarianMTModel(MarianConfig(**marian_config(config))).eval(),
      state_dict(params, config), 'Marian')
  # generate()'s defaults: greedy search of up to max_len tokens, as
  # jaxformer's longest (max_length counts the start token too).
  model.generation_config.update(max_length=config.max_len + 1, num_beams=1,
                                 forced_eos_token_id=None)
  return model


def export(trained, out: str) -> str:
  """Writes `trained` (a `trained.Trained` translation model) as a Hugging
  Face Marian folder to the new local folder `out`; returns it."""
  config = trained.model_config
  if not trained.task.translates:
    raise ValueError(f'--format hf exports translation models; this one was '
                     f'trained for task={trained.task.name!r}.')
  reasons = blockers(config)
  if reasons:
    raise ValueError('--format hf: this model cannot be written as a Hugging '
                     'Face Marian model: ' + '; '.join(reasons) +
                     ' (--format ct2 takes every encoder-decoder).')
  try:
    model = marian_model(trained.params, config)
  except ImportError:
    raise ValueError('--format hf needs transformers and torch: pip install '
                     '"jaxformer[interop]" and a torch build.') from None

  def fill(directory: str) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer_files(directory, trained.source_tok, trained.target_tok, config)

  return folders.write_folder(out, fill)
