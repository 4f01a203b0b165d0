"""`jaxformer import` of a Hugging Face Llama-family folder (config.json
model_type 'llama', 'qwen2' or 'mistral') -> a jaxformer export of a
decoder-only language model (task language_model, `DecoderLM`), with the
folder's tokenizer (hf_folders.load_tokenizer) travelling in it.

The family is one architecture in jaxformer's options: pre-norm RMSNorm
layers and a final norm, rotary positions (no, linear or llama3 scaling),
a gated FFN (SwiGLU; GeGLU for a tanh GELU), grouped-query attention with
its own head width, unscaled embeddings, a tied or untied head without
bias, and no biases but Qwen2's on q/k/v (or Llama's attention_bias with
mlp_bias: on every projection). What a config asks beyond that (sliding
windows, experts, other RoPE scalings, ...) is refused, naming the key.

`weight_table` is the one table of names: their tensor -> our parameter,
with both shapes (every transform is a reshape); hf_llama.py writes with
the same table. Every shape is checked before any value is read, and the
export is written whole or not at all (folders.write_export). Weights are
read from safetensors files (safetensor_files.py, no torch), one tensor at
a time; bfloat16 and float16 ones become float32 (exactly) unless
--dtype bfloat16.
"""
import dataclasses
import os
import re

import numpy as np

from jaxformer.interop import folders, hf_folders, safetensor_files
from jaxformer.interop import weight_table as weight_table_lib
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model.config import ModelConfig
from jaxformer.storage.errors import InteropError

MODEL_TYPES = ('llama', 'qwen2', 'mistral')
# hidden_act -> the gated FFN computing down(act(gate(x)) * up(x)).
ACTIVATIONS = {'silu': 'swiglu', 'swish': 'swiglu',
               'gelu_pytorch_tanh': 'geglu', 'gelu_new': 'geglu'}
# rope_type (or 'type') -> model.rope_scaling.
ROPE_TYPES = {'default': 'none', 'linear': 'linear', 'llama3': 'llama3'}
# Keys of mixture-of-experts configs (Mixtral, Qwen2-MoE, DeepSeek).
MOE_KEYS = ('num_local_experts', 'num_experts', 'num_experts_per_tok',
            'moe_intermediate_size', 'n_routed_experts')
DTYPES = ('float32', 'bfloat16')
SOURCE_DTYPES = ('float32', 'bfloat16', 'float16')
# Buffers older checkpoints saved; computed, never read.
COMPUTED = re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq')


class LlamaImportError(InteropError):
  """The folder cannot be imported; the message names the file or key."""


# --------------------------------------------------------------- config ---

def rope_parameters(hf: dict) -> dict:
  """The rotary settings of config.json, as transformers 5 writes them
  (rope_parameters) or earlier ones (rope_theta, rope_scaling), in one
  dict with 'rope_type' and 'rope_theta'."""
  rope = dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})
  rope.setdefault('rope_type', rope.pop('type', 'default'))
  rope.setdefault('rope_theta', hf.get('rope_theta', 10000.0))
  return rope


def _window_layers(hf: dict, model_type: str) -> bool:
  """Whether some layer of a Mistral or Qwen2 config attends through a
  sliding window shorter than its positions."""
  window = hf.get('sliding_window')
  if model_type == 'llama' or not isinstance(window, int) or (
      window >= hf.get('max_position_embeddings', window + 1)):
    return False
  types = hf.get('layer_types')
  if types is None and model_type == 'qwen2':
    first, layers = (hf.get('max_window_layers', 0),
                     hf.get('num_hidden_layers', 0))
    types = ['sliding_attention' if hf.get('use_sliding_window') and i >= first
             else 'full_attention' for i in range(layers)]
  return types is None or 'sliding_attention' in types


def refusals(hf: dict, model_type: str) -> list[str]:
  """What config.json asks that jaxformer cannot compute, one reason per
  key (empty if it can)."""
  reasons = []
  act = hf.get('hidden_act', 'silu')
  if act not in ACTIVATIONS:
    reasons.append(f'hidden_act={act!r} (supported: {", ".join(ACTIVATIONS)})')
  if _window_layers(hf, model_type):
    reasons.append(f'sliding_window={hf["sliding_window"]} below '
                   f'max_position_embeddings={hf["max_position_embeddings"]}'
                   ' (sliding-window attention is not supported; a config '
                   'with sliding_window null imports)')
  experts = [f'{key}={hf[key]!r}' for key in MOE_KEYS if hf.get(key)]
  if experts:
    reasons.append(f'{", ".join(experts)} (mixtures of experts are not '
                   'supported)')
  rope = rope_parameters(hf)
  if rope['rope_type'] not in ROPE_TYPES:
    reasons.append(f'rope_scaling type {rope["rope_type"]!r} (supported: '
                   f'{", ".join(ROPE_TYPES)})')
  partial = rope.get('partial_rotary_factor',
                     hf.get('partial_rotary_factor', 1.0))
  if partial != 1.0:
    reasons.append(f'partial_rotary_factor={partial} (jaxformer rotates '
                   'every feature of a head)')
  if model_type == 'llama' and bool(hf.get('attention_bias')) != bool(
      hf.get('mlp_bias')):
    reasons.append(f'attention_bias={hf.get("attention_bias")} with mlp_bias'
                   f'={hf.get("mlp_bias")} (supported: both false, or both '
                   'true: a bias on every projection)')
  if quantization := hf.get('quantization_config'):
    method = (quantization.get('quant_method', '?')
              if isinstance(quantization, dict) else quantization)
    reasons.append(f'quantization_config ({method}; import the unquantized '
                   'checkpoint)')
  return reasons


def special_ids(hf: dict, tokenizer, folder: str) -> dict:
  """pad_id, eos_id and decoder_start_id of the tokenizer, checked
  against config.json's BOS and EOS ids. The start (what `DecoderLM`
  puts before its targets) is the BOS, else config.json's bos_token_id
  (Qwen2's <|endoftext|>), else the EOS: Hugging Face's model has no start
  of its own, so it sees a prompt exactly where the prompt's first token
  is the first input (for Llama, the BOS its tokenizer adds)."""
  bos, eos = hf.get('bos_token_id'), hf.get('eos_token_id')
  eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
  for key, theirs, ours, differ in (
      ('bos_token_id', bos, tokenizer.bos_id,
       None not in (bos, tokenizer.bos_id) and bos != tokenizer.bos_id),
      ('eos_token_id', eos, list(tokenizer.eos_ids),
       bool(set(eos) - {tokenizer.eos_id, *tokenizer.eos_ids}))):
    if differ:
      raise LlamaImportError(
          f'{folder}: config.json {key} is {theirs} but the tokenizer files '
          f'say {ours}; the tokenizer files do not belong to this model')
  start = tokenizer.bos_id if tokenizer.bos_id is not None else (
      bos if isinstance(bos, int) else tokenizer.eos_id)
  return dict(pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id,
              decoder_start_id=start)


def model_config(hf: dict, model_type: str, ids: dict,
                 dtype: str = 'float32') -> ModelConfig:
  """The ModelConfig of a Llama-family config.json (`refusals` empty)
  with the special `ids`; computing in `dtype`."""
  rope = rope_parameters(hf)
  kind = ROPE_TYPES[rope['rope_type']]
  scaling = {}
  if kind != 'none':
    scaling['rope_scaling_factor'] = float(rope.get('factor', 1.0))
  if kind == 'llama3':
    scaling.update(
        rope_low_freq_factor=float(rope.get('low_freq_factor', 1.0)),
        rope_high_freq_factor=float(rope.get('high_freq_factor', 4.0)),
        rope_original_max_len=int(rope['original_max_position_embeddings']))
  try:
    heads = hf['num_attention_heads']
    return ModelConfig(
        vocab_size=hf['vocab_size'], d_model=hf['hidden_size'],
        num_heads=heads, num_kv_heads=hf.get('num_key_value_heads') or heads,
        head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
        d_ff=hf['intermediate_size'], num_encoder_layers=0,
        num_decoder_layers=hf['num_hidden_layers'],
        max_len=hf['max_position_embeddings'],
        share_embeddings='all' if hf.get('tie_word_embeddings') else 'none',
        norm_position='pre', norm_type='rms',
        rms_norm_epsilon=float(hf.get('rms_norm_eps', 1e-6)),
        activation=ACTIVATIONS[hf.get('hidden_act', 'silu')],
        position_embedding='rope', rope_theta=float(rope['rope_theta']),
        rope_scaling=kind, **scaling, scale_embedding=False,
        output_bias=False, logits_bias=False, embedding_dropout=0.0,
        residual_dropout=0.0,
        attention_dropout=float(hf.get('attention_dropout', 0.0)),
        ffn_dropout=0.0, use_bias=bool(hf.get('attention_bias', False)) and (
            model_type == 'llama'),
        qkv_bias=model_type == 'qwen2', dtype=dtype, **ids)
  except KeyError as e:
    raise LlamaImportError(f'config.json has no {e.args[0]!r}') from None
  except (ValueError, TypeError) as e:
    raise LlamaImportError(f'config.json: {e}') from None


# ------------------------------------------------------------ the table ---

def weight_table(config: ModelConfig) -> list[Tensor]:
  """Every tensor of the Hugging Face model of `config` (its lm_head
  only when untied)."""
  d, f, vocab = config.d_model, config.d_ff, config.vocab_size
  n, k, h = config.num_heads, config.kv_heads, config.head_features
  rows = [tensor('model.embed_tokens.weight', ('embed', 'embedding'),
                 (vocab, d)),
          tensor('model.norm.weight', ('decoder', 'final_norm', 'scale'),
                 (d,))]
  if config.share_embeddings == 'none':
    rows.append(tensor('lm_head.weight', ('decoder', 'logits', 'kernel'),
                        (vocab, d)))
  for i in range(config.num_decoder_layers):
    theirs, ours = f'model.layers.{i}', ('decoder', f'layer_{i}')
    attention = (*ours, 'self_attention')
    rows += [tensor(f'{theirs}.input_layernorm.weight',
                    (*ours, 'self_attention_norm', 'scale'), (d,)),
             tensor(f'{theirs}.post_attention_layernorm.weight',
                    (*ours, 'ffn_norm', 'scale'), (d,))]
    for name, our_name, heads in (('q_proj', 'query', n), ('k_proj', 'key', k),
                                  ('v_proj', 'value', k)):
      prefix, path = f'{theirs}.self_attn.{name}', (*attention, our_name)
      rows.append(tensor(f'{prefix}.weight', (*path, 'kernel'),
                         (heads * h, d), (heads, h, d)))
      if config.use_bias or config.qkv_bias:
        rows.append(tensor(f'{prefix}.bias', (*path, 'bias'), (heads * h,),
                           (heads, h)))
    rows.append(tensor(f'{theirs}.self_attn.o_proj.weight',
                       (*attention, 'out', 'kernel'), (d, n * h), (d, n, h)))
    if config.use_bias:
      rows.append(tensor(f'{theirs}.self_attn.o_proj.bias',
                         (*attention, 'out', 'bias'), (d,)))
    for name, our_name, width, inputs in (('gate_proj', 'wi_0', f, d),
                                          ('up_proj', 'wi_1', f, d),
                                          ('down_proj', 'wo', d, f)):
      prefix, path = f'{theirs}.mlp.{name}', (*ours, 'ffn', our_name)
      rows.append(tensor(f'{prefix}.weight', (*path, 'kernel'),
                         (width, inputs)))
      if config.use_bias:
        rows.append(tensor(f'{prefix}.bias', (*path, 'bias'), (width,)))
  return rows


def _check_tie(weights, config: ModelConfig) -> None:
  """A tied model's saved lm_head (where there is one) must be its
  embedding table."""
  if config.share_embeddings == 'none' or 'lm_head.weight' not in weights:
    return
  if weights.shape('lm_head.weight') != weights.shape(
      'model.embed_tokens.weight') or not np.array_equal(
          weights['lm_head.weight'], weights['model.embed_tokens.weight']):
    raise LlamaImportError(
        'lm_head.weight differs from model.embed_tokens.weight, but '
        'config.json says tie_word_embeddings=true; the weights and '
        'config.json do not belong together')


def check_weights(weights, config: ModelConfig) -> list[Tensor]:
  """The table of `config`, every tensor checked present with its shape
  and a float dtype, and no tensor left over (nothing is read but a tied
  lm_head)."""
  table = weight_table(config)
  if config.share_embeddings == 'none' and 'lm_head.weight' not in weights:
    raise LlamaImportError('the weights have no lm_head.weight (config.json '
                           'says tie_word_embeddings=false); do they belong '
                           'to this config.json?')
  weight_table_lib.check(
      weights, table, LlamaImportError, 'a model of this config.json',
      lambda name: name == 'lm_head.weight' or COMPUTED.fullmatch(name))
  _check_tie(weights, config)
  return table


def _check_dtype(name: str, value: np.ndarray) -> None:
  if value.dtype.name not in SOURCE_DTYPES:
    raise LlamaImportError(f'{name} is {value.dtype.name}; jaxformer imports '
                           f'{", ".join(SOURCE_DTYPES)} weights')


def params_from_weights(weights, config: ModelConfig,
                        dtype: str = 'float32') -> dict:
  """`DecoderLM(config)` parameters (numpy, in `dtype`) from the
  checked `weights`, read one tensor at a time."""
  import jax.numpy as jnp
  target = np.dtype(jnp.bfloat16) if dtype == 'bfloat16' else np.float32
  table = check_weights(weights, config)
  return weight_table_lib.read(weights, table,
                               {row.name: row.name for row in table}, target,
                               check_value=_check_dtype)


# --------------------------------------------------------------- import ---

def run_config(base, config: ModelConfig, tokenizer):
  """The saved run config: `base` (default_config()) as a language model
  of `config` on text files, with the tokenizer's size."""
  run = base
  run.task = 'language_model'
  run.model.update(dataclasses.asdict(config))
  run.data.tokenizer.update(joint=True, vocab_size=tokenizer.vocab_size)
  # Fine-tuned on the user's text: --config.data.text.train=FILE.
  run.data.update(source='text', max_source_length=min(config.max_len, 2048),
                  max_target_length=min(config.max_len, 2048))
  return run


def read_config(folder: str) -> tuple[dict, str]:
  """(config.json, its model_type) of a Llama-family folder."""
  return hf_folders.checked_config(folder, MODEL_TYPES, refusals,
                                  LlamaImportError)


def _weights(folder: str):
  try:
    weights = safetensor_files.read_safetensors(folder)
  except safetensor_files.WeightsError as e:
    raise LlamaImportError(str(e)) from None
  if weights is None:
    raise LlamaImportError(
        f'{folder} has no model.safetensors (or model-*-of-*.safetensors '
        'shards); jaxformer imports Llama-family weights from safetensors')
  return weights


def import_folder(folder: str, out: str, base_config, dtype: str = 'float32',
                  keep_provenance: bool = False, adapt=None
                  ) -> tuple[ModelConfig, str]:
  """Writes the jaxformer export of the Llama-family model in `folder` to
  `out` (which must not exist; it records `folder` if keep_provenance),
  parameters in `dtype`; returns its ModelConfig and model_type. `adapt`
  (config, params, table) -> (config, params) adds adapters (peft.py)."""
  if dtype not in DTYPES:
    raise LlamaImportError(
        f'--dtype {dtype}: choose one of {", ".join(DTYPES)}')
  folder = os.path.abspath(folder)
  try:
    out = folders.check_new(out)
  except ValueError as e:
    raise LlamaImportError(str(e)) from None
  hf, model_type = read_config(folder)
  try:
    tokenizer = hf_folders.load_tokenizer(folder, hf.get('vocab_size'))
  except hf_folders.FolderError as e:
    raise LlamaImportError(str(e)) from None
  config = model_config(hf, model_type, special_ids(hf, tokenizer, folder),
                        dtype)
  params = params_from_weights(_weights(folder), config, dtype)
  if adapt:
    config, params = adapt(config, params, weight_table(config))
  run = run_config(base_config, config, tokenizer)
  folders.write_import(out, params, run, [tokenizer], folder, keep_provenance)
  return config, model_type


def report(config: ModelConfig, model_type: str, out: str) -> str:
  kv = f', {config.kv_heads} kv heads' if config.kv_heads != config.num_heads \
      else ''
  return (f'Imported a {model_type} model ({config.num_decoder_layers} layers, '
          f'd_model {config.d_model}, {config.num_heads} heads{kv}, '
          f'vocabulary {config.vocab_size}, {config.dtype}) to {out}; use it '
          'like a workdir:\n'
          f'  jaxformer generate --workdir {out} --prompt "..."\n'
          f'  jaxformer export --format hf --from {out} --out DIR')
