"""What an import checks of a folder before it builds anything from it:
config.json's sizes against the weights, and that no file is a link out of
the folder.

Sizes come first because a config names how much to allocate: a tokenizer
class of transformers builds its model's config (a list per layer), and
the weight table has rows per layer and width. So, from config.json and
the safetensors headers alone (names and shapes; no tensor is read):
- every size present (layers, heads, widths, vocabulary, positions) is a
  whole number above 0, named if not;
- a count of layers equals the layers the tensor names hold;
- a width, a vocabulary or a head count is at most the largest dimension of
  any tensor (the weight table then checks every shape exactly), and
  positions at most that or MAX_POSITIONS where no tensor holds them.
Without safetensors headers (pytorch_model.bin), sizes are bounded by
MAX_SIZE and MAX_LAYERS instead.

Links: a file whose real path leaves the folder (or, for a folder of the
Hugging Face cache, `snapshots/REVISION/`, the repository's `blobs/`) is
refused: its contents would travel into the import and out of any export.
"""
from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence

from jaxformer.interop import safetensor_files

# Config keys of sizes, by what they count.
LAYER_KEYS = {  # key -> the tensor names' layer index
    'num_hidden_layers': r'(?:^|\.)(?:layers|layer)\.(\d+)\.',
    'encoder_layers': r'(?:^|\.)encoder\.layers?\.(\d+)\.',
    'decoder_layers': r'(?:^|\.)decoder\.layers?\.(\d+)\.',
}
WIDTH_KEYS = ('hidden_size', 'd_model', 'intermediate_size',
              'encoder_ffn_dim', 'decoder_ffn_dim', 'vocab_size', 'head_dim',
              'num_attention_heads', 'num_key_value_heads',
              'encoder_attention_heads', 'decoder_attention_heads',
              'decoder_vocab_size', 'type_vocab_size')
POSITION_KEYS = ('max_position_embeddings',)
MAX_POSITIONS = 1 << 21
MAX_SIZE = 1 << 20  # Widths and vocabularies without headers to compare.
MAX_LAYERS = 512


def _positive(hf: Mapping, folder: str, error: type[Exception]) -> None:
  for key in (*LAYER_KEYS, *WIDTH_KEYS, *POSITION_KEYS):
    value = hf.get(key)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise error(f'{folder}/config.json: {key}={value!r}: a size must be a '
                  'whole number above 0; the file is damaged or not this '
                  "model's")


def _header_shapes(folder: str, error: type[Exception]
                   ) -> dict[str, tuple[int, ...]] | None:
  """{tensor name: shape} from the safetensors headers; None if none."""
  try:
    weights = safetensor_files.read_safetensors(folder)
  except safetensor_files.WeightsError as e:
    raise error(str(e)) from None
  if weights is None:
    return None
  return {name: weights.shape(name) for name in weights}


def _layers(names: Sequence[str], pattern: str) -> int:
  return len({m.group(1) for n in names if (m := re.search(pattern, n))})


def check_sizes(folder: str, hf: Mapping, error: type[Exception]) -> None:
  """Raises `error`, naming the key, unless config.json's sizes (`hf`)
  fit `folder`'s weights (see the module's docstring)."""
  _positive(hf, folder, error)
  shapes = _header_shapes(folder, error)
  config = f'{folder}/config.json'
  if shapes is None:
    limits = {**{k: MAX_LAYERS for k in LAYER_KEYS},
              **{k: MAX_SIZE for k in WIDTH_KEYS},
              **{k: MAX_POSITIONS for k in POSITION_KEYS}}
    for key, limit in limits.items():
      if hf.get(key, 0) > limit:
        raise error(f'{config}: {key}={hf[key]} is over {limit:,}; the file '
                    "is damaged or not this model's")
    return
  names = sorted(shapes)
  for key, pattern in LAYER_KEYS.items():
    if key == 'num_hidden_layers' and 'encoder_layers' in hf:
      continue  # An encoder-decoder's copy of encoder_layers.
    if key in hf and (held := _layers(names, pattern)) and held != hf[key]:
      raise error(f'{config}: {key}={hf[key]}, but the weights hold {held} '
                  'layers; the config does not belong to these weights')
  widest = max(shapes, key=lambda name: max(shapes[name], default=0),
               default=None)
  largest = max(shapes[widest], default=0) if widest else 0
  for key in WIDTH_KEYS:
    if hf.get(key, 0) > largest:
      raise error(f'{config}: {key}={hf[key]} is larger than any dimension '
                  f'of the weights (the largest, {largest}, in {widest} of '
                  f'shape {tuple(shapes[widest])}); the config does not '
                  'belong to these weights')
  for key in POSITION_KEYS:
    if hf.get(key, 0) > max(largest, MAX_POSITIONS):
      raise error(f'{config}: {key}={hf[key]} is over '
                  f'{max(largest, MAX_POSITIONS):,}; the file is damaged or '
                  "not this model's")


def _allowed_roots(folder: str) -> list[str]:
  """Where the files of `folder` may really be: the folder, and the
  blob store of the Hugging Face cache repository it is a snapshot of."""
  real = os.path.realpath(folder)
  roots = [real]
  snapshots = os.path.dirname(real)
  if os.path.basename(snapshots) == 'snapshots':
    roots.append(os.path.join(os.path.dirname(snapshots), 'blobs'))
  return roots


def check_links(folder: str, error: type[Exception]) -> None:
  """Raises `error` naming the first file of `folder` (any depth) whose
  real path is outside it (or its cache blob store)."""
  roots = _allowed_roots(folder)
  for directory, subfolders, files in os.walk(folder):
    for name in sorted(files + subfolders):
      path = os.path.join(directory, name)
      real = os.path.realpath(path)
      if not any(real == r or real.startswith(r + os.sep) for r in roots):
        raise error(f'{path} is a link to {real}, outside {folder}; copy '
                    'the file into the folder if it belongs to the model')
