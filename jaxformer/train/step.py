"""The train and eval steps: pure functions of (state, batch), jit-compiled
with shardings on the mesh. They know nothing of files or data sources."""
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import Mesh

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import ema as ema_lib
from jaxformer.train import frozen_base
from jaxformer.train import loss as losses
from jaxformer.train.state import TrainState


def _microbatches(batch: dict[str, jax.Array], count: int):
  """[rows, ...] -> [count, rows / count, ...]; microbatch j holds rows
  j, j + count, ..., so each device keeps its own rows (no communication)."""
  def split(x):
    rows = x.shape[0]
    if rows % count:
      raise ValueError(f'Batch of {rows} rows is not divisible into '
                       f'train.grad_accum_steps={count} microbatches.')
    x = x.reshape((rows // count, count) + x.shape[1:])
    x = jnp.swapaxes(x, 0, 1)
    return nn.with_logical_constraint(
        x, (None, 'batch') + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def _select(pred, on_true, on_false):
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def train_step(state: TrainState, batch: dict[str, jax.Array], *, task, model,
               tx: optax.GradientTransformation, schedule: optax.Schedule,
               label_smoothing: float, grad_accum_steps: int, prng_impl: str,
               param_shardings: Any = None, ema_decay: float = 0.0
               ) -> tuple[TrainState, dict[str, jax.Array]]:
  """One optimizer update from a global batch.

  With several microbatches, the gradient sums carried between them are
  kept in `param_shardings` (the parameters' shardings, when given): under
  FSDP each device then holds only its shard of the sums.

  The loss is summed over real tokens (or examples) of every microbatch and
  divided once by their global count, so k microbatches give the update of
  one batch k times larger. A non-finite loss or gradient leaves the state
  unchanged (metrics['finite'] = 0); the loop decides to stop or skip.
  A state that keeps a moving average of the parameters
  (`TrainStateWithEma`) updates it with `ema_decay` (`train/ema.py`).
  """
  step_key = jax.random.fold_in(
      jax.random.wrap_key_data(state.rng, impl=prng_impl), state.step)
  # With adapters, only they (and a head) have gradients and an update.
  trainable, frozen = frozen_base.split(state.params)
  if param_shardings is not None:
    param_shardings = frozen_base.split(param_shardings)[0]

  def sums_and_grads(micro_batch, key):
    def loss_sum(trainable):
      params = frozen_base.merge(trainable, frozen)
      sums = task.loss_sums(model, params, micro_batch, {'dropout': key},
                            label_smoothing)
      return sums['loss'], sums
    grads, sums = jax.grad(loss_sum, has_aux=True)(trainable)
    return sums, grads

  if grad_accum_steps == 1:
    sums, grads = sums_and_grads(batch, step_key)
  else:
    def accumulate(carry, inputs):
      index, micro_batch = inputs
      sums, grads = sums_and_grads(micro_batch,
                                   jax.random.fold_in(step_key, index))
      return constrain(jax.tree.map(jnp.add, carry, (sums, grads))), None

    def constrain(carry):
      if param_shardings is None:
        return carry
      sums, grads = carry
      return sums, jax.lax.with_sharding_constraint(grads, param_shardings)
    zeros = constrain(jax.tree.map(
        jnp.zeros_like,
        jax.eval_shape(sums_and_grads, jax.tree.map(
            lambda x: x[0], _microbatches(batch, grad_accum_steps)), step_key)))
    (sums, grads), _ = jax.lax.scan(
        accumulate, zeros,
        (jnp.arange(grad_accum_steps), _microbatches(batch, grad_accum_steps)))

  count = jnp.maximum(sums['weight'], 1.0)
  grads = jax.tree.map(lambda g: g / count, grads)
  grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g))
                           for g in jax.tree.leaves(grads)))
  updates, opt_state = tx.update(grads, state.opt_state, trainable)
  trained = optax.apply_updates(trainable, updates)

  metrics = losses.summarise(sums)
  finite = jnp.isfinite(metrics['loss']) & jnp.isfinite(grad_norm)
  new_state = state.replace(step=state.step + 1,
                            params=frozen_base.merge(
                                _select(finite, trained, trainable), frozen),
                            opt_state=_select(finite, opt_state,
                                              state.opt_state))
  if ema_lib.of(state) is not None:
    # The frozen base's average is the base itself: only the trainable
    # part's moves (so an adapter checkpoint need not hold it).
    ema_trainable, ema_frozen = frozen_base.split(state.ema)
    new_state = new_state.replace(ema=frozen_base.merge(_select(
        finite, ema_lib.updated(ema_trainable, trained, ema_decay,
                                state.step), ema_trainable), ema_frozen))
  metrics.update(grad_norm=grad_norm, learning_rate=schedule(state.step),
                 finite=finite.astype(jnp.float32))
  return new_state, metrics


def eval_sums(params: Any, batch: dict[str, jax.Array], *, task, model
              ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
  """(loss/metric sums, per-row outputs) of one eval batch (no dropout, no
  smoothing): `Task.eval_sums`."""
  return task.eval_sums(model, params, batch)


def compile_train_step(mesh: Mesh, shardings: TrainState, **step_kwargs):
  """`train_step` jitted on `mesh`: state stays in `shardings` and is
  donated, batch is split over the batch axes, metrics are replicated.
  Call it inside `mesh_lib.activate(mesh, rules)`."""
  return jax.jit(
      functools.partial(train_step, param_shardings=shardings.params,
                        **step_kwargs),
      in_shardings=(shardings, mesh_lib.batch_sharding(mesh)),
      out_shardings=(shardings, mesh_lib.replicated(mesh)),
      donate_argnums=(0,))


def compile_eval_step(mesh: Mesh, param_shardings: Any, **step_kwargs):
  return jax.jit(
      functools.partial(eval_sums, **step_kwargs),
      in_shardings=(param_shardings, mesh_lib.batch_sharding(mesh)),
      out_shardings=mesh_lib.replicated(mesh))
