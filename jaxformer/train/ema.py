"""An exponential moving average of the parameters (`train.ema_decay`).

The average is kept in the train state as `TrainStateWithEma.ema`:
float32, one array per parameter, laid out (sharded) as the parameters
are, and saved with them in every checkpoint. With `train.ema_decay=0`
(the default) the state is a plain `TrainState`, which has none, and
checkpoints are as they were before.

After the update of step t (counted from 0, as `TrainState.step` before the
update), with the new parameters p:

  decay_t = min(ema_decay, (1 + t) / (10 + t))
  ema <- decay_t * ema + (1 - decay_t) * p

The warm-up of the decay (TensorFlow's `ExponentialMovingAverage` with
`num_updates`) keeps the first steps' average close to the newest
parameters, instead of to the random initial ones: 0.1 at step 0, 0.5 at
step 8, 0.9 at step 80, 0.99 at step 890, 0.999 at step 8,990.
"""
from typing import Any

import jax
import jax.numpy as jnp

# What `--weights` may ask of a trained model; 'ema' only where it has one.
WEIGHTS = ('ema', 'raw')


def warmed_decay(ema_decay: float, step: jax.Array) -> jax.Array:
  """The decay applied after the update of `step` (0-based): `ema_decay`,
  lowered during the first steps as the module docstring says."""
  step = jnp.asarray(step, jnp.float32)
  return jnp.minimum(jnp.float32(ema_decay), (1.0 + step) / (10.0 + step))


def initial(params: Any) -> Any:
  """The average before any step: the parameters, in float32 (works on
  Flax's boxed parameters too, keeping their partitioning). Always a copy:
  the step donates the state, and a float32 parameter and its average
  must not share one buffer."""
  return jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)


def of(state) -> Any:
  """The average `state` keeps, or None."""
  return getattr(state, 'ema', None)


def updated(ema: Any, params: Any, ema_decay: float, step: jax.Array) -> Any:
  """The average after the update of `step` gave `params`."""
  decay = warmed_decay(ema_decay, step)
  return jax.tree.map(
      lambda e, p: decay * e + (1.0 - decay) * jnp.asarray(p, jnp.float32),
      ema, params)


def as_params(ema: Any, params: Any) -> Any:
  """The average in the parameters' dtypes: what a model computes with."""
  return jax.tree.map(lambda e, p: e.astype(p.dtype), ema, params)


def restarted(state, params: Any):
  """`state` with `params` (a pretrained start) and its average, if it keeps
  one, restarted from them."""
  if of(state) is None:
    return state.replace(params=params)
  return state.replace(params=params, ema=initial(params))


def kept_by(config: dict) -> bool:
  """Whether a run of `config` (a saved config as a dict, or a ConfigDict)
  keeps an average: its checkpoints then hold one."""
  train = config.get('train') or {}
  return float(train.get('ema_decay', 0.0) or 0.0) > 0.0


def choose(weights: str | None, has_ema: bool, where: str) -> str:
  """Which weights a command uses: --weights as given, else the average
  where the model has one ('raw' where it has none). Raises for
  --weights ema of a model without one."""
  if weights is None:
    return 'ema' if has_ema else 'raw'
  if weights not in WEIGHTS:
    raise ValueError(f'--weights {weights}: choose one of {", ".join(WEIGHTS)}.')
  if weights == 'ema' and not has_ema:
    raise ValueError(f'--weights ema: {where} keeps no moving average of its '
                     'parameters (train with --config.train.ema_decay=0.999 '
                     'to keep one); pass --weights raw.')
  return weights
