"""A jaxformer many-to-many translator (an imported M2M100 or NLLB model,
fine-tuned or not) as a Hugging Face folder that
`M2M100ForConditionalGeneration.from_pretrained` and
`AutoTokenizer.from_pretrained` load offline: config.json,
generation_config.json, model.safetensors and the tokenizer's files
(M2M100: vocab.json, sentencepiece.bpe.model; NLLB: tokenizer.json; both
with tokenizer_config.json).

The weights are written by m2m100.py's table (`weight_table.write`).
A model M2M100 cannot express (another position scheme, post-LN, no
biases, ...) is refused naming the option; a model without language tokens
(not imported from M2M100/NLLB) has no tokenizer to write and is refused.
"""
import json
import os

import numpy as np

from jaxformer.data import language_tokenizer, vocab_tokenizer
from jaxformer.interop import bart_weights, folders, layout, m2m100
from jaxformer.interop import weight_table
from jaxformer.model.config import ModelConfig

ACTIVATIONS = {'relu': 'relu', 'gelu_exact': 'gelu', 'gelu': 'gelu_new',
               'swish': 'swish'}
EPSILON = 1e-5


def blockers(config: ModelConfig) -> list[str]:
  """Why `config` cannot be written as an M2M100 model: one reason per
  option (empty if it can)."""
  wanted = dict(norm_position='pre', position_embedding='sinusoidal',
                sinusoid_layout='tensor2tensor',
                position_offset=config.pad_id + 1, share_embeddings='all',
                output_bias=False, use_bias=True, layer_norm_epsilon=EPSILON)
  reasons = [f'model.{key}={getattr(config, key)!r}: M2M100 has {value!r}'
             for key, value in wanted.items() if getattr(config, key) != value]
  if config.activation not in ACTIVATIONS:
    reasons.append(f'model.activation={config.activation!r} has no M2M100 '
                   f'equivalent ({", ".join(ACTIVATIONS)} do)')
  return reasons + layout.paper_attention_blockers(config)


def m2m100_config(config: ModelConfig, bos_id: int | None) -> dict:
  """The `M2M100Config` keyword arguments of `config`."""
  return dict(
      vocab_size=config.vocab_size, d_model=config.d_model,
      encoder_layers=config.num_encoder_layers,
      decoder_layers=config.num_decoder_layers,
      encoder_attention_heads=config.num_heads,
      decoder_attention_heads=config.num_heads,
      encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
      max_position_embeddings=config.max_len,
      activation_function=ACTIVATIONS[config.activation],
      scale_embedding=config.scale_embedding,
      dropout=config.residual_dropout,
      attention_dropout=config.attention_dropout,
      activation_dropout=config.ffn_dropout, encoder_layerdrop=0.0,
      decoder_layerdrop=0.0, pad_token_id=config.pad_id,
      eos_token_id=config.eos_id, bos_token_id=bos_id,
      decoder_start_token_id=config.decoder_start_id,
      tie_word_embeddings=True)


def state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """The model's weights under M2M100's names (float32)."""
  params = layout.numpy_tree(params)
  for side, count in (('encoder', config.num_encoder_layers),
                      ('decoder', config.num_decoder_layers)):
    params[side] = layout.looped(params[side], count)
  return weight_table.write(params, m2m100.weight_table(config))


def m2m100_model(params, config: ModelConfig, bos_id: int | None = None):
  """The `transformers.M2M100ForConditionalGeneration` (float32, eval
  mode) of `params`."""
  from transformers import M2M100Config, M2M100ForConditionalGeneration
  return bart_weights.load_into_torch(
      M2M100ForConditionalGeneration(
          M2M100Config(**m2m100_config(config, bos_id))).eval(),
      state_dict(params, config), 'M2M100')


def tokenizer_files(tokenizer: language_tokenizer.LanguageTokenizer
                    ) -> dict[str, bytes]:
  """The files `AutoTokenizer` reads back as `tokenizer` (its source
  language as src_lang)."""
  inner = tokenizer.inner
  if isinstance(inner, vocab_tokenizer.VocabTokenizer):  # M2M100Tokenizer.
    from transformers.models.m2m_100 import tokenization_m2m_100 as tm
    codes = list(tokenizer.languages)
    kind = next((k for k, v in tm.FAIRSEQ_LANGUAGE_CODES.items()
                 if v == codes), None)
    if kind is None:
      raise ValueError('--format hf: the language tokens are none of '
                       "M2M100Tokenizer's code lists (m2m100, wmt21).")
    vocab = {inner.id_to_piece(i): i for i in range(inner.vocab_size)}
    settings = dict(tokenizer_class='M2M100Tokenizer', language_codes=kind,
                    src_lang=tokenizer.language, num_madeup_words=(
                        tokenizer.vocab_size - inner.vocab_size - len(codes)))
    return {'vocab.json': json.dumps(vocab, ensure_ascii=False).encode(),
            'sentencepiece.bpe.model': inner.sentencepiece_model,
            'tokenizer_config.json': json.dumps(settings).encode()}
  files = inner.hf_files()
  settings = json.loads(inner.files.get('tokenizer_config.json', '{}'))
  settings.setdefault('tokenizer_class', 'NllbTokenizer')
  settings['src_lang'] = tokenizer.language
  files['tokenizer_config.json'] = json.dumps(
      settings, indent=2, ensure_ascii=False).encode()
  return files


def write_files(directory: str, files: dict[str, bytes]) -> None:
  for name, contents in files.items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(contents)


def is_many_to_many(trained) -> bool:
  return isinstance(trained.source_tok, language_tokenizer.LanguageTokenizer)


def export(trained, out: str) -> str:
  """Writes `trained` (a `trained.Trained` many-to-many translator) as a
  Hugging Face M2M100 folder to the new local folder `out`; returns it."""
  config = trained.model_config
  reasons = blockers(config)
  if reasons:
    raise ValueError('--format hf: this model cannot be written as a Hugging '
                     'Face M2M100 model: ' + '; '.join(reasons) + '.')
  try:
    model = m2m100_model(trained.params, config, trained.source_tok.bos_id)
  except ImportError:
    raise ValueError('--format hf needs transformers and torch: pip install '
                     '"jaxformer[interop]" and a torch build.') from None
  files = tokenizer_files(trained.source_tok)

  def fill(directory: str) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    write_files(directory, files)

  return folders.write_folder(out, fill)
