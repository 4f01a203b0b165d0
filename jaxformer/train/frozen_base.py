"""Which parameters train: all of them, or, in a model with low-rank
adapters (`model/lora.py`), the adapters (and a task's head) alone.

The step takes gradients of the trainable part only and the optimizer
holds state for it only; the frozen base passes through the step as it
came in (bitwise: no update touches it).
"""
from typing import Any

from flax import traverse_util

from jaxformer.model import lora

# Beside the adapters, the heads an encoder-only task puts on a pretrained
# encoder (model/transformer.py) train: they start fresh.
TRAINED_HEADS = ('classifier', 'regressor')


def _flat(params) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(params)


def has_adapters(params) -> bool:
  """Whether `params` (nested dicts, of any leaves) hold an adapter."""
  return any(map(lora.is_adapter, _flat(params)))


def is_trainable(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` trains in a model with adapters."""
  return lora.is_adapter(path) or path[0] in TRAINED_HEADS


def split(params) -> tuple[Any, Any]:
  """(trainable, frozen) nested dicts of `params`: (params, {}) without
  adapters. Works on any tree of the parameters' structure (shardings,
  abstract arrays, boxed parameters)."""
  if not has_adapters(params):
    return params, {}
  flat = _flat(params)
  trainable = {path: leaf for path, leaf in flat.items()
               if is_trainable(path)}
  frozen = {path: leaf for path, leaf in flat.items()
            if not is_trainable(path)}
  return (traverse_util.unflatten_dict(trainable),
          traverse_util.unflatten_dict(frozen))


def merge(trainable, frozen) -> Any:
  """The parameters whose parts `split` gave."""
  if not frozen:
    return trainable
  return traverse_util.unflatten_dict({**_flat(frozen), **_flat(trainable)})
