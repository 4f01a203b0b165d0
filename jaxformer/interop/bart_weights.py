"""The tensors of Hugging Face's BART-family translators (Marian, M2M100 and
NLLB): the rows of their layers (`weight_table.Tensor`), which
`weight_table` reads into `EncoderDecoder` parameters and writes back, and
a folder's weights read as numpy. Shapes: width d, heads n of width h.

The families differ only in the rows around the layers (embeddings, output
bias, final norms), which marian.py and m2m100.py add.
"""
import os
import re

import numpy as np

from jaxformer.interop import safetensor_files
from jaxformer.interop.weight_table import Tensor, tensor
from jaxformer.model.config import ModelConfig

# The first torch whose torch.load(weights_only=True) has no known way to
# run code (CVE-2025-32434 below 2.6, CVE-2026-24747 below 2.10); also
# pyproject.toml's floor.
TORCH_FLOOR = (2, 10)


def attention_rows(config: ModelConfig, theirs: str, ours: tuple
                   ) -> list[Tensor]:
  d, n, h = config.d_model, config.num_heads, config.head_features
  rows = []
  for name, our_name in (('q_proj', 'query'), ('k_proj', 'key'),
                         ('v_proj', 'value')):
    rows.append(tensor(f'{theirs}.{name}.weight',
                       (*ours, our_name, 'kernel'), (d, d), (n, h, d)))
    # jaxformer has no key bias: q.b_k is the same for every key of a query,
    # which the softmax cancels; it is read (shape-checked) and dropped.
    rows.append(tensor(f'{theirs}.{name}.bias',
                       None if name == 'k_proj' else (*ours, our_name, 'bias'),
                       (d,), (n, h)))
  rows.append(tensor(f'{theirs}.out_proj.weight', (*ours, 'out', 'kernel'),
                     (d, d), (d, n, h)))
  rows.append(tensor(f'{theirs}.out_proj.bias', (*ours, 'out', 'bias'), (d,)))
  return rows


def linear_rows(theirs: str, ours: tuple, shape_out: int,
                shape_in: int | None) -> list[Tensor]:
  """A Linear [out, in] with its bias, or a LayerNorm (shape_in None)."""
  if shape_in is None:
    return [tensor(f'{theirs}.weight', (*ours, 'scale'), (shape_out,)),
            tensor(f'{theirs}.bias', (*ours, 'bias'), (shape_out,))]
  return [tensor(f'{theirs}.weight', (*ours, 'kernel'), (shape_out, shape_in)),
          tensor(f'{theirs}.bias', (*ours, 'bias'), (shape_out,))]


def layer_rows(config: ModelConfig) -> list[Tensor]:
  """The rows of every encoder and decoder layer."""
  d, f = config.d_model, config.d_ff
  rows = []
  for side, count, attentions in (
      ('encoder', config.num_encoder_layers, (('self_attn', 'self_attention'),)),
      ('decoder', config.num_decoder_layers,
       (('self_attn', 'self_attention'), ('encoder_attn', 'cross_attention')))):
    for i in range(count):
      theirs, ours = f'model.{side}.layers.{i}', (side, f'layer_{i}')
      for their_name, our_name in attentions:
        rows += attention_rows(config, f'{theirs}.{their_name}',
                               (*ours, our_name))
        rows += linear_rows(f'{theirs}.{their_name}_layer_norm',
                            (*ours, f'{our_name}_norm'), d, None)
      rows += linear_rows(f'{theirs}.fc1', (*ours, 'ffn', 'wi'), f, d)
      rows += linear_rows(f'{theirs}.fc2', (*ours, 'ffn', 'wo'), d, f)
      rows += linear_rows(f'{theirs}.final_layer_norm', (*ours, 'ffn_norm'),
                          d, None)
  return rows


def check_torch_version(version: str, path: str, error: type) -> None:
  """Raises `error` unless torch `version` ('2.13.0+cpu') may unpickle
  `path`."""
  match = re.match(r'(\d+)\.(\d+)', version)
  floor = '.'.join(map(str, TORCH_FLOOR))
  if not match or tuple(map(int, match.groups())) < TORCH_FLOOR:
    raise error(
        f'{path}: torch {version} is installed, and below torch {floor} '
        'torch.load(weights_only=True) can be made to run code '
        f'(CVE-2025-32434, CVE-2026-24747); pip install "torch>={floor}", or '
        'use the folder\'s model.safetensors (read without torch)')


def read_weights(folder: str, error: type) -> dict:
  """{name: float32 array} of model.safetensors or its shards (numpy
  only), else of pytorch_model.bin (torch at least TORCH_FLOOR); `error`
  names a missing or damaged file."""
  try:
    weights = safetensor_files.read_safetensors(folder)
  except safetensor_files.WeightsError as e:
    raise error(str(e)) from None
  if weights is None:
    path = os.path.join(folder, 'pytorch_model.bin')
    if not os.path.isfile(path):
      raise error(f'{folder} has no model.safetensors or pytorch_model.bin')
    try:
      import torch
    except ImportError:
      raise error(f'{path} needs torch (pip install torch), or convert it to '
                  'model.safetensors') from None
    check_torch_version(torch.__version__, path, error)
    try:
      state = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds.
      raise error(f'{path} cannot be read (truncated or damaged? {e}); '
                  'download it again') from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor)
        for k, v in state.items()):
      raise error(f'{path} holds a {type(state).__name__}, not a state dict '
                  '(tensor names -> tensors); download it again')
    weights = {k: v.detach().float().numpy() for k, v in state.items()}
  return {k: np.asarray(v, np.float32) for k, v in weights.items()}


def load_into_torch(model, state: dict, family: str):
  """`model` (a transformers model) with the float32 arrays of `state`
  loaded, its computed position tables aside; returns it."""
  import torch
  weights = {k: torch.from_numpy(np.ascontiguousarray(v))
             for k, v in state.items()}
  missing, unexpected = model.load_state_dict(weights, strict=False)
  missing = [k for k in missing if 'embed_positions' not in k]
  if missing or unexpected:  # A mapping error of ours, not the user's.
    raise RuntimeError(f'the {family} weights do not fit: missing {missing}, '
                       f'unexpected {unexpected}.')
  return model
