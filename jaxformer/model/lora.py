"""Low-rank adapters (LoRA, Hu et al. 2021) on the linear projections of
attention and the FFN: y = x W^T + b + scale * dropout(x) A^T B^T, with A
[rank, in] and B [out, rank]; B starts at zero, so an adapted model starts
as its base. scale = alpha / rank, or alpha / sqrt(rank) with rsLoRA
(Kalajdzievski 2023).

One mechanism for every family: `layers.Linear` carries the name of its
projection (`projection`) and asks `adapter_factors` for its adapter; the
projections are named as below, whatever the model.
"""
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

ATTENTION_PROJECTIONS = ('q', 'k', 'v', 'o')
GATED_FFN_PROJECTIONS = ('gate', 'up', 'down')
PLAIN_FFN_PROJECTIONS = ('ffn_in', 'ffn_out')
# The parameters an adapter adds to a projection, next to its kernel.
ADAPTER_PARAMS = ('lora_a', 'lora_b')
BASE_DTYPES = ('float32', 'bfloat16', 'int8', 'nf4')


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """`model.lora`: adapters on the projections named in `targets`.

  targets: projection names joined by commas ('q,v'), 'all' for every
    projection of the model, or '' for no adapters (a plain model).
  rank, alpha: A is [rank, in], B [out, rank]; the product is scaled by
    alpha / rank (alpha / sqrt(rank) with use_rslora).
  dropout: on the adapter's input only, while training.
  base_dtype: how the frozen projections' kernels are held: 'float32' (as
    trained), 'bfloat16', 'int8' or 'nf4' (weight-only,
    `model/frozen_kernels.py`).
  """
  targets: str = ''
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  use_rslora: bool = False
  base_dtype: str = 'float32'

  @property
  def enabled(self) -> bool:
    return bool(self.targets.strip())

  @property
  def scale(self) -> float:
    """The factor of the adapter's product."""
    return self.alpha / (math.sqrt(self.rank) if self.use_rslora
                         else self.rank)


def model_projections(gated_ffn: bool) -> tuple[str, ...]:
  """The projection names a model has: attention's and its FFN's."""
  ffn = GATED_FFN_PROJECTIONS if gated_ffn else PLAIN_FFN_PROJECTIONS
  return ATTENTION_PROJECTIONS + ffn


def _names(lora: LoraConfig) -> list[str]:
  return [name.strip() for name in lora.targets.split(',') if name.strip()]


def check(lora: LoraConfig) -> None:
  """Checks what can be checked without the model: every target is some
  model's projection (a config of a plain FFN may fine-tune an export with
  a gated one: `target_set` checks against the model itself), rank >= 1,
  dropout in [0, 1), a known base_dtype."""
  if not lora.enabled:
    return
  every = ATTENTION_PROJECTIONS + GATED_FFN_PROJECTIONS + PLAIN_FFN_PROJECTIONS
  unknown = [name for name in _names(lora) if name not in every + ('all',)]
  if unknown:
    raise ValueError(
        f'model.lora.targets={lora.targets!r}: {", ".join(unknown)} is no '
        f'projection name; choose from {", ".join(every)} (or all).')
  if lora.rank <= 0:
    raise ValueError(f'model.lora.rank={lora.rank} must be 1 or more.')
  if not 0.0 <= lora.dropout < 1.0:
    raise ValueError(f'model.lora.dropout={lora.dropout} must be in [0, 1).')
  if lora.base_dtype not in BASE_DTYPES:
    raise ValueError(f'model.lora.base_dtype={lora.base_dtype!r} is not one '
                     f'of {BASE_DTYPES}.')


def target_set(lora: LoraConfig, gated_ffn: bool) -> frozenset[str]:
  """The projections `lora.targets` names, checked against the model's.

  Raises:
    ValueError: a name the model has no projection of (naming those it
      has), and what `check` refuses.
  """
  check(lora)
  if not lora.enabled:
    return frozenset()
  present = model_projections(gated_ffn)
  names = _names(lora)
  if names == ['all']:
    names = list(present)
  missing = [name for name in names if name not in present]
  if missing:
    raise ValueError(
        f'model.lora.targets={lora.targets!r}: {", ".join(missing)} matches '
        f'no projection of this model; its projections are '
        f'{", ".join(present)} (or all).')
  return frozenset(names)


def from_dict(values) -> LoraConfig:
  """`model.lora` as a LoraConfig; an unknown key is an error naming it."""
  if isinstance(values, LoraConfig):
    return values
  values = dict(values)
  known = {f.name for f in dataclasses.fields(LoraConfig)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(f'Unknown model.lora key(s) {unknown}; valid keys are '
                     f'{sorted(known)}.')
  return LoraConfig(**values)


def is_adapter(path: tuple[str, ...]) -> bool:
  """Whether the parameter at `path` (names from the root) is an adapter's."""
  return bool(path) and path[-1] in ADAPTER_PARAMS


def adapter_factors(module: nn.Module, out_features: int, in_features: int):
  """(A [rank, in], B [out, rank]) float32 parameters of `module` (called
  inside its compact method). A draws as PEFT's (Kaiming-uniform, bound
  1/sqrt(in)), B is zero. Both are replicated: they are small, and the mesh
  shards the frozen kernel beside them."""
  rank = module.config.lora.rank
  a = module.param('lora_a', nn.with_logical_partitioning(
      nn.initializers.variance_scaling(1.0 / 3.0, 'fan_in', 'uniform'),
      (None, None)), (rank, in_features), jnp.float32)
  b = module.param('lora_b', nn.with_logical_partitioning(
      nn.initializers.zeros, (None, None)), (out_features, rank),
      jnp.float32)
  return a, b


def adapter_product(x: jax.Array, a: jax.Array, b: jax.Array, scale: float
                    ) -> jax.Array:
  """scale * x A^T B^T: [..., in] -> [..., out], in x's dtype."""
  low = jnp.einsum('...i,ri->...r', x, a.astype(x.dtype))
  return jnp.einsum('...r,or->...o', low, b.astype(x.dtype)) * jnp.asarray(
      scale, x.dtype)
