"""Start-up of every host of the multi-host TPU layouts in launch/README.md,
on the devices of libtpu's compile-only client, which carry each chip's
process index as a pod gives it (jax.make_mesh interleaves the hosts).

`programs.rehearse_hosts` runs, for every process, `host_plan.plan_host`: the
function `jaxformer train` runs at start-up on its own host. Nothing is
compiled here, so these take seconds.
"""
import jax
import pytest

pytest.importorskip(
    'libtpu', reason='libtpu has wheels for Linux x86_64 only; elsewhere '
    'install it as `pip install -e ".[tpu]"` does on Linux x86_64.')

from jaxformer.aot import programs
from jaxformer.aot import topology as topology_lib
from jaxformer.aot.compile_run import compile_run
from jaxformer.run import host_plan
from jaxformer.train import run_spec
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.config.settings import load_config  # noqa: E402

# (topology, mesh, rows per process, rows per device) with batch_size=512,
# as launch/README.md's table says.
LAYOUTS = [
    ('v4-16', {'data': -1}, 256, 64),
    ('v5e-16', {'data': -1}, 128, 32),
    ('v5e-16', {'data': -1, 'tensor': 4}, 128, 128),
    ('v5e-64', {'data': -1}, 32, 8),
    ('v6e-16', {'data': -1}, 128, 32),
    ('v5p-64', {'data': 1, 'fsdp': -1}, 64, 16),
    ('v5p-64', {'data': 8, 'fsdp': 4}, 64, 16),
    ('v5p-64', {'data': 1, 'fsdp': 8, 'tensor': 4}, 64, 64),
]


def pod_config(mesh: dict, path: str = 'configs/quickstart.py'):
  overrides = ['data.batch_size=512'] + [
      f'mesh.{axis}={mesh.get(axis, 1)}' for axis in ('data', 'fsdp', 'tensor')]
  return run_spec.with_expected_vocabulary(load_config(path, overrides))


def rehearse(topology: str, config):
  devices = topology_lib.topology_devices(topology_lib.topology(topology))
  run = programs.compiled_run(config, devices)
  return run.mesh, programs.rehearse_hosts(run)


def assert_each_host_feeds_its_rows(mesh, plans, per_process):
  """Each host reads the rows its devices hold, per_process of them, and
  every row of the global batch is fed by exactly one host. Returns the
  rows of each device."""
  placed = mesh_lib.batch_sharding(mesh).devices_indices_map((512,))
  for plan in plans:
    assert plan.local_train_shapes == ((per_process, 40, 40),)
    held = {row for device, (rows,) in placed.items()
            if device.process_index == plan.process_index
            for row in range(rows.start, rows.stop)}
    assert sorted(held) == plan.share.rows(512).tolist()
  fed = sorted(row for plan in plans for row in plan.share.rows(512))
  assert fed == list(range(512))
  return placed


@pytest.mark.parametrize('topology, mesh_sizes, per_process, per_device',
                         LAYOUTS, ids=[f'{t}-{"x".join(map(str, m.values()))}'
                                       for t, m, _, _ in LAYOUTS])
def test_every_host_of_the_pod_layouts_starts(topology, mesh_sizes,
                                              per_process, per_device):
  config = pod_config(mesh_sizes)
  mesh, plans = rehearse(topology, config)
  assert [plan.process_index for plan in plans] == sorted(
      {d.process_index for d in mesh.devices.flat})
  assert len(plans) > 1
  placed = assert_each_host_feeds_its_rows(mesh, plans, per_process)
  assert all(rows.stop - rows.start == per_device
             for rows, in placed.values())
  # Each host holds its part of the train state; together, all of it.
  abstract, _ = run_spec.RunSpec.build(config, mesh).state_layout
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  assert all(0 < plan.state_bytes <= total for plan in plans)
  assert sum(plan.state_bytes for plan in plans) >= total


def test_a_pod_mesh_interleaves_hosts_and_each_feeds_its_own_shards():
  """What CPU processes never show: v4-16's hosts alternate along `data`."""
  _, plans = rehearse('v4-16', pod_config({'data': -1}))
  assert [plan.share.shards for plan in plans] == [(0, 2, 4, 6), (1, 3, 5, 7)]


def test_tensor_groups_are_kept_within_a_host():
  """jax.make_mesh would put a v5p-64's tensor=4 groups across two hosts."""
  config = pod_config({'data': 1, 'fsdp': 8, 'tensor': 4})
  mesh, plans = rehearse('v5p-64', config)
  for group in mesh.devices.reshape(-1, 4):
    assert len({device.process_index for device in group}) == 1
  assert [plan.share.shards for plan in plans] == [(p,) for p in range(8)]


@pytest.mark.parametrize('mesh_sizes, message', [
    ({'data': 2, 'tensor': 8}, 'row shard 0 is held by devices of processes'),
    ({'data': 3, 'fsdp': -1}, 'divisible'),
])
def test_compile_refuses_what_train_refuses_with_the_same_message(
    mesh_sizes, message):
  config = pod_config(mesh_sizes)
  devices = topology_lib.topology_devices(topology_lib.topology('v5e-16'))
  with pytest.raises(ValueError, match=message) as train_error:
    mesh = run_spec.run_mesh(config, devices)
    host_plan.plan_host(config, mesh, 0)
  with pytest.raises(ValueError) as compile_error:
    compile_run(config, 'v5e-16', kinds=())
  assert str(compile_error.value) == str(train_error.value)


def test_a_bucket_config_starts_on_every_host_of_a_v5p_64():
  config = pod_config({'data': 8, 'fsdp': 4}, 'configs/wmt14_ende_base.py')
  _, plans = rehearse('v5p-64', config)
  for plan in plans:
    assert len(plan.local_train_shapes) == len(plan.train_shapes) > 1
    for (rows, _, _), (local, _, _) in zip(plan.train_shapes,
                                           plan.local_train_shapes):
      assert local * len(plans) == rows


# (topology, slices, mesh within a slice, rows per process) with
# batch_size=512: the data axis spans the slices (mesh.dcn_data).
MULTISLICE = [
    ('v5e-16', 2, {'data': -1}, 64),
    ('v5e-16', 2, {'data': 1, 'fsdp': -1}, 64),
    ('v5p-64', 4, {'data': 1, 'fsdp': -1}, 16),
    ('v5p-64', 4, {'data': 1, 'fsdp': 8, 'tensor': 4}, 16),
]


def rehearse_slices(topology: str, slices: int, config):
  devices = topology_lib.topology_devices(
      topology_lib.topology(topology, slices))
  run = programs.compiled_run(config, devices)
  return run, programs.rehearse_hosts(run)


@pytest.mark.parametrize(
    'topology, slices, mesh_sizes, per_process', MULTISLICE,
    ids=[f'{s}x{t}-{"x".join(map(str, m.values()))}'
         for t, s, m, _ in MULTISLICE])
def test_every_host_of_every_slice_starts(topology, slices, mesh_sizes,
                                          per_process):
  config = pod_config(mesh_sizes)
  config.mesh.dcn_data = slices
  run, plans = rehearse_slices(topology, slices, config)
  mesh = run.mesh
  assert mesh.axis_names == ('dcn', 'data', 'fsdp', 'tensor')
  # One slice per position along dcn, in slice order.
  assert [{d.slice_index for d in part.flat} for part in mesh.devices] == [
      {s} for s in range(slices)]
  hosts = sorted({d.process_index for d in mesh.devices.flat})
  assert [plan.process_index for plan in plans] == hosts
  slice_of = {d.process_index: d.slice_index for d in mesh.devices.flat}
  assert len(hosts) == len(slice_of) and all(
      d.slice_index == slice_of[d.process_index] for d in mesh.devices.flat)
  assert_each_host_feeds_its_rows(mesh, plans, per_process)
  # Each slice holds the whole train state (replicated across slices).
  abstract, _ = run.state_layout
  total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract))
  per_slice = len(plans) // slices
  for s in range(slices):
    in_slice = plans[s * per_slice:(s + 1) * per_slice]
    assert sum(plan.state_bytes for plan in in_slice) >= total


def test_a_two_slice_mesh_is_the_hybrid_mesh_of_mesh_utils():
  from jax.experimental import mesh_utils
  devices = topology_lib.topology_devices(topology_lib.topology('v5e-16', 2))
  mesh = mesh_lib.make_mesh({'data': -1}, devices, dcn_data=2)
  hybrid = mesh_utils.create_hybrid_device_mesh((1, 16, 1, 1), (2, 1, 1, 1),
                                                devices)
  assert mesh.devices.tolist() == hybrid.tolist()


@pytest.mark.parametrize('slices, dcn_data', [(2, 1), (2, 3), (1, 2)])
def test_a_dcn_data_that_is_not_the_slice_count_is_refused(slices, dcn_data):
  config = pod_config({'data': -1})
  config.mesh.dcn_data = dcn_data
  message = (f'mesh.dcn_data={dcn_data} does not match the {slices} slices')
  with pytest.raises(ValueError, match=message):
    compile_run(config, 'v5e-16', kinds=(), num_slices=slices)
