"""The tensors of Hugging Face's BART-family translators (Marian, M2M100 and
NLLB): the rows of their layers in one table, read into `EncoderDecoder`
parameters (and written back), and a folder's weights read as numpy.

A row is (their names, of which the first present is read and the others
must hold equal values; our parameter path, or None for a tensor that is
read, shape-checked and dropped; the transform theirs -> ours, a reshape;
their shape). The families differ only in the rows around the layers
(embeddings, output bias, final norms), which marian.py and m2m100.py add.
Errors are raised as the caller's error class, naming the tensor.
"""
import os
import re
from typing import Callable, NamedTuple

import numpy as np

from jaxformer.interop import safetensor_files
from jaxformer.model.config import ModelConfig

# The first torch whose torch.load(weights_only=True) has no known way to
# run code (CVE-2025-32434 below 2.6, CVE-2026-24747 below 2.10); also
# pyproject.toml's floor.
TORCH_FLOOR = (2, 10)


class Row(NamedTuple):
  names: tuple[str, ...]
  path: tuple[str, ...] | None
  transform: Callable[[np.ndarray], np.ndarray]
  shape: tuple[int, ...]


def same(x):
  return x


def _heads(config):  # [n * h, d] -> [n, h, d]
  return lambda w: w.reshape(config.num_heads, config.head_features, -1)


def _head_bias(config):  # [n * h] -> [n, h]
  return lambda b: b.reshape(config.num_heads, config.head_features)


def _out(config):  # [d, n * h] -> [d, n, h]
  return lambda w: w.reshape(-1, config.num_heads, config.head_features)


def attention_rows(config: ModelConfig, theirs: str, ours: tuple) -> list:
  d = config.d_model
  rows = []
  for name, our_name in (('q_proj', 'query'), ('k_proj', 'key'),
                         ('v_proj', 'value')):
    rows.append(Row((f'{theirs}.{name}.weight',), (*ours, our_name, 'kernel'),
                    _heads(config), (d, d)))
    # jaxformer has no key bias: q.b_k is the same for every key of a query,
    # which the softmax cancels; it is read (shape-checked) and dropped.
    rows.append(Row((f'{theirs}.{name}.bias',),
                    None if name == 'k_proj' else (*ours, our_name, 'bias'),
                    _head_bias(config), (d,)))
  rows.append(Row((f'{theirs}.out_proj.weight',), (*ours, 'out', 'kernel'),
                  _out(config), (d, d)))
  rows.append(Row((f'{theirs}.out_proj.bias',), (*ours, 'out', 'bias'), same,
                  (d,)))
  return rows


def linear_rows(theirs: str, ours: tuple, shape_out: int,
                shape_in: int | None) -> list:
  """A Linear [out, in] with its bias, or a LayerNorm (shape_in None)."""
  if shape_in is None:
    return [Row((f'{theirs}.weight',), (*ours, 'scale'), same, (shape_out,)),
            Row((f'{theirs}.bias',), (*ours, 'bias'), same, (shape_out,))]
  return [Row((f'{theirs}.weight',), (*ours, 'kernel'), same,
              (shape_out, shape_in)),
          Row((f'{theirs}.bias',), (*ours, 'bias'), same, (shape_out,))]


def layer_rows(config: ModelConfig) -> list:
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


def read_table(weights, rows: list, error: type, family: str,
               computed: tuple = ()) -> dict:
  """Our parameters (float32 numpy) from `weights` by the `rows`: every
  row present with its shape, tied names equal, and no tensor left over but
  the `computed` ones (which the caller checks). Raises `error` naming the
  tensor; `family` ('Marian') is named in the message."""
  params, used = {}, set(computed)
  for names, path, transform, shape in rows:
    present = [n for n in names if n in weights]
    if not present:
      raise error(f'the weights have no {names[0]!r}; is this a {family} '
                  'checkpoint of config.json?')
    value = weights[present[0]]
    for name in present:
      if tuple(weights[name].shape) != shape:
        raise error(f'{name} has shape {tuple(weights[name].shape)}, '
                    f'config.json says {shape}')
      if not np.array_equal(weights[name], value):
        raise error(f'{name} differs from {present[0]}, which config.json '
                    'ties it to')
    used.update(present)
    if path is not None:
      node = params
      for key in path[:-1]:
        node = node.setdefault(key, {})
      node[path[-1]] = np.asarray(transform(value), np.float32)
  left = sorted(set(weights) - used)
  if left:
    raise error(f'unexpected tensors {left[:3]}'
                f'{"..." if len(left) > 3 else ""}: not a {family} model '
                'jaxformer can express')
  return params


def write_table(params: dict, rows: list) -> dict[str, np.ndarray]:
  """The inverse of `read_table`: {their name: float32 array of their
  shape} for every name of every row, zeros where a row is dropped."""
  state = {}
  for names, path, _, shape in rows:
    if path is None:
      value = np.zeros(shape, np.float32)
    else:
      value = params
      for key in path:
        value = value[key]
      value = np.asarray(value, np.float32).reshape(shape)
    for name in names:
      state[name] = value
  return state


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
