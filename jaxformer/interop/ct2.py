"""A jaxformer translation model as a CTranslate2 model, written with
CTranslate2's own specification API (`ctranslate2.specs.TransformerSpec`).

Every `EncoderDecoder` of the paper's blocks maps onto that spec: post-LN
or pre-LN (with the final LayerNorm), ReLU, GELU (tanh or exact) or swish,
shared or separate embeddings, a tied or separate (biased) output layer,
and positions written out as the table the model adds (sinusoidal or
learned; CTranslate2's built-in sinusoid is another table); RMSNorm,
rotary positions, gated FFNs, fewer key/value heads or another head width
are refused, naming the option (`blockers`; decoder-only language models
of those blocks are written by ct2_lm.py). The folder also holds
the vocabularies (one piece per id) and the SentencePiece models
(`source.spm`, `target.spm`), so that

  import ctranslate2, sentencepiece as spm
  translator = ctranslate2.Translator(OUT)
  pieces = spm.SentencePieceProcessor(f'{OUT}/source.spm').encode(
      lines, out_type=str)
  results = translator.translate_batch(pieces)

translates as `jaxformer translate` does: the source's EOS is added by
CTranslate2 (`add_source_eos`), the decoder starts from the model's
`decoder_start_id` (a zero vector with `zero_pad_embedding`, as Marian's),
and decoding stops at its `eos_id`. A many-to-many model (M2M100, NLLB)
is called as CTranslate2 documents it: sources are the tokens of the
folder's Hugging Face tokenizer (hf_m2m100.py writes its files), language
token and </s> included, and `target_prefix` holds the target language.
"""
from typing import Callable

import numpy as np

from jaxformer.data.tokenizer import Tokenizer
from jaxformer.interop import folders, hf_m2m100, layout
from jaxformer.model.config import ModelConfig

QUANTIZATIONS = ('int8', 'int8_float32', 'bfloat16', 'float16')


def vocabulary(tokenizer: Tokenizer, size: int, side: str) -> list[str]:
  """The piece of every id in [0, size)."""
  if tokenizer.vocab_size != size:
    raise ValueError(f'the {side} tokenizer has {tokenizer.vocab_size} '
                     f'pieces but the model {size} embeddings.')
  return [tokenizer.id_to_piece(i) for i in range(size)]


def unknown_piece(tokenizer: Tokenizer) -> str:
  return tokenizer.id_to_piece(tokenizer.unk_id)


def blockers(config: ModelConfig) -> list[str]:
  """Why `config` cannot be written as a CTranslate2 encoder-decoder
  (`transformer_spec`): one reason per option (empty if it can)."""
  reasons = layout.paper_attention_blockers(config)
  if config.position_embedding == 'rope':
    reasons.append("model.position_embedding='rope': the encoder-decoder "
                   'export writes the table of positions the model adds')
  if config.gated_ffn:
    reasons.append(f'model.activation={config.activation!r}: the '
                   'encoder-decoder export writes one FFN input projection')
  return reasons


def check_quantization(quantization: str | None) -> None:
  if quantization not in (None, *QUANTIZATIONS):
    raise ValueError(f'--quantization {quantization}: choose one of '
                     f'{", ".join(QUANTIZATIONS)} (or leave it out for '
                     'float32).')


def _set_linear(spec, kernel: np.ndarray, bias: np.ndarray | None) -> None:
  spec.weight = kernel
  if bias is not None:
    spec.bias = bias


def _set_norm(spec, tree: dict) -> None:
  spec.gamma = tree['scale']
  spec.beta = layout.norm_bias(tree)


def _set_ffn(spec, tree: dict, norm: dict) -> None:
  _set_norm(spec.layer_norm, norm)
  _set_linear(spec.linear_0, *layout.linear(tree['wi']))
  _set_linear(spec.linear_1, *layout.linear(tree['wo']))


def _set_self_attention(spec, tree: dict, norm: dict, d: int) -> None:
  """CTranslate2 fuses query, key and value into one [3d, d] layer."""
  _set_norm(spec.layer_norm, norm)
  q, k, v = (layout.projection(tree[name], d)
             for name in ('query', 'key', 'value'))
  _set_linear(spec.linear[0], np.concatenate([q[0], k[0], v[0]]),
              np.concatenate([q[1], k[1], v[1]]) if 'bias' in tree['query']
              else None)
  _set_linear(spec.linear[1], *layout.output(tree['out'], d))


def _set_cross_attention(spec, tree: dict, norm: dict, d: int) -> None:
  """Query [d, d], then key and value fused [2d, d], then the output."""
  _set_norm(spec.layer_norm, norm)
  biased = 'bias' in tree['query']
  q = layout.projection(tree['query'], d)
  k, v = (layout.projection(tree[name], d) for name in ('key', 'value'))
  _set_linear(spec.linear[0], q[0], q[1] if biased else None)
  _set_linear(spec.linear[1], np.concatenate([k[0], v[0]]),
              np.concatenate([k[1], v[1]]) if biased else None)
  _set_linear(spec.linear[2], *layout.output(tree['out'], d))


def _activation(config: ModelConfig):
  from ctranslate2.specs import common_spec
  # jaxformer's 'gelu' is the tanh approximation, 'gelu_exact' the erf form.
  return {'relu': common_spec.Activation.RELU,
          'gelu': common_spec.Activation.GELUTanh,
          'gelu_exact': common_spec.Activation.GELU,
          'swish': common_spec.Activation.SWISH}[config.activation]


def transformer_spec(params, config: ModelConfig, source_vocab: list[str],
                     target_vocab: list[str], unk_token: str,
                     add_source_eos: bool = True):
  """The `ctranslate2.specs.TransformerSpec` of `EncoderDecoder(config)`
  with `params`, its vocabularies registered and its config set (the
  special pieces: EOS and the decoder's start from the config, unknown as
  given; CTranslate2 appends EOS to sources if `add_source_eos`, as
  jaxformer's SentencePiece models need, not M2M100's, whose sources hold
  it)."""
  from ctranslate2.specs import transformer_spec as ts
  params = layout.numpy_tree(params)
  d = config.d_model
  pre_norm = config.norm_position == 'pre'
  encoder = ts.TransformerEncoderSpec(
      config.num_encoder_layers, config.num_heads, pre_norm=pre_norm,
      activation=_activation(config))
  decoder = ts.TransformerDecoderSpec(
      config.num_decoder_layers, config.num_heads, pre_norm=pre_norm,
      activation=_activation(config))
  source_table, target_table = layout.embeddings(params, config)
  scale = config.scale_embedding
  for stack, spec in (('encoder', encoder), ('decoder', decoder)):
    spec.scale_embeddings = scale
    spec.position_encodings.encodings = layout.position_table(
        params, config, stack)
    if pre_norm:
      _set_norm(spec.layer_norm, params[stack]['final_norm'])
  encoder.embeddings[0].weight = source_table
  decoder.embeddings.weight = target_table
  _set_linear(decoder.projection, *layout.output_layer(params, config))

  for spec, tree in zip(encoder.layer, layout.stack_layers(
      params['encoder'], config.num_encoder_layers)):
    _set_self_attention(spec.self_attention, tree['self_attention'],
                        tree['self_attention_norm'], d)
    _set_ffn(spec.ffn, tree['ffn'], tree['ffn_norm'])
  for spec, tree in zip(decoder.layer, layout.stack_layers(
      params['decoder'], config.num_decoder_layers)):
    _set_self_attention(spec.self_attention, tree['self_attention'],
                        tree['self_attention_norm'], d)
    _set_cross_attention(spec.attention, tree['cross_attention'],
                         tree['cross_attention_norm'], d)
    _set_ffn(spec.ffn, tree['ffn'], tree['ffn_norm'])

  spec = ts.TransformerSpec(encoder, decoder)
  spec.register_source_vocabulary(source_vocab)
  spec.register_target_vocabulary(target_vocab)
  spec.config.layer_norm_epsilon = config.layer_norm_epsilon
  spec.config.unk_token = unk_token
  spec.config.eos_token = target_vocab[config.eos_id]
  # The decoder starts from this id's embedding (a zero row with
  # zero_pad_embedding: the zero vector, as Marian does).
  spec.config.decoder_start_token = target_vocab[
      config.decoder_start_id]
  spec.config.add_source_eos = add_source_eos
  return spec


def export(trained, out: str, quantization: str | None = None) -> str:
  """Writes the CTranslate2 model of `trained` (a `trained.Trained` of an
  encoder-decoder) to the new local folder `out`, its weights in
  `quantization` (None: float32). Returns the folder."""
  if not trained.task.translates:
    raise ValueError(f'--format ct2 exports translation models; this one was '
                     f'trained for task={trained.task.name!r}.')
  check_quantization(quantization)
  config = trained.model_config
  reasons = blockers(config)
  if reasons:
    raise ValueError('--format ct2: this model cannot be written as a '
                     'CTranslate2 encoder-decoder: ' + '; '.join(reasons) + '.')
  source_vocab = vocabulary(trained.source_tok, config.vocab_size, 'source')
  target_vocab = vocabulary(trained.target_tok, config.output_vocab_size,
                            'target')
  # A many-to-many model's folder holds Hugging Face's tokenizer files,
  # which give sources with their language token and </s>.
  many = hf_m2m100.is_many_to_many(trained)
  files = hf_m2m100.tokenizer_files(trained.source_tok) if many else {
      f'{name}.spm': tokenizer.sentencepiece_model for name, tokenizer in (
          ('source', trained.source_tok), ('target', trained.target_tok))}

  def fill(directory: str) -> None:
    write(trained.params, config, source_vocab, target_vocab,
          unknown_piece(trained.target_tok), directory, quantization,
          add_source_eos=not many)
    hf_m2m100.write_files(directory, files)

  return folders.write_folder(out, fill)


def write(params, config: ModelConfig, source_vocab: list[str],
          target_vocab: list[str], unk_token: str, directory: str,
          quantization: str | None = None,
          add_source_eos: bool = True) -> None:
  """Converts to CTranslate2 (`transformer_spec`) into `directory`
  (replaced if it exists), weights in `quantization` (None: float32)."""
  convert(lambda: transformer_spec(params, config, source_vocab,
                                   target_vocab, unk_token, add_source_eos),
          directory, quantization)


def convert(build_spec: Callable, directory: str,
            quantization: str | None = None) -> None:
  """Writes the CTranslate2 model of the spec `build_spec()` returns into
  `directory` (replaced if it exists), weights in `quantization` (None:
  float32)."""
  try:
    from ctranslate2.converters.converter import Converter
  except ImportError:
    raise ValueError('--format ct2 needs CTranslate2: pip install '
                     '"jaxformer[interop]" (or ctranslate2).') from None

  class _Converter(Converter):
    def _load(self):
      return build_spec()

  _Converter().convert(directory, quantization=quantization, force=True)
