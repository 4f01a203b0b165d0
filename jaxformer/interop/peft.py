"""Hugging Face PEFT LoRA adapters in and out, for Llama-family models.

A PEFT adapter folder holds adapter_config.json (peft_type 'LORA', r,
lora_alpha, lora_dropout, target_modules, use_rslora) and
adapter_model.safetensors, whose tensors are
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r] for each adapted module of the base (its name in the base's
state dict, less `.weight`). jaxformer keeps them as the projection's
`lora_a` and `lora_b` (`model/lora.py`), the same matrices: import and
export are renamings, so import -> export -> import is bitwise.

`merged` folds adapters into their kernels (W + scale * B A) for the
formats that have no adapters (`--format hf`, `ct2`).
"""
import dataclasses
import json
import os

import numpy as np

from jaxformer.interop import folders, hf_folders, layout, llama
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model import frozen_kernels, lora
from jaxformer.model.config import ModelConfig

CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
# The base's module name -> jaxformer's projection (model/lora.py).
LLAMA_MODULES = {'q_proj': 'q', 'k_proj': 'k', 'v_proj': 'v', 'o_proj': 'o',
                 'gate_proj': 'gate', 'up_proj': 'up', 'down_proj': 'down'}
# jaxformer's parameter name of a projection -> the projection.
PROJECTION_OF = {'query': 'q', 'key': 'k', 'value': 'v', 'out': 'o',
                 'wi_0': 'gate', 'wi_1': 'up', 'wo': 'down'}
# adapter_config.json keys whose non-default values change what the adapter
# computes, beyond what jaxformer's adapters express.
UNSUPPORTED = {'use_dora': False, 'bias': 'none', 'fan_in_fan_out': False,
               'modules_to_save': None, 'rank_pattern': {}, 'alpha_pattern': {},
               'layers_to_transform': None, 'lora_bias': False,
               'exclude_modules': None, 'target_parameters': None,
               'trainable_token_indices': None, 'use_qalora': False}


class PeftError(ValueError):
  """The adapter cannot be read or written; the message names the file,
  key or tensor."""


def lora_config(adapter: dict, where: str) -> lora.LoraConfig:
  """`model.lora` of a PEFT adapter_config.json (its dict, read from
  `where`); refuses other PEFT types and options by name."""
  kind = adapter.get('peft_type')
  if kind != 'LORA':
    raise PeftError(f'{where}: peft_type {kind!r} is not supported; '
                    'jaxformer imports LoRA adapters (peft_type LORA)')
  for key, default in UNSUPPORTED.items():
    if adapter.get(key) not in (default, None, [], {}, False):
      raise PeftError(f'{where}: {key}={adapter[key]!r} is not supported; '
                      f'jaxformer reads LoRA adapters with {key}={default!r}')
  modules = adapter.get('target_modules')
  if modules == 'all-linear':
    modules = list(LLAMA_MODULES)
  if not isinstance(modules, list):
    raise PeftError(f'{where}: target_modules={modules!r}: jaxformer reads a '
                    "list of module names (or 'all-linear')")
  unknown = [m for m in modules if m not in LLAMA_MODULES]
  if unknown:
    raise PeftError(f'{where}: target_modules {unknown} are not projections '
                    f'of a Llama-family model ({", ".join(LLAMA_MODULES)})')
  projections = [LLAMA_MODULES[m] for m in LLAMA_MODULES if m in modules]
  return lora.LoraConfig(
      targets=','.join(projections), rank=int(adapter['r']),
      alpha=float(adapter['lora_alpha']),
      dropout=float(adapter.get('lora_dropout') or 0.0),
      use_rslora=bool(adapter.get('use_rslora', False)))


def adapter_table(config: ModelConfig) -> list[Tensor]:
  """The adapter tensors of `config` (a Llama-family model with
  model.lora): PEFT's name and shape -> our parameter's path and shape."""
  rank, targets = config.lora.rank, config.lora_targets
  rows = []
  for row in llama.weight_table(config):
    if row.path[-1] != 'kernel' or PROJECTION_OF.get(row.path[-2]) not in (
        targets):
      continue
    module = PREFIX + row.name[:-len('.weight')]
    out_features, in_features = row.shape
    rows += [tensor(f'{module}.lora_A.weight', (*row.path[:-1], 'lora_a'),
                    (rank, in_features)),
             tensor(f'{module}.lora_B.weight', (*row.path[:-1], 'lora_b'),
                    (out_features, rank))]
  return rows


def read_adapter(folder: str) -> tuple[lora.LoraConfig, dict[str, np.ndarray]]:
  """(model.lora, tensors by name, float32) of the PEFT folder."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    adapter = hf_folders.read_json(folder, CONFIG)
  except hf_folders.FolderError as e:
    raise PeftError(str(e).replace('Hugging Face model folder',
                                   'PEFT adapter folder')) from None
  config = lora_config(adapter, os.path.join(folder, CONFIG))
  path = os.path.join(folder, WEIGHTS)
  if not os.path.isfile(path):
    raise PeftError(f'{folder} has no {WEIGHTS}; jaxformer reads adapters '
                    'saved with safetensors (save_pretrained\'s default)')
  try:
    tensors = load_file(path)
  except (SafetensorError, OSError, ValueError) as e:
    raise PeftError(f'{path} cannot be read ({e})') from None
  return config, tensors


def params_with_adapter(params: dict, config: ModelConfig,
                        tensors: dict[str, np.ndarray], where: str) -> dict:
  """`params` (the base's, looped layers) with the adapter's tensors in
  place, each checked against the base's shape before any is used."""
  table = adapter_table(config)
  for row in table:
    if row.name not in tensors:
      raise PeftError(f'{where} has no {row.name}; was the adapter made for '
                      'this base with these target_modules?')
    shape = tuple(tensors[row.name].shape)
    if shape != row.shape:
      raise PeftError(f'{where}: {row.name} has shape {shape}; this base '
                      f'wants {row.shape}: the adapter was made for another '
                      'base model')
  left = sorted(set(tensors) - {row.name for row in table})
  if left:
    raise PeftError(f'{where}: unexpected tensors {left[:3]}: not a LoRA '
                    'adapter of this base that jaxformer can express')
  for row in table:
    node = params
    for key in row.path[:-1]:
      node = node.setdefault(key, {})
    node[row.path[-1]] = np.asarray(tensors[row.name], np.float32)
  return params


def import_folder(folder: str, adapter_folder: str, out: str, base_config,
                  dtype: str = 'float32', keep_provenance: bool = False
                  ) -> tuple[ModelConfig, str]:
  """`jaxformer import --from folder --adapter adapter_folder`: the
  Llama-family base with the PEFT adapter as model.lora, to the new export
  `out`; returns its ModelConfig and model_type."""
  try:
    out = folders.check_new(out)
  except ValueError as e:
    raise PeftError(str(e)) from None
  adapter, tensors = read_adapter(adapter_folder)
  folder = os.path.abspath(folder)
  hf, model_type = llama.read_config(folder)
  try:
    tokenizer = hf_folders.load_tokenizer(folder, hf.get('vocab_size'))
  except hf_folders.FolderError as e:
    raise llama.LlamaImportError(str(e)) from None
  config = llama.model_config(hf, model_type,
                              llama.special_ids(hf, tokenizer, folder), dtype)
  config = config.replace(lora=adapter)
  params = llama.params_from_weights(llama._weights(folder), config, dtype)
  params = params_with_adapter(params, config, tensors,
                               os.path.join(adapter_folder, WEIGHTS))
  run = llama.run_config(base_config, config, tokenizer)
  folders.write_import(out, params, run, [tokenizer], folder, keep_provenance)
  return config, model_type


def adapter_json(config: ModelConfig) -> dict:
  """adapter_config.json of `config`'s adapters, as PEFT writes it."""
  modules = [m for m, p in LLAMA_MODULES.items() if p in config.lora_targets]
  return {'peft_type': 'LORA', 'task_type': 'CAUSAL_LM',
          'base_model_name_or_path': None, 'r': config.lora.rank,
          'lora_alpha': config.lora.alpha,
          'lora_dropout': config.lora.dropout, 'target_modules': modules,
          'use_rslora': config.lora.use_rslora, 'bias': 'none',
          'fan_in_fan_out': False, 'inference_mode': True,
          'init_lora_weights': True, 'modules_to_save': None,
          'use_dora': False}


def export(trained, out: str) -> str:
  """`jaxformer export --format peft`: the adapters of `trained` (a
  Llama-family language model with model.lora) as a PEFT folder at the new
  local folder `out`, which `PeftModel.from_pretrained(base, out)` loads;
  returns it."""
  from safetensors.numpy import save_file
  config = trained.model_config
  if not config.lora.enabled:
    raise PeftError('--format peft writes a model\'s LoRA adapters; this '
                    'model has none (model.lora.targets is empty)')
  llama_export_check(trained)
  params = layout.numpy_tree(trained.params)
  params['decoder'] = layout.looped(params['decoder'],
                                    config.num_decoder_layers)
  state = {}
  for row in adapter_table(config):
    value = params
    for key in row.path:
      value = value[key]
    state[row.name] = np.ascontiguousarray(value.reshape(row.shape))

  def fill(directory: str) -> None:
    save_file(state, os.path.join(directory, WEIGHTS), {'format': 'pt'})
    with open(os.path.join(directory, CONFIG), 'w', encoding='utf-8') as f:
      json.dump(adapter_json(config), f, indent=2)

  return folders.write_folder(out, fill)


def llama_export_check(trained) -> None:
  from jaxformer.interop import hf_llama
  merged_model = dataclasses.replace(
      trained, model_config=trained.model_config.replace(
          lora=lora.LoraConfig()))
  hf_llama.check_exportable(merged_model, '--format peft')


def merged_params(params, config: ModelConfig) -> dict:
  """`params` (numpy) with every adapter folded into its kernel, W + scale
  * B A, and the adapters dropped; scanned layers merge along their
  leading axis."""
  def merge(tree):
    if not isinstance(tree, dict):
      return tree
    if 'lora_a' in tree or frozen_kernels.SCALE in tree:
      # A quantized base kernel becomes its float one (the plain model's).
      kernel = np.asarray(frozen_kernels.dequantized(tree))
      merged = {k: v for k, v in tree.items() if not lora.is_adapter((k,))
                and k != frozen_kernels.SCALE}
      merged['kernel'] = kernel
      if 'lora_a' in tree:
        delta = config.lora.scale * np.einsum(
            '...or,...ri->...oi', tree['lora_b'], tree['lora_a'])
        merged['kernel'] = (kernel + delta.reshape(kernel.shape)).astype(
            kernel.dtype)
      return merged
    return {k: merge(v) for k, v in tree.items()}
  return merge(layout.numpy_tree(params))


def merged(trained):
  """`trained` (a `Trained`) with its adapters merged and model.lora off:
  the plain model that computes what it does."""
  config = trained.model_config
  if not config.lora.enabled:
    return trained
  return dataclasses.replace(
      trained, params=merged_params(trained.params, config),
      model_config=config.replace(lora=lora.LoraConfig()))
