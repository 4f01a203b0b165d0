"""The moving average of the parameters (`train.ema_decay`): its update is
the documented formula, laid out as the parameters, and it resumes bit for
bit from a checkpoint (the commands: test_ema_commands.py)."""
import dataclasses

import jax
import ml_collections
import numpy as np
import pytest

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.config.settings import default_config
from jaxformer.model import ModelConfig
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import ema as ema_lib
from jaxformer.train import schedule as schedules
from jaxformer.train.state import (TrainState, create_train_state,
                                   state_shardings)
from jaxformer.train.step import compile_train_step
from jaxformer.train.tasks import get_task

TRAIN = ml_collections.ConfigDict(dict(
    schedule='rsqrt', learning_rate=1.0, warmup_steps=4, num_steps=10,
    b1=0.9, b2=0.98, eps=1e-4, weight_decay=0.0, grad_clip_norm=1.0))
MODEL = ModelConfig(vocab_size=64, d_model=16, num_heads=2, d_ff=32,
                    num_encoder_layers=1, num_decoder_layers=1, max_len=16,
                    embedding_dropout=0.0, residual_dropout=0.0)
DECAY = 0.9


def batches(steps: int, rows: int = 8, length: int = 8):
  rng = np.random.default_rng(0)
  return [{'inputs': rng.integers(2, 64, (rows, length)).astype(np.int32),
           'targets': rng.integers(2, 64, (rows, length)).astype(np.int32)}
          for _ in range(steps)]


def setup(mesh, ema_decay=DECAY):
  """(state, jitted step, task) of the tiny model on `mesh`."""
  task = get_task('translation')
  schedule = schedules.make_schedule(TRAIN, MODEL.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  rules = mesh_lib.DEFAULT_AXIS_RULES
  state = create_train_state(task, task.model(MODEL), tx, batches(1)[0], mesh,
                             rules, seed=0, ema_decay=ema_decay)
  step = compile_train_step(
      mesh, jax.tree.map(lambda x: x.sharding, state), task=task,
      model=task.model(MODEL, deterministic=False), tx=tx, schedule=schedule,
      label_smoothing=0.1, grad_accum_steps=1, prng_impl='threefry2x32',
      ema_decay=ema_decay)
  return state, step, (task, tx, rules)


def as_numpy(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope='module')
def mesh():
  return mesh_lib.make_mesh({'data': 2, 'fsdp': 4})


def test_the_warm_up_of_the_decay_is_documented():
  decays = [float(ema_lib.warmed_decay(0.999, t)) for t in (0, 8, 80, 8990)]
  np.testing.assert_allclose(decays, [0.1, 0.5, 0.9, 0.999], rtol=1e-6)
  assert float(ema_lib.warmed_decay(0.5, 10 ** 6)) == 0.5


@pytest.mark.slow
def test_the_update_is_its_formula_and_sharded_like_the_parameters(mesh):
  state, step, _ = setup(mesh)
  assert all(e.dtype == np.float32 and e.sharding == p.sharding
             for e, p in zip(jax.tree.leaves(state.ema),
                             jax.tree.leaves(state.params)))
  assert any(not e.sharding.is_fully_replicated
             for e in jax.tree.leaves(state.ema))
  want = as_numpy(state.params)
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    for t, batch in enumerate(batches(4)):
      state, _ = step(state, mesh_lib.global_batch(batch, mesh))
      decay = min(DECAY, (1 + t) / (10 + t))
      want = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, want,
                          as_numpy(state.params))
  for got, expected, params in zip(jax.tree.leaves(as_numpy(state.ema)),
                                   jax.tree.leaves(want),
                                   jax.tree.leaves(as_numpy(state.params))):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  assert not all(np.array_equal(e, p) for e, p in zip(
      jax.tree.leaves(as_numpy(state.ema)),
      jax.tree.leaves(as_numpy(state.params))))


@pytest.mark.slow
def test_no_average_is_kept_at_decay_zero(mesh):
  state, step, _ = setup(mesh, ema_decay=0.0)
  assert type(state) is TrainState and ema_lib.of(state) is None
  # The fields of a state saved before the average existed: it resumes.
  assert [field.name for field in dataclasses.fields(state)] == [
      'step', 'params', 'opt_state', 'rng']
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    state, _ = step(state, mesh_lib.global_batch(batches(1)[0], mesh))
  assert type(state) is TrainState


@pytest.mark.slow
def test_a_resumed_run_continues_the_average_bit_for_bit(mesh, tmp_path):
  state, step, (task, tx, rules) = setup(mesh)
  data = batches(4)

  def train(state, batches):
    with mesh_lib.activate(mesh, rules):
      for batch in batches:
        state, _ = step(state, mesh_lib.global_batch(batch, mesh))
    return state

  state = train(state, data[:2])
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path),
                                            default_config().checkpoint)
  checkpoints.save(2, state, {})
  checkpoints.wait()
  straight = train(state, data[2:])
  abstract, shardings = state_shardings(task, task.model(MODEL), tx, data[0],
                                        mesh, rules, ema_decay=DECAY)
  resumed = checkpoints.restore_latest(abstract, shardings)
  checkpoints.close()
  assert int(resumed.step) == 2 and resumed.ema is not None
  resumed = train(resumed, data[2:])
  for a, b in zip(jax.tree.leaves(as_numpy(straight)),
                  jax.tree.leaves(as_numpy(resumed))):
    np.testing.assert_array_equal(a, b)


def test_choosing_the_weights():
  assert ema_lib.choose(None, True, 'w') == 'ema'
  assert ema_lib.choose(None, False, 'w') == 'raw'
  assert ema_lib.choose('raw', True, 'w') == 'raw'
  with pytest.raises(ValueError, match='--weights ema: w keeps no moving'):
    ema_lib.choose('ema', False, 'w')
