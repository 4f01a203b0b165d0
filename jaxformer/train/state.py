"""The train state, initialised directly into its sharded layout."""
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import struct
from jax.sharding import Mesh

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import ema as ema_lib
from jaxformer.train import frozen_base


class TrainState(struct.PyTreeNode):
  """Everything that changes during training; pure data, so it checkpoints
  as it is. `rng` holds raw key data (uint32) of the configured PRNG.
  `opt_state` is of the trainable parameters (`frozen_base.split`)."""
  step: jax.Array
  params: Any
  opt_state: Any
  rng: jax.Array

  def started_from(self, params: Any) -> 'TrainState':
    """This state with `params` (a pretrained start), its average (if it
    keeps one) restarted from them."""
    return ema_lib.restarted(self, params)


class TrainStateWithEma(TrainState):
  """A train state that keeps `ema`, the moving average of the parameters
  (`train.ema_decay`, `train/ema.py`). A subclass, so that a state without
  one saves and restores exactly as before it existed."""
  ema: Any


def _init_fn(task, model, tx, example_batch, prng_impl, ema_decay=0.0):
  def init(seed):
    key = jax.random.key(seed, impl=prng_impl)
    init_key, dropout_key = jax.random.split(key)
    params = task.init_variables(model, init_key, example_batch)['params']
    fields = dict(step=jnp.array(0, jnp.int32), params=params,
                  opt_state=tx.init(frozen_base.split(params)[0]),
                  rng=jax.random.key_data(dropout_key))
    if ema_decay:
      return TrainStateWithEma(**fields, ema=ema_lib.initial(params))
    return TrainState(**fields)
  return init


def state_shardings(task, model, tx, example_batch, mesh: Mesh, rules,
                    prng_impl: str = 'threefry2x32', ema_decay: float = 0.0):
  """(abstract state, NamedSharding tree): shapes and placement of the state
  without allocating it (`ema_decay` > 0: with the parameters' average)."""
  boxed = jax.eval_shape(_init_fn(task, model, tx, example_batch, prng_impl,
                                  ema_decay), 0)
  abstract = nn.unbox(boxed)
  shardings = mesh_lib.logical_shardings(nn.get_partition_spec(boxed), mesh,
                                         rules, shapes=abstract)
  return abstract, shardings


def create_train_state(task, model: nn.Module, tx: optax.GradientTransformation,
                       example_batch, mesh: Mesh, rules, seed: int,
                       prng_impl: str = 'threefry2x32',
                       ema_decay: float = 0.0) -> TrainState:
  """Initialises parameters and optimizer state on their devices, each shard
  where it belongs: nothing is materialised whole on one device or host.

  Args:
    example_batch: a dict of arrays (any batch size) fixing the input shapes.
  """
  _, shardings = state_shardings(task, model, tx, example_batch, mesh, rules,
                                 prng_impl, ema_decay)
  init = _init_fn(task, model, tx, example_batch, prng_impl, ema_decay)
  with mesh_lib.activate(mesh, rules):
    return jax.jit(lambda seed: nn.unbox(init(seed)),
                   out_shardings=shardings)(seed)


def count_params(params) -> int:
  return sum(int(x.size) for x in jax.tree.leaves(params))
