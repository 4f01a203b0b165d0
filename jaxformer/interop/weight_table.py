"""The one table of weight names of every interop family (Llama, BERT,
Marian, M2M100): a row per tensor of theirs, and the walks that read a
table into our parameters and write our parameters back by it.

A row (`Tensor`) has their names (the first is the tensor's; the others are
tied to it: the first present is read, and every one present must hold its
values), our parameter's path (None: a tensor that is read, shape-checked
and dropped, written back as zeros), their shape and ours (the same values,
reshaped: splitting or joining the heads). Each family's module builds its
table (`weight_table`); errors are raised as the family's error class,
naming the tensor.
"""
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np


class Tensor(NamedTuple):
  """One tensor of their model and where its values go in ours."""
  names: tuple[str, ...]
  path: tuple[str, ...] | None
  shape: tuple[int, ...]
  our_shape: tuple[int, ...]

  @property
  def name(self) -> str:
    return self.names[0]


def tensor(names: str | Iterable[str], path: tuple[str, ...] | None,
           shape: Iterable[int], our_shape: Iterable[int] | None = None
           ) -> Tensor:
  """A row; `our_shape` defaults to `shape` (the values as they are)."""
  names = (names,) if isinstance(names, str) else tuple(names)
  shape = tuple(shape)
  return Tensor(names, path, shape,
                shape if our_shape is None else tuple(our_shape))


def _shape(weights, name: str) -> tuple[int, ...]:
  """A tensor's shape, without reading it where `weights` can tell
  (`safetensor_files`' readers)."""
  shape = getattr(weights, 'shape', None)
  return tuple(shape(name)) if callable(shape) else tuple(weights[name].shape)


def check(weights, table: list[Tensor], error: type, where: str,
          expected: Callable[[str], bool] = lambda name: False
          ) -> dict[str, str]:
  """Every row of `table` present in `weights` with its shape, tied names
  equal, and no tensor left over but the `expected` ones (computed
  buffers, heads a base import leaves behind). `where` names what the
  weights should be ('a Marian checkpoint of config.json'). Returns the
  name each row is read from."""
  read, used = {}, set()
  for row in table:
    present = [n for n in row.names if n in weights]
    if not present:
      raise error(f'the weights have no {row.name}; are they {where}?')
    for name in present:
      if _shape(weights, name) != row.shape:
        raise error(f'{name} has shape {_shape(weights, name)}, config.json '
                    f'says {row.shape}')
    for name in present[1:]:
      if not np.array_equal(weights[name], weights[present[0]]):
        raise error(f'{name} differs from {present[0]}, which config.json '
                    'ties it to')
    read[row.name] = present[0]
    used.update(present)
  left = sorted(n for n in weights if n not in used and not expected(n))
  if left:
    raise error(f'unexpected tensors {left[:3]}'
                f'{"..." if len(left) > 3 else ""}: not {where} that '
                'jaxformer can express')
  return read


def place(tree: dict, path: tuple[str, ...], value) -> None:
  """Sets `value` at `path` of nested dicts, making the dicts on the way."""
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def read(weights, table: list[Tensor], read_from: dict[str, str],
         dtype=np.float32, check_value: Callable | None = None) -> dict:
  """Our parameters (numpy, in `dtype`) from the `check`ed `weights`, one
  tensor at a time (`read_from`: `check`'s answer); `check_value(name,
  value)` may refuse a tensor as it is read (its dtype, say)."""
  params = {}
  for row in table:
    if row.path is not None:
      value = weights[read_from[row.name]]
      if check_value:
        check_value(row.name, value)
      place(params, row.path,
            np.asarray(value, dtype).reshape(row.our_shape))
  return params


def load(weights, table: list[Tensor], error: type, where: str,
         expected: Callable[[str], bool] = lambda name: False,
         dtype=np.float32) -> dict:
  """`read` after `check`: nothing is copied before every row is checked."""
  return read(weights, table, check(weights, table, error, where, expected),
              dtype)


def _at(params: dict, path: tuple[str, ...]) -> Any:
  """The leaf at `path`; None for a bias the model has none of."""
  node = params
  for key in path:
    if path[-1].endswith('bias') and key not in node:
      return None
    node = node[key]
  return node


def write(params: dict, table: list[Tensor]) -> dict[str, np.ndarray]:
  """The inverse of `read`: {their name: float32 array of their shape} for
  every name of every row; zeros where a row is dropped, and for a bias
  the model has none of (model.use_bias or norm_bias False)."""
  state = {}
  for row in table:
    value = None if row.path is None else _at(params, row.path)
    value = (np.zeros(row.shape, np.float32) if value is None else
             np.ascontiguousarray(np.asarray(value, np.float32).reshape(
                 row.shape)))
    for name in row.names:
      state[name] = value
  return state
