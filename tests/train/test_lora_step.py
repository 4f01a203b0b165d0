"""The train step of a model with adapters (model.lora): gradients and an
update for the adapters alone, optimizer state for them alone, the frozen
base bitwise as it came in, on a sharded (FSDP) mesh and with scanned,
rematerialised layers."""
import jax
import numpy as np
import pytest
from flax import traverse_util

from jaxformer.model import lora
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import frozen_base
from jaxformer.train import schedule as schedules
from jaxformer.train.state import create_train_state
from jaxformer.train.step import compile_train_step
from jaxformer.train.tasks import get_task
from tests.train.test_step import TRAIN, tiny_model, toy_batches


def _flat_numpy(tree):
  return {path: np.asarray(leaf) for path, leaf in
          traverse_util.flatten_dict(jax.tree.map(np.asarray, tree)).items()}


def run(model_config, mesh_sizes, steps=3):
  """(initial params, final params, final opt_state, losses) of `steps`
  steps on a mesh of 8 devices."""
  mesh = mesh_lib.make_mesh(mesh_sizes, jax.devices()[:8])
  rules = mesh_lib.DEFAULT_AXIS_RULES
  task = get_task('translation')
  schedule = schedules.make_schedule(TRAIN, model_config.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  batches = toy_batches(steps)
  state = create_train_state(task, task.model(model_config), tx, batches[0],
                             mesh, rules, seed=0)
  initial = _flat_numpy(state.params)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  losses = []
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(model_config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=0.1, grad_accum_steps=1,
        prng_impl='threefry2x32')
    for batch in batches:
      state, metrics = step(state, mesh_lib.global_batch(batch, mesh))
      losses.append(float(metrics['loss']))
  return initial, _flat_numpy(state.params), state.opt_state, losses


@pytest.mark.slow
@pytest.mark.parametrize('mesh_sizes,layout', [
    ({'data': 8}, {}),
    ({'data': 2, 'fsdp': 4}, dict(scan_layers=True, remat_policy='full'))])
def test_only_adapters_train(mesh_sizes, layout):
  config = tiny_model(**layout, lora=dict(targets='q,v,ffn_in', rank=4,
                                          dropout=0.1))
  initial, final, opt_state, losses = run(config, mesh_sizes)
  assert np.all(np.isfinite(losses))
  changed = {path for path in final
             if not np.array_equal(final[path], initial[path])}
  adapters = {path for path in final if lora.is_adapter(path)}
  assert changed and changed <= adapters
  # B starts at zero and moves; A moves once B is non-zero.
  assert any(path[-1] == 'lora_b' for path in changed)
  for path in set(final) - adapters:
    assert final[path].tobytes() == initial[path].tobytes(), path


@pytest.mark.slow
def test_optimizer_state_is_the_adapters_alone():
  config = tiny_model(lora=dict(targets='all', rank=2))
  _, final, opt_state, _ = run(config, {'data': 8}, steps=1)
  adam = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: hasattr(s, 'mu'))if hasattr(s, 'mu')][0]
  moment_paths = set(traverse_util.flatten_dict(adam.mu))
  assert moment_paths == {path for path in final if lora.is_adapter(path)}
  adapter_size = sum(final[p].size for p in moment_paths)
  assert sum(x.size for x in jax.tree.leaves(adam.mu)) == adapter_size
  assert adapter_size < sum(x.size for x in final.values()) / 5


def test_split_and_merge_are_inverse():
  params = {'encoder': {'q': {'kernel': 1, 'lora_a': 2, 'lora_b': 3}},
            'classifier': {'kernel': 4}, 'embed': {'embedding': 5}}
  trainable, frozen = frozen_base.split(params)
  assert trainable == {'encoder': {'q': {'lora_a': 2, 'lora_b': 3}},
                       'classifier': {'kernel': 4}}
  assert frozen == {'encoder': {'q': {'kernel': 1}}, 'embed': {'embedding': 5}}
  assert frozen_base.merge(trainable, frozen) == params
  plain = {'encoder': {'q': {'kernel': 1}}}
  assert frozen_base.split(plain) == (plain, {})


@pytest.mark.slow
@pytest.mark.parametrize('base_dtype, stored', [('int8', np.int8),
                                                ('nf4', np.uint8)])
def test_a_quantized_base_stays_quantized_and_unchanged(base_dtype, stored):
  config = tiny_model(lora=dict(targets='q,v', rank=2, base_dtype=base_dtype))
  initial, final, _, losses = run(config, {'data': 2, 'fsdp': 4}, steps=2)
  assert np.all(np.isfinite(losses))
  kernel = ('encoder', 'layer_0', 'self_attention', 'query', 'kernel')
  assert final[kernel].dtype == stored
  for path in final:
    if not lora.is_adapter(path):
      assert final[path].tobytes() == initial[path].tobytes(), path
