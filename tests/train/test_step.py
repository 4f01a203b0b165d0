"""The train step: sharded over any mesh layout, with accumulation, remat and
scan giving the same numbers as the plain single-device step."""
import flax
import jax
import ml_collections
import numpy as np
import pytest

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.model import ModelConfig
from jaxformer.train.tasks import get_task
from jaxformer.train import schedule as schedules
from jaxformer.train.state import create_train_state
from jaxformer.train.step import compile_train_step

# Adam divides each gradient by its own running size plus eps. With the
# paper's eps (1e-9), a weight whose gradient is nearly zero moves by about
# the learning rate in a direction that rounding decides, so sharded and
# plain runs differed by up to 1.4e-3 after four steps, more on some CPUs
# than others. With eps=1e-4, ten times below the median clipped gradient
# (1.2e-3 on the first batch), such a weight barely moves, and the runs agree
# to ~2e-6.
TRAIN = ml_collections.ConfigDict(dict(
    schedule='rsqrt', learning_rate=1.0, warmup_steps=4, num_steps=10,
    b1=0.9, b2=0.98, eps=1e-4, weight_decay=0.0, grad_clip_norm=1.0))


def tiny_model(**overrides) -> ModelConfig:
  fields = dict(vocab_size=64, d_model=32, num_heads=4, d_ff=64,
                num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                embedding_dropout=0.0, residual_dropout=0.0)
  fields.update(overrides)
  return ModelConfig(**fields)


def toy_batches(steps: int, rows: int = 16, length: int = 12, seed: int = 0):
  """Copy-and-reverse pairs with varied lengths (padding included)."""
  rng = np.random.default_rng(seed)
  batches = []
  for _ in range(steps):
    inputs = np.zeros((rows, length), np.int32)
    targets = np.zeros((rows, length), np.int32)
    for r in range(rows):
      n = rng.integers(2, length - 1)
      tokens = rng.integers(4, 64, size=n)
      inputs[r, :n], inputs[r, n] = tokens, 1
      targets[r, :n], targets[r, n] = tokens[::-1], 1
    batches.append({'inputs': inputs, 'targets': targets})
  return batches


def run_steps(model_config, mesh_sizes, num_devices, batches,
              grad_accum_steps=1, task_name='translation'):
  """Returns (losses per step, gradient norms per step, final params as
  numpy). Adam is nearly invariant to the gradient's scale, so parameters
  alone would not show a step that sums or averages its gradient wrongly;
  the norms do. `mesh_sizes` may be a Mesh."""
  mesh = mesh_sizes
  if not isinstance(mesh, jax.sharding.Mesh):
    mesh = mesh_lib.make_mesh(mesh_sizes, jax.devices()[:num_devices])
  rules = mesh_lib.DEFAULT_AXIS_RULES
  task = get_task(task_name)
  schedule = schedules.make_schedule(TRAIN, model_config.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  state = create_train_state(task, task.model(model_config), tx, batches[0],
                             mesh, rules, seed=0)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(model_config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=0.1,
        grad_accum_steps=grad_accum_steps, prng_impl='threefry2x32')
    losses, grad_norms = [], []
    for batch in batches:
      state, metrics = step(state, mesh_lib.global_batch(batch, mesh))
      losses.append(float(metrics['loss']))
      grad_norms.append(float(metrics['grad_norm']))
  return (np.array(losses), np.array(grad_norms),
          jax.tree.map(np.asarray, state.params))


def assert_same_run(run, reference):
  """Losses and gradient norms to float32 rounding, parameters to
  ADAM_ATOL."""
  np.testing.assert_allclose(run[0], reference[0], rtol=1e-5)
  np.testing.assert_allclose(run[1], reference[1], rtol=1e-4)
  assert_params_close(run[2], reference[2], atol=ADAM_ATOL)


def assert_params_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(x, y, atol=atol)


ADAM_ATOL = 2e-5  # See TRAIN.


STEPS = 4


@pytest.fixture(scope='module')
def single_device_run():
  """The reference: plain model, one device, no accumulation."""
  return run_steps(tiny_model(), {'data': 1}, 1, toy_batches(STEPS))


@pytest.mark.slow
@pytest.mark.parametrize('mesh_sizes', [
    {'data': 8}, {'data': 2, 'fsdp': 4}, {'data': 2, 'fsdp': 2, 'tensor': 2}])
def test_sharded_steps_match_single_device(single_device_run, mesh_sizes):
  assert_same_run(run_steps(tiny_model(), mesh_sizes, 8, toy_batches(STEPS)),
                  single_device_run)


@pytest.mark.slow
def test_two_slices_step_as_one_device(single_device_run):
  """A hybrid mesh: the 8 CPU devices (which have no slice_index) grouped
  into two fake slices of 4 by device id, each a data=2 x fsdp=2 mesh,
  stacked along `dcn`. The batch splits over dcn x data x fsdp, each slice
  holds whole parameters (FSDP within it), and the steps give the plain
  run's numbers."""
  mesh = mesh_lib.make_mesh({'data': 2, 'fsdp': 2}, jax.devices()[:8],
                            dcn_data=2, slice_of=lambda device: device.id // 4)
  assert dict(mesh.shape) == {'dcn': 2, 'data': 2, 'fsdp': 2, 'tensor': 1}
  assert [{d.id // 4 for d in part.flat} for part in mesh.devices] == [{0},
                                                                       {1}]
  assert mesh_lib.row_shards(mesh) == 8
  assert_same_run(run_steps(tiny_model(), mesh, 8, toy_batches(STEPS)),
                  single_device_run)


@pytest.mark.slow
def test_fsdp_and_tensor_axes_shard_the_parameters():
  mesh = mesh_lib.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  task = get_task('translation')
  tx = schedules.make_optimizer(TRAIN, schedules.make_schedule(TRAIN, 32))
  state = create_train_state(task, task.model(tiny_model()), tx,
                             toy_batches(1)[0], mesh,
                             mesh_lib.DEFAULT_AXIS_RULES, seed=0)
  ffn_in = state.params['encoder']['layer_0']['ffn']['wi']['kernel']
  # [mlp, embed]: the hidden units split over 'tensor', the inputs over 'fsdp'.
  assert ffn_in.sharding.spec == jax.sharding.PartitionSpec('tensor', 'fsdp')
  # Adam's moments follow their parameters.
  adam_mu = state.opt_state[1][0].mu['encoder']['layer_0']['ffn']['wi']['kernel']
  assert adam_mu.sharding.spec == ffn_in.sharding.spec
  assert ffn_in.addressable_shards[0].data.shape == (32, 16)


@pytest.mark.slow
def test_loss_falls_on_a_toy_task(single_device_run):
  losses = single_device_run[0]
  assert losses[-1] < losses[0] - 0.15


@pytest.mark.slow
def test_gradient_accumulation_equals_a_larger_batch(single_device_run):
  assert_same_run(run_steps(tiny_model(), {'data': 1}, 1, toy_batches(STEPS),
                            grad_accum_steps=4), single_device_run)


@pytest.mark.slow
def test_remat_gives_the_plain_losses(single_device_run):
  assert_same_run(run_steps(tiny_model(remat_policy='full'), {'data': 1}, 1,
                            toy_batches(STEPS)), single_device_run)


def stack_layers(params):
  """Plain 'layer_i' parameters -> the scanned layout ('layers', leading
  layer axis)."""
  if not isinstance(params, dict):
    return params
  names = sorted(k for k in params if k.startswith('layer_'))
  out = {k: stack_layers(v) for k, v in params.items() if k not in names}
  if names:
    out['layers'] = jax.tree.map(lambda *xs: np.stack(xs),
                                 *[params[n] for n in names])
  return out


@pytest.mark.slow
@pytest.mark.parametrize('remat_policy', ['none', 'dots'])
def test_scanned_layers_give_the_plain_loss_and_gradients(remat_policy):
  task = get_task('translation')
  batch = toy_batches(1)[0]
  plain = task.model(tiny_model())
  scanned = task.model(tiny_model(scan_layers=True, remat_policy=remat_policy))
  params = jax.tree.map(np.asarray, flax.linen.unbox(
      task.init_variables(plain, jax.random.key(0), batch)['params']))

  def loss_and_grads(model, params):
    return jax.value_and_grad(
        lambda p: task.loss_sums(model, p, batch, {}, 0.1)['loss'])(params)

  plain_loss, plain_grads = loss_and_grads(plain, params)
  scanned_loss, scanned_grads = loss_and_grads(scanned, stack_layers(params))
  np.testing.assert_allclose(scanned_loss, plain_loss, rtol=1e-5)
  assert_params_close(scanned_grads, stack_layers(plain_grads), atol=1e-5)


def accumulating_fsdp_step_jaxpr(grad_accum_steps=2):
  """(the traced jaxpr of an accumulating step on an fsdp=4 mesh, the
  number of parameter arrays)."""
  mesh = mesh_lib.make_mesh({'fsdp': 4}, jax.devices()[:4])
  rules = mesh_lib.DEFAULT_AXIS_RULES
  task = get_task('translation')
  schedule = schedules.make_schedule(TRAIN, 32)
  tx = schedules.make_optimizer(TRAIN, schedule)
  batch = toy_batches(1, rows=8)[0]
  state = create_train_state(task, task.model(tiny_model()), tx, batch, mesh,
                             rules, seed=0)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task, model=task.model(tiny_model()), tx=tx,
        schedule=schedule, label_smoothing=0.1,
        grad_accum_steps=grad_accum_steps, prng_impl='threefry2x32')
    traced = step.trace(state, mesh_lib.global_batch(batch, mesh))
  return traced.jaxpr, shardings.params


@pytest.mark.slow
def test_gradient_accumulation_carry_is_sharded_like_the_parameters():
  """The gradient sums carried between microbatches enter the loop, and
  leave each iteration, through sharding constraints to the parameters'
  own shardings (under FSDP: each device holds its shard of the sums)."""
  jaxpr, param_shardings = accumulating_fsdp_step_jaxpr()
  inner = next(e for e in jaxpr.eqns if e.primitive.name == 'pjit'
               ).params['jaxpr'].jaxpr if any(
                   e.primitive.name == 'pjit' for e in jaxpr.eqns) else jaxpr
  specs = sorted(str(s.spec) for s in jax.tree.leaves(param_shardings))

  def constrained(eqns):
    """vars made by sharding constraints -> their specs."""
    return {out: str(e.params['sharding'].spec) for e in eqns
            if e.primitive.name == 'sharding_constraint' for out in e.outvars}

  def variables(atoms):
    return [v for v in atoms if type(v).__name__ != 'Literal']

  scan = next(e for e in inner.eqns if e.primitive.name == 'scan')
  made = constrained(inner.eqns)
  num_consts = scan.params['num_consts']
  init = scan.invars[num_consts:num_consts + scan.params['num_carry']]
  assert sorted(made[v] for v in variables(init) if v in made) == specs
  body = scan.params['jaxpr'].jaxpr
  carried_out = body.outvars[:scan.params['num_carry']]
  made = constrained(body.eqns)
  assert sorted(made[v] for v in variables(carried_out) if v in made) == specs
  assert any('fsdp' in spec for spec in specs)


@pytest.mark.slow
def test_gradient_accumulation_under_fsdp_equals_a_larger_batch(
    single_device_run):
  assert_same_run(run_steps(tiny_model(), {'data': 2, 'fsdp': 4}, 8,
                            toy_batches(STEPS), grad_accum_steps=2),
                  single_device_run)
