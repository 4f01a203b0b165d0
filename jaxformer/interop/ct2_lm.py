"""A jaxformer decoder-only language model of Llama-family blocks as a
CTranslate2 Generator model, written with CTranslate2's specification API
(`ctranslate2.specs.TransformerDecoderModelSpec`), with the tokenizer's
Hugging Face files beside it (tokenizer.json, generation_config.json):

  import ctranslate2, tokenizers
  generator = ctranslate2.Generator(OUT)
  tokenizer = tokenizers.Tokenizer.from_file(f'{OUT}/tokenizer.json')
  prompt = tokenizer.encode('Once upon a time').tokens  # BOS included
  results = generator.generate_batch(
      [prompt], max_length=32, sampling_topk=1,
      include_prompt_in_result=False, end_token=EOS_IDS)
  print(tokenizer.decode(results[0].sequences_ids[0]))

generates greedily what Hugging Face's `generate(do_sample=False)` does;
EOS_IDS are generation_config.json's eos_token_id (the model's config
names one of them, which ends generation when end_token is not given).

RoPE scalings are written as CTranslate2's runtime reads them, llama3's
factor and original context length included (CTranslate2's own
ct2-transformers-converter leaves both out, so its model of a Llama 3.1
checkpoint generates differently from Hugging Face's).
"""
import numpy as np

from jaxformer.interop import ct2, folders, hf_llama, layout
from jaxformer.model.config import ModelConfig


def vocabulary(tokenizer, size: int) -> list[str]:
  """The piece of every id in [0, size): ids the tokenizer lacks (a
  vocabulary padded to a round size) get unique filler names."""
  pieces = [tokenizer.id_to_piece(i) if i < tokenizer.vocab_size else ''
            for i in range(size)]
  taken = set(pieces)
  for i, piece in enumerate(pieces):
    if not piece:
      filler = f'<jaxformer_unused_{i}>'
      while filler in taken:
        filler = f'<{filler}>'
      pieces[i] = filler
      taken.add(filler)
  return pieces


def _rotary(config: ModelConfig) -> dict:
  """The rotary arguments of the spec."""
  from ctranslate2.specs import attention_spec
  kinds = {'none': None, 'linear': attention_spec.RotaryScalingType.Linear,
           'llama3': attention_spec.RotaryScalingType.Llama3}
  return dict(
      rotary_dim=0, rotary_interleave=False,
      rotary_scaling_type=kinds[config.rope_scaling],
      rotary_scaling_factor=config.rope_scaling_factor,
      rotary_base=config.rope_theta,
      original_max_position_embeddings=(
          config.rope_original_max_len if config.rope_scaling == 'llama3'
          else 0))


def _set_attention(spec, tree: dict, config: ModelConfig) -> None:
  """Query, key and value fused into one [(n + 2k) h, d] layer; then the
  output [d, n h]."""
  d = config.d_model
  spec.layer_norm.gamma = tree['self_attention_norm']['scale']
  attention = tree['self_attention']
  parts = [attention[name] for name in ('query', 'key', 'value')]
  spec.linear[0].weight = np.concatenate(
      [part['kernel'].reshape(-1, d) for part in parts])
  if 'bias' in parts[0]:
    spec.linear[0].bias = np.concatenate(
        [part['bias'].reshape(-1) for part in parts])
  spec.linear[1].weight = attention['out']['kernel'].reshape(d, -1)
  if 'bias' in attention['out']:
    spec.linear[1].bias = attention['out']['bias']
  if config.rope_scaling == 'llama3':
    # The runtime reads the factor (layers/attention_layer.cc), which the
    # spec declares for linear scaling only and keeps frozen otherwise.
    object.__setattr__(spec, 'rotary_scaling_factor',
                       np.float32(config.rope_scaling_factor))
    spec.rotary_low_freq_factor = np.float32(config.rope_low_freq_factor)
    spec.rotary_high_freq_factor = np.float32(config.rope_high_freq_factor)


def _set_ffn(spec, tree: dict) -> None:
  """act(x W_0) * (x W_1), then W_o: linear_0, linear_0_noact, linear_1."""
  spec.layer_norm.gamma = tree['ffn_norm']['scale']
  for target, name in ((spec.linear_0, 'wi_0'), (spec.linear_0_noact, 'wi_1'),
                       (spec.linear_1, 'wo')):
    target.weight, bias = layout.linear(tree['ffn'][name])
    if bias is not None:
      target.bias = bias


def decoder_spec(params, config: ModelConfig, pieces: list[str], tokenizer):
  """The `TransformerDecoderModelSpec` of `DecoderLM(config)` with
  `params`, its vocabulary `pieces` and special tokens registered."""
  from ctranslate2.specs import common_spec
  from ctranslate2.specs import transformer_spec as ts
  params = layout.numpy_tree(params)
  decoder = layout.looped(params['decoder'], config.num_decoder_layers)
  activation = {'swiglu': common_spec.Activation.SWISH,
                'geglu': common_spec.Activation.GELUTanh}[config.activation]
  spec = ts.TransformerDecoderModelSpec.from_config(
      config.num_decoder_layers, config.num_heads, pre_norm=True,
      activation=activation, ffn_glu=True, rms_norm=True,
      num_heads_kv=config.kv_heads, head_dim=config.head_features,
      **_rotary(config))
  spec.decoder.scale_embeddings = False
  spec.decoder.embeddings.weight = params['embed']['embedding']
  spec.decoder.layer_norm.gamma = decoder['final_norm']['scale']
  spec.decoder.projection.weight = (
      decoder['logits']['kernel'] if config.share_embeddings == 'none'
      else params['embed']['embedding'])
  for i, layer_spec in enumerate(spec.decoder.layer):
    _set_attention(layer_spec.self_attention, decoder[f'layer_{i}'], config)
    _set_ffn(layer_spec.ffn, decoder[f'layer_{i}'])
  spec.register_vocabulary(pieces)
  spec.config.layer_norm_epsilon = config.rms_norm_epsilon
  spec.config.bos_token = pieces[config.decoder_start_id]
  spec.config.eos_token = pieces[config.eos_id]
  spec.config.unk_token = ('' if tokenizer.unk_id is None
                           else pieces[tokenizer.unk_id])
  return spec


def export(trained, out: str, quantization: str | None = None) -> str:
  """Writes the CTranslate2 Generator model of `trained` (a
  `trained.Trained` language model of the family) and its tokenizer
  files to the new local folder `out`, weights in `quantization` (None:
  float32). Returns the folder."""
  ct2.check_quantization(quantization)
  hf_llama.check_exportable(trained, '--format ct2')
  config, tokenizer = trained.model_config, trained.target_tok
  pieces = vocabulary(tokenizer, config.vocab_size)

  def fill(directory: str) -> None:
    ct2.convert(lambda: decoder_spec(trained.params, config, pieces,
                                     tokenizer), directory, quantization)
    hf_llama.write_files(directory, config, tokenizer)

  return folders.write_folder(out, fill)
