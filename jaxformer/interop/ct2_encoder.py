"""A jaxformer encoder-only classifier or regressor of BERT-family blocks as
a CTranslate2 Encoder model, written with CTranslate2's specification API
(`ctranslate2.specs.TransformerEncoderModelSpec`: the spec
ct2-transformers-converter writes for BERT, RoBERTa and XLM-R: token and
token-type embeddings added, learned positions, the embedding LayerNorm,
post-LN layers and the tanh pooler). CTranslate2's encoders stop at the
pooler, so the head is written beside it, as head.safetensors ('weight'
[labels, d], 'bias' [labels]), with the tokenizer's Hugging Face files
(hf_bert.tokenizer_files):

  import ctranslate2, numpy as np, tokenizers
  from safetensors.numpy import load_file
  encoder = ctranslate2.Encoder(OUT)
  tokenizer = tokenizers.Tokenizer.from_file(f'{OUT}/tokenizer.json')
  encoding = tokenizer.encode(text_a, text_b)  # [CLS]/[SEP] or <s>/</s>
  out = encoder.forward_batch([encoding.ids],
                              token_type_ids=[encoding.type_ids])
  head = load_file(f'{OUT}/head.safetensors')
  logits = np.array(out.pooler_output) @ head['weight'].T + head['bias']

gives `jaxformer predict --jsonl`'s logits (a regressor's values).
"""
import os

from jaxformer.interop import ct2, ct2_lm, folders, hf_bert, layout
from jaxformer.model.config import ModelConfig


def encoder_spec(params, config: ModelConfig, pieces: list[str],
                 unk_token: str):
  """The `TransformerEncoderModelSpec` of the encoder and pooler of
  `EncoderClassifier/EncoderRegressor(config)` with `params`."""
  from ctranslate2.specs import common_spec
  from ctranslate2.specs import transformer_spec as ts
  params = layout.numpy_tree(params)
  body, d = params['body'], config.d_model
  spec = ts.TransformerEncoderSpec(
      config.num_encoder_layers, config.num_heads, pre_norm=False,
      activation=ct2._activation(config), layernorm_embedding=True,
      num_source_embeddings=2,
      embeddings_merge=common_spec.EmbeddingsMerge.ADD)
  spec.scale_embeddings = False
  spec.embeddings[0].weight = body['embed']['embedding']
  spec.embeddings[1].weight = body['encoder']['token_types']['embedding']
  spec.position_encodings.encodings = layout.position_table(
      body, config, 'encoder')
  ct2._set_norm(spec.layernorm_embedding, body['encoder']['embedding_norm'])
  for layer_spec, tree in zip(spec.layer, layout.stack_layers(
      body['encoder'], config.num_encoder_layers)):
    ct2._set_self_attention(layer_spec.self_attention, tree['self_attention'],
                            tree['self_attention_norm'], d)
    ct2._set_ffn(layer_spec.ffn, tree['ffn'], tree['ffn_norm'])
  model = ts.TransformerEncoderModelSpec(
      spec, pooling_layer=True,
      pooling_activation=common_spec.Activation.Tanh)
  ct2._set_linear(model.pooler_dense, *layout.linear(body['pooler']))
  model.register_vocabulary(pieces)
  model.config.unk_token = unk_token
  model.config.layer_norm_epsilon = config.layer_norm_epsilon
  return model


def head(params, task: str) -> dict:
  """The head's 'weight' [labels, d] and 'bias' [labels], float32."""
  tree = layout.numpy_tree(params)[
      'classifier' if task == 'classification' else 'regressor']
  return {'weight': tree['kernel'], 'bias': tree['bias']}


def export(trained, out: str, quantization: str | None = None) -> str:
  """Writes the CTranslate2 Encoder model of `trained` (a
  `trained.Trained` encoder of the family), its head and its tokenizer
  files to the new local folder `out`, weights in `quantization` (None:
  float32). Returns the folder."""
  from safetensors.numpy import save_file
  ct2.check_quantization(quantization)
  hf_bert.check_exportable(trained, '--format ct2')
  config, tokenizer = trained.model_config, trained.source_tok
  pieces = ct2_lm.vocabulary(tokenizer, config.vocab_size)
  unk = pieces[tokenizer.unk_id] if tokenizer.unk_id is not None else ''

  def fill(directory: str) -> None:
    ct2.convert(lambda: encoder_spec(trained.params, config, pieces, unk),
                directory, quantization)
    save_file(head(trained.params, trained.task.name),
              os.path.join(directory, 'head.safetensors'))
    for name, contents in hf_bert.tokenizer_files(tokenizer).items():
      with open(os.path.join(directory, name), 'wb') as f:
        f.write(contents)

  return folders.write_folder(out, fill)
