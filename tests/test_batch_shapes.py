"""Every batch shape a config can produce splits over the mesh, checked at
start-up: the WMT configs' buckets on 8 devices, layouts that processes
could not feed, data lengths beyond the model's positions."""
import jax
import numpy as np
import pytest

from jaxformer.config import settings as config_lib
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.data import bucketing
from jaxformer.data import task_batches

WMT = ['configs/wmt14_ende_base.py', 'configs/wmt14_ende_big.py']
MESHES = [{'data': 8}, {'data': 2, 'fsdp': 4}]


def local_batch(rows: int, source: int, target: int) -> dict[str, np.ndarray]:
  return {'inputs': np.zeros((rows, source), np.int32),
          'targets': np.zeros((rows, target), np.int32)}


@pytest.mark.parametrize('grad_accum_steps', [1, 2])
@pytest.mark.parametrize('mesh_sizes', MESHES, ids=['data8', 'data2-fsdp4'])
@pytest.mark.parametrize('path', WMT)
def test_every_bucket_of_the_wmt_configs_splits_over_8_devices(
    path, mesh_sizes, grad_accum_steps):
  config = config_lib.load_config(
      path, [f'train.grad_accum_steps={grad_accum_steps}'])
  mesh = mesh_lib.make_mesh(mesh_sizes, jax.devices()[:8])
  shapes = task_batches.check_batch_shapes(config, mesh_lib.row_shards(mesh))
  widths = bucketing.bucket_lengths(256)
  assert len(shapes) == len(widths)
  budget = config.data.tokens_per_batch
  for (rows, source, target), width in zip(shapes, widths):
    assert rows % (8 * grad_accum_steps) == 0
    assert rows * width <= budget  # 25,000 tokens allow 8 x 2 rows of 256.
    assert rows * width > budget - 8 * grad_accum_steps * width  # Kept.
    batch = mesh_lib.global_batch(local_batch(rows, source, target), mesh)
    assert batch['inputs'].shape == (rows, source)
    assert len({s.data.shape for s in batch['inputs'].addressable_shards}) == 1


def test_the_rows_without_a_multiple_would_not_split():
  """What the rounding fixes: 25,000 tokens / width 8 is 3,125 rows."""
  widths = bucketing.bucket_lengths(256)
  assert 3125 in bucketing.bucket_rows(25_000, widths)
  assert (bucketing.bucket_rows(25_000, widths, 8) % 8 == 0).all()


def test_a_pack_batch_size_that_does_not_split_is_an_error_at_start_up():
  config = config_lib.load_config('configs/quickstart.py',
                                  ['data.batch_size=12'])
  with pytest.raises(ValueError, match='data.batch_size'):
    task_batches.check_batch_shapes(config, row_shards=8)


def test_bucket_batches_hold_no_segment_ids_for_the_model():
  """One example per row: the model's defaults are the segment ids, and the
  model then knows that rows are not packed (cuDNN takes them)."""
  batch = {'inputs': np.ones((2, 4), np.int32),
           'inputs_segment_ids': np.ones((2, 4), np.int32),
           'inputs_positions': np.zeros((2, 4), np.int32)}
  assert set(task_batches._without_packing(batch)) == {'inputs'}


def two_hosts(device):
  """Devices 0-3 on process 0, 4-7 on process 1, as on two 4-chip hosts."""
  return device.id // 4


@pytest.mark.parametrize('mesh_sizes', [
    {'data': 8}, {'data': 2, 'fsdp': 4}, {'fsdp': 8}, {'data': 4, 'tensor': 2}])
def test_layouts_that_split_rows_by_process_are_accepted(mesh_sizes):
  shares = mesh_lib.row_shares(mesh_lib.make_mesh(mesh_sizes), two_hosts)
  shards = sorted(s for share in shares.values() for s in share.shards)
  assert shards == list(range(shares[0].num_shards))


def test_hosts_that_alternate_feed_the_shards_they_hold():
  """As jax.make_mesh orders a v4-16's chips: hosts alternate along `data`."""
  mesh = jax.sharding.Mesh(
      np.array(jax.devices()).reshape(2, 4).T.reshape(8, 1, 1),
      mesh_lib.MESH_AXES)
  shares = mesh_lib.row_shares(mesh, two_hosts)
  assert shares[0].shards == (0, 2, 4, 6) and shares[1].shards == (1, 3, 5, 7)
  assert shares[1].rows(16).tolist() == [2, 3, 6, 7, 10, 11, 14, 15]


@pytest.mark.parametrize('mesh_sizes', [{'tensor': 8}, {'data': 2, 'tensor': 4},
                                        {'fsdp': 2, 'tensor': 4}])
def test_a_tensor_axis_across_processes_is_rejected(mesh_sizes):
  """A tensor axis spanning both hosts repeats rows on devices of both, but
  each process reads only its own rows."""
  mesh = mesh_lib.make_mesh(mesh_sizes)
  mesh = jax.sharding.Mesh(  # Hosts alternate along the tensor axis.
      np.array(jax.devices()).reshape(4, 2).T.reshape(mesh.devices.shape),
      mesh.axis_names)
  with pytest.raises(ValueError, match='mesh.tensor'):
    mesh_lib.row_shares(mesh, two_hosts)


def test_processes_with_unequal_shares_are_rejected():
  def three_and_five(device):
    return int(device.id >= 3)
  with pytest.raises(ValueError, match='unequal numbers of row shards'):
    mesh_lib.row_shares(mesh_lib.make_mesh({'data': 8}), three_and_five)


@pytest.mark.parametrize('key', ['max_source_length', 'max_target_length'])
def test_data_longer_than_the_model_positions_is_a_config_error(key):
  with pytest.raises(config_lib.ConfigError,
                     match=rf'data\.{key}=300 .*model\.max_len=256'):
    config_lib.load_config('configs/wmt14_ende_base.py', [f'data.{key}=300'])
