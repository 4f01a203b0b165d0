"""Hugging Face PEFT LoRA adapters in and out, for the Llama family, the
BERT family (BERT, RoBERTa, XLM-R classifiers), M2M100/NLLB and Marian
(OPUS-MT).

A PEFT adapter folder holds adapter_config.json (peft_type 'LORA', r,
lora_alpha, lora_dropout, target_modules, use_rslora) and
adapter_model.safetensors, whose tensors are
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r] for each adapted module of the base (its name in the base's
state dict, less `.weight`). jaxformer keeps them as the projection's
`lora_a` and `lora_b` (`model/lora.py`), the same matrices: import and
export are renamings, so import -> export -> import is bitwise. Which
module is which projection comes from the family's weight table
(peft_targets.py), so every family's adapters are read and written alike.

`merged` folds adapters into their kernels (W + scale * B A) for the
formats that have no adapters (`--format hf`, `ct2`).
"""
import dataclasses
import json
import os

import numpy as np

from jaxformer.interop import (bert, folders, hf_folders, layout, llama,
                               m2m100, marian, peft_targets, weight_table)
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model import frozen_kernels, lora
from jaxformer.model.config import ModelConfig

CONFIG = 'adapter_config.json'
WEIGHTS = 'adapter_model.safetensors'
PREFIX = 'base_model.model.'
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


def check_settings(adapter: dict, where: str) -> None:
  """Refuses other PEFT types than LORA, and LoRA options jaxformer's
  adapters do not express, by name."""
  kind = adapter.get('peft_type')
  if kind != 'LORA':
    raise PeftError(f'{where}: peft_type {kind!r} is not supported; '
                    'jaxformer imports LoRA adapters (peft_type LORA)')
  for key, default in UNSUPPORTED.items():
    if adapter.get(key) not in (default, None, [], {}, False):
      raise PeftError(f'{where}: {key}={adapter[key]!r} is not supported; '
                      f'jaxformer reads LoRA adapters with {key}={default!r}')


def lora_config(adapter: dict, where: str,
                modules: list[peft_targets.Module], family: str
                ) -> lora.LoraConfig:
  """`model.lora` of a PEFT adapter_config.json (its dict, read from
  `where`, `check_settings`ed) over a base of `modules`
  (peft_targets.linear_modules); refuses target_modules the base lacks,
  by name."""
  try:
    projections = peft_targets.targeted(
        modules, adapter.get('target_modules'), family)
  except ValueError as e:
    raise PeftError(f'{where}: {e}') from None
  return lora.LoraConfig(
      targets=','.join(projections), rank=int(adapter['r']),
      alpha=float(adapter['lora_alpha']),
      dropout=float(adapter.get('lora_dropout') or 0.0),
      use_rslora=bool(adapter.get('use_rslora', False)))


def adapter_table(modules: list[peft_targets.Module], config: ModelConfig
                  ) -> list[Tensor]:
  """The adapter tensors of `config` (with model.lora) over a base of
  `modules`: PEFT's name and shape -> our parameter's path and shape."""
  rank, targets = config.lora.rank, config.lora_targets
  rows = []
  for module in modules:
    if module.projection not in targets:
      continue
    out_features, in_features = module.shape
    name = PREFIX + module.name
    rows += [tensor(f'{name}.lora_A.weight', (*module.path, 'lora_a'),
                    (rank, in_features)),
             tensor(f'{name}.lora_B.weight', (*module.path, 'lora_b'),
                    (out_features, rank))]
  return rows


def read_adapter(folder: str) -> tuple[dict, dict[str, np.ndarray]]:
  """(adapter_config.json, tensors by name) of the PEFT folder, its
  settings checked (`check_settings`)."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    adapter = hf_folders.read_json(folder, CONFIG)
  except hf_folders.FolderError as e:
    raise PeftError(str(e).replace('Hugging Face model folder',
                                   'PEFT adapter folder')) from None
  check_settings(adapter, os.path.join(folder, CONFIG))
  path = os.path.join(folder, WEIGHTS)
  if not os.path.isfile(path):
    raise PeftError(f'{folder} has no {WEIGHTS}; jaxformer reads adapters '
                    'saved with safetensors (save_pretrained\'s default)')
  try:
    tensors = load_file(path)
  except (SafetensorError, OSError, ValueError) as e:
    raise PeftError(f'{path} cannot be read ({e})') from None
  return adapter, tensors


def params_with_adapter(params: dict, table: list[Tensor],
                        tensors: dict[str, np.ndarray], where: str) -> dict:
  """`params` (the base's, looped layers) with the adapter's tensors of
  `table` (`adapter_table`) in place, each checked against the base's
  shape before any is used."""
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
    weight_table.place(params, row.path,
                       np.asarray(tensors[row.name], np.float32))
  return params


def adapting(adapter_folder: str, family: str):
  """The family importer's `adapt(config, params, table) -> (config,
  params)`: the base's ModelConfig, parameters (looped layers) and
  weight table with the PEFT adapter of `adapter_folder` as model.lora."""
  adapter, tensors = read_adapter(adapter_folder)
  where = os.path.join(adapter_folder, CONFIG)

  def adapt(config: ModelConfig, params: dict, table: list[Tensor]):
    modules = peft_targets.linear_modules(table, config.gated_ffn)
    config = config.replace(lora=lora_config(adapter, where, modules, family))
    return config, params_with_adapter(
        params, adapter_table(modules, config), tensors,
        os.path.join(adapter_folder, WEIGHTS))

  return adapt


def import_folder(folder: str, adapter_folder: str, out: str, base_config,
                  dtype: str = 'float32', keep_provenance: bool = False,
                  num_labels: int | None = None) -> tuple[ModelConfig, str]:
  """`jaxformer import --from folder --adapter adapter_folder`: the base
  (Llama family, BERT family, M2M100/NLLB or Marian) with the PEFT adapter as
  model.lora, to the new export `out`; returns its ModelConfig and the
  family's report of the import. `num_labels`: a BERT-family base
  model's fresh head (bert.head)."""
  kind = hf_folders.model_type(folder)
  if kind in bert.MODEL_TYPES:
    config, kind, task = bert.import_folder(
        folder, out, base_config, num_labels, keep_provenance,
        adapt=adapting(adapter_folder, 'BERT-family'))
    return config, bert.report(config, kind, task, out)
  if kind == m2m100.MODEL_TYPE:
    config, languages = m2m100.import_folder(
        folder, out, base_config, keep_provenance,
        adapt=adapting(adapter_folder, m2m100.FAMILY))
    return config, m2m100.report(config, languages, out)
  if kind == marian.MODEL_TYPE:
    config = marian.import_folder(
        folder, out, base_config, marian.main_warn, keep_provenance,
        adapt=adapting(adapter_folder, marian.FAMILY))
    return config, marian.report(config, out)
  if kind in llama.MODEL_TYPES:
    config, kind = llama.import_folder(
        folder, out, base_config, dtype, keep_provenance,
        adapt=adapting(adapter_folder, 'Llama-family'))
    return config, llama.report(config, kind, out)
  raise PeftError(f'--adapter: PEFT adapters import over Llama-family ('
                  f'{", ".join(llama.MODEL_TYPES)}), BERT-family ('
                  f'{", ".join(bert.MODEL_TYPES)}), M2M100/NLLB and Marian '
                  f'bases; {folder} is {kind!r}')


def adapter_json(config: ModelConfig, target_modules: list[str],
                 task_type: str | None) -> dict:
  """adapter_config.json of `config`'s adapters, as PEFT writes it."""
  return {'peft_type': 'LORA', 'task_type': task_type,
          'base_model_name_or_path': None, 'r': config.lora.rank,
          'lora_alpha': config.lora.alpha,
          'lora_dropout': config.lora.dropout,
          'target_modules': target_modules,
          'use_rslora': config.lora.use_rslora, 'bias': 'none',
          'fan_in_fan_out': False, 'inference_mode': True,
          'init_lora_weights': True, 'modules_to_save': None,
          'use_dora': False}


def _base_of(trained):
  """`trained` as the plain model its adapters sit on."""
  return dataclasses.replace(trained, model_config=trained.model_config.replace(
      lora=lora.LoraConfig()))


def export_layout(trained) -> tuple[list[Tensor], list, str | None]:
  """(their weight table, [(path of a layer stack, its layers)], PEFT's
  task_type) of `trained`'s family; raises ValueError naming what keeps
  it from being a Llama, BERT-family, M2M100 or Marian model."""
  from jaxformer.interop import hf_bert, hf_llama, hf_m2m100, hf_marian
  config, base = trained.model_config, _base_of(trained)
  if trained.task.name in ('classification', 'regression'):
    hf_bert.check_exportable(base, '--format peft')
    kind = hf_bert.model_type(config, trained.source_tok)
    return (bert.weight_table(config, kind, trained.task.name, True),
            # Not SEQ_CLS: PeftModel would want the head's weights in the
            # adapter (modules_to_save), which the base has already.
            [(('body', 'encoder'), config.num_encoder_layers)], None)
  if hf_m2m100.is_many_to_many(trained):
    reasons = hf_m2m100.blockers(config)
    if reasons:
      raise ValueError('--format peft: this model is not an M2M100 model: '
                       + '; '.join(reasons) + '.')
    return (m2m100.weight_table(config),
            [(('encoder',), config.num_encoder_layers),
             (('decoder',), config.num_decoder_layers)], 'SEQ_2_SEQ_LM')
  if trained.task.translates:
    reasons = hf_marian.blockers(config)
    if reasons:
      raise ValueError('--format peft: this translation model is not a '
                       'Marian or M2M100 model: ' + '; '.join(reasons) + '.')
    return (marian.weight_table(config),
            [(('encoder',), config.num_encoder_layers),
             (('decoder',), config.num_decoder_layers)], 'SEQ_2_SEQ_LM')
  hf_llama.check_exportable(base, '--format peft')
  return (llama.weight_table(config),
          [(('decoder',), config.num_decoder_layers)], 'CAUSAL_LM')


def export(trained, out: str) -> str:
  """`jaxformer export --format peft`: the adapters of `trained` (a
  Llama-family language model, BERT-family classifier, M2M100 or Marian
  translator with model.lora) as a PEFT folder at the new local folder
  `out`, which `PeftModel.from_pretrained(base, out)` loads; returns it."""
  from safetensors.numpy import save_file
  config = trained.model_config
  if not config.lora.enabled:
    raise PeftError('--format peft writes a model\'s LoRA adapters; this '
                    'model has none (model.lora.targets is empty)')
  table, stacks, task_type = export_layout(trained)
  params = layout.numpy_tree(trained.params)
  for path, count in stacks:
    parent = params
    for key in path[:-1]:
      parent = parent[key]
    parent[path[-1]] = layout.looped(parent[path[-1]], count)
  modules = peft_targets.linear_modules(table, config.gated_ffn)
  state = weight_table.write(params, adapter_table(modules, config))
  settings = adapter_json(config, peft_targets.target_names(
      modules, config.lora_targets), task_type)

  def fill(directory: str) -> None:
    save_file(state, os.path.join(directory, WEIGHTS), {'format': 'pt'})
    with open(os.path.join(directory, CONFIG), 'w', encoding='utf-8') as f:
      json.dump(settings, f, indent=2)

  return folders.write_folder(out, fill)


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
