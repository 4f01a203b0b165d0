"""A Hugging Face folder's safetensors weights, read without torch: one
model.safetensors, or shards model-0000x-of-0000y.safetensors (listed by
model.safetensors.index.json where the folder has one).

Every file is opened (its header checked against its size, so a truncated
file is found) before any tensor is read; tensors are then read one at a
time from the memory-mapped files, in their stored dtype (bfloat16 as
ml_dtypes' bfloat16), so an 8B model is never in memory twice.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping

import numpy as np

from jaxformer.storage.errors import InteropError

SINGLE = 'model.safetensors'
INDEX = 'model.safetensors.index.json'
SHARD = re.compile(r'model-(\d+)-of-(\d+)\.safetensors')


class WeightsError(InteropError):
  """The weights cannot be read; the message names the file."""


def _index(folder: str) -> dict[str, str]:
  """The index's tensor name -> file name."""
  path = os.path.join(folder, INDEX)
  try:
    with open(path, 'rb') as f:
      weight_map = json.load(f)['weight_map']
    assert isinstance(weight_map, dict) and all(
        isinstance(v, str) for v in weight_map.values())
  except (ValueError, KeyError, TypeError, AssertionError):
    raise WeightsError(f'{path} is not a safetensors index (JSON with a '
                       '"weight_map" of tensor -> file); download it again'
                       ) from None
  return weight_map


def _check_shard_series(folder: str, names: list[str]) -> None:
  """Every shard 1..N of the model-i-of-N names in `names` is present."""
  present = set(os.listdir(folder))
  for name in names:
    if not (match := SHARD.fullmatch(name)):
      continue
    width, total = len(match.group(1)), match.group(2)
    for i in range(1, int(total) + 1):
      shard = f'model-{i:0{width}d}-of-{total}.safetensors'
      if shard not in present:
        raise WeightsError(f'{os.path.join(folder, shard)} is missing (shard '
                           f'{i} of {int(total)}); download it again')


def weight_files(folder: str) -> tuple[list[str], dict[str, str]] | None:
  """(the safetensors files of `folder`, the index's tensor -> file name
  or {} without one), checked to be there; None if it has none."""
  if os.path.isfile(os.path.join(folder, INDEX)):
    weight_map = _index(folder)
    names = sorted(set(weight_map.values()))
    for name in names:
      path = os.path.join(folder, name)
      tensor = next(t for t, n in weight_map.items() if n == name)
      if os.path.basename(name) != name or name in ('.', '..'):
        raise WeightsError(f'{os.path.join(folder, INDEX)} names {name!r} '
                           f'(for {tensor}), which is not a file name in '
                           f'{folder}; download the index again')
      if not os.path.isfile(path):
        raise WeightsError(f'{path} is missing, but {INDEX} names it (for '
                           f'{tensor}); download it again')
  elif os.path.isfile(os.path.join(folder, SINGLE)):
    return [os.path.join(folder, SINGLE)], {}
  else:
    weight_map = {}
    names = sorted(n for n in os.listdir(folder) if SHARD.fullmatch(n))
    if not names:
      return None
  _check_shard_series(folder, names)
  return [os.path.join(folder, name) for name in names], weight_map


class Weights(Mapping):
  """Tensor name -> numpy array, read from its file when asked."""

  def __init__(self, paths: list[str], weight_map: Mapping[str, str]):
    from safetensors import SafetensorError, safe_open
    self._files, self._where = {}, {}
    for path in paths:
      try:
        self._files[path] = handle = safe_open(path, framework='numpy')
      except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise WeightsError(f'{path} cannot be read (truncated or damaged? '
                           f'{e}); download it again') from None
      for name in handle.keys():
        if name in self._where:
          raise WeightsError(f'{path} and {self._where[name]} both hold '
                             f'{name}; one of them does not belong here')
        self._where[name] = path
    for name, file_name in weight_map.items():
      path = os.path.join(os.path.dirname(paths[0]), file_name)
      if self._where.get(name) != path:
        raise WeightsError(f'{path} has no tensor {name}, but {INDEX} puts it '
                           'there; download the folder again')

  def __getitem__(self, name: str) -> np.ndarray:
    return self._files[self._where[name]].get_tensor(name)

  def shape(self, name: str) -> tuple[int, ...]:
    """The shape of `name`, read from its file's header."""
    return tuple(self._files[self._where[name]].get_slice(name).get_shape())

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)


def read_safetensors(folder: str) -> Weights | None:
  """The weights of `folder`'s safetensors files (see module doc), None
  if it has none; a WeightsError naming a missing, truncated or
  inconsistent file."""
  found = weight_files(folder)
  return None if found is None else Weights(*found)
