"""A jaxformer decoder-only language model of Llama-family blocks as a
Hugging Face folder that `AutoModelForCausalLM.from_pretrained` and
`AutoTokenizer.from_pretrained` load: config.json (model_type 'qwen2' for
biases on q/k/v only, else 'llama'), model.safetensors (or shards
model-0000i-of-0000n.safetensors with their index), generation_config.json
(the ids that end generation) and the tokenizer's files
(`HFTokenizer.hf_files`). Written with safetensors alone: neither torch
nor transformers is needed.

The weights are named by llama.py's table (`weight_table`), the one both
directions read. A model that is not of the family (`blockers`: post-LN,
LayerNorm, positions other than rotary, an ungated FFN, a scaled
embedding, biases other than the family's) is refused, naming the option.
"""
import json
import os

import numpy as np

from jaxformer.interop import folders, layout, llama, weight_table
from jaxformer.model.config import ModelConfig

# model.activation -> hidden_act.
ACTIVATIONS = {'swiglu': 'silu', 'geglu': 'gelu_pytorch_tanh'}
# Hugging Face's default largest shard (save_pretrained's max_shard_size).
SHARD_BYTES = 5 * 10 ** 9


def blockers(config: ModelConfig) -> list[str]:
  """Why `config` is not a Llama-family model (a Hugging Face Llama or
  Qwen2, a CTranslate2 Llama-style Generator): one reason per option."""
  wanted = {'norm_position': 'pre', 'norm_type': 'rms',
            'position_embedding': 'rope', 'scale_embedding': False,
            'output_bias': False, 'zero_pad_embedding': False}
  reasons = layout.option_blockers(config, wanted)
  if config.activation not in ACTIVATIONS:
    reasons.append(f'model.activation={config.activation!r} (the family has '
                   f'{" or ".join(ACTIVATIONS)})')
  if config.share_embeddings == 'none' and config.logits_bias:
    reasons.append('model.logits_bias=True (the untied lm_head has no bias)')
  return reasons


def model_type(config: ModelConfig) -> str:
  """'qwen2' where only q/k/v have biases (model.qkv_bias), else 'llama'
  (with attention_bias and mlp_bias where every projection has one)."""
  return 'qwen2' if config.qkv_bias and not config.use_bias else 'llama'


def _rope_scaling(config: ModelConfig) -> dict | None:
  if config.rope_scaling == 'none':
    return None
  scaling = {'rope_type': config.rope_scaling,
             'factor': config.rope_scaling_factor}
  if config.rope_scaling == 'llama3':
    scaling.update(low_freq_factor=config.rope_low_freq_factor,
                   high_freq_factor=config.rope_high_freq_factor,
                   original_max_position_embeddings=(
                       config.rope_original_max_len))
  return scaling


def _ids(ids) -> int | list[int]:
  return ids[0] if len(ids) == 1 else list(ids)


def hf_config(config: ModelConfig, tokenizer) -> dict:
  """config.json of `config` (rope_theta and rope_scaling as every
  transformers version reads them; llama.model_config's inverse)."""
  kind = model_type(config)
  bos = tokenizer.bos_id if tokenizer.bos_id is not None else (
      config.decoder_start_id)
  hf = dict(
      architectures=['Qwen2ForCausalLM' if kind == 'qwen2'
                     else 'LlamaForCausalLM'],
      model_type=kind, vocab_size=config.vocab_size,
      hidden_size=config.d_model, intermediate_size=config.d_ff,
      num_hidden_layers=config.num_decoder_layers,
      num_attention_heads=config.num_heads,
      num_key_value_heads=config.kv_heads, head_dim=config.head_features,
      hidden_act=ACTIVATIONS[config.activation],
      max_position_embeddings=config.max_len,
      rms_norm_eps=config.rms_norm_epsilon, rope_theta=config.rope_theta,
      rope_scaling=_rope_scaling(config),
      tie_word_embeddings=config.share_embeddings != 'none',
      attention_dropout=config.attention_dropout, bos_token_id=bos,
      eos_token_id=_ids(tokenizer.eos_ids), pad_token_id=config.pad_id,
      torch_dtype='float32', use_cache=True)
  if kind == 'qwen2':
    hf.update(use_sliding_window=False, sliding_window=None,
              max_window_layers=config.num_decoder_layers)
  else:
    hf.update(attention_bias=config.use_bias, mlp_bias=config.use_bias)
  return hf


def state_dict(params, config: ModelConfig) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of `params` (float32), named and shaped by
  llama.weight_table; scanned layers are written one by one."""
  params = layout.numpy_tree(params)
  params['decoder'] = layout.looped(params['decoder'],
                                    config.num_decoder_layers)
  return weight_table.write(params, llama.weight_table(config))


def write_weights(directory: str, state: dict[str, np.ndarray],
                  max_shard_bytes: int = SHARD_BYTES) -> None:
  """model.safetensors, or shards of at most `max_shard_bytes` (a larger
  tensor alone) with model.safetensors.index.json, as save_pretrained."""
  from safetensors.numpy import save_file
  shards, size = [[]], 0
  for name, value in state.items():
    if shards[-1] and size + value.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += value.nbytes
  metadata = {'format': 'pt'}  # What from_pretrained expects.
  if len(shards) == 1:
    save_file(state, os.path.join(directory, 'model.safetensors'), metadata)
    return
  weight_map = {}
  for i, names in enumerate(shards, start=1):
    file_name = f'model-{i:05d}-of-{len(shards):05d}.safetensors'
    save_file({n: state[n] for n in names},
              os.path.join(directory, file_name), metadata)
    weight_map.update({name: file_name for name in names})
  _write_json(directory, 'model.safetensors.index.json', {
      'metadata': {'total_size': sum(v.nbytes for v in state.values())},
      'weight_map': weight_map})


def _write_json(directory: str, name: str, data: dict) -> None:
  with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=2, ensure_ascii=False)


def check_exportable(trained, what: str) -> None:
  """Raises naming what keeps `trained` from being written as a
  Llama-family model in `what` ('--format hf' ...)."""
  config = trained.model_config
  if not trained.task.generates:
    raise ValueError(f'{what} writes language models as Llama-family '
                     f'models; this one was trained for '
                     f'task={trained.task.name!r}.')
  reasons = blockers(config)
  if reasons:
    raise ValueError(f'{what}: this language model is not of the Llama '
                     'family: ' + '; '.join(reasons) + '.')
  if not trained.target_tok.hf_files():
    raise ValueError(f'{what} writes Hugging Face tokenizers (of imported '
                     "models); this model's tokenizer is jaxformer's own "
                     'SentencePiece model.')


def export(trained, out: str, max_shard_bytes: int = SHARD_BYTES) -> str:
  """Writes `trained` (a `trained.Trained` language model of the family)
  as a Hugging Face folder to the new local folder `out`; returns it."""
  check_exportable(trained, '--format hf')
  config, tokenizer = trained.model_config, trained.target_tok
  state = state_dict(trained.params, config)
  hf = hf_config(config, tokenizer)

  def fill(directory: str) -> None:
    write_weights(directory, state, max_shard_bytes)
    _write_json(directory, 'config.json', hf)
    write_files(directory, config, tokenizer)

  return folders.write_folder(out, fill)


def write_files(directory: str, config: ModelConfig, tokenizer) -> None:
  """generation_config.json (BOS, the ids that end generation, pad) and
  the tokenizer's Hugging Face files."""
  hf = hf_config(config, tokenizer)
  _write_json(directory, 'generation_config.json', {
      key: hf[key] for key in ('bos_token_id', 'eos_token_id',
                               'pad_token_id')})
  for name, contents in tokenizer.hf_files().items():
    with open(os.path.join(directory, name), 'wb') as f:
      f.write(contents)
