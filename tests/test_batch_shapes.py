"""Every batch shape a config can produce splits over the mesh, checked at
start-up: the WMT configs' buckets on 8 devices, layouts that processes
could not feed, data lengths beyond the model's positions."""
import jax
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import parallel
from jaxformer.data import pipeline
from jaxformer.data import tasks as data_tasks

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
  mesh = parallel.make_mesh(mesh_sizes, jax.devices()[:8])
  shapes = data_tasks.check_batch_shapes(config, parallel.row_shards(mesh),
                                         jax.process_count())
  widths = pipeline.bucket_lengths(256)
  assert len(shapes) == len(widths)
  budget = config.data.tokens_per_batch
  for (rows, source, target), width in zip(shapes, widths):
    assert rows % (8 * grad_accum_steps) == 0
    assert rows * width <= budget  # 25,000 tokens allow 8 x 2 rows of 256.
    assert rows * width > budget - 8 * grad_accum_steps * width  # Kept.
    batch = parallel.global_batch(local_batch(rows, source, target), mesh)
    assert batch['inputs'].shape == (rows, source)
    assert len({s.data.shape for s in batch['inputs'].addressable_shards}) == 1


def test_the_rows_without_a_multiple_would_not_split():
  """What the rounding fixes: 25,000 tokens / width 8 is 3,125 rows."""
  widths = pipeline.bucket_lengths(256)
  assert 3125 in pipeline.bucket_rows(25_000, widths)
  assert (pipeline.bucket_rows(25_000, widths, 8) % 8 == 0).all()


def test_a_pack_batch_size_that_does_not_split_is_an_error_at_start_up():
  config = config_lib.load_config('configs/quickstart.py',
                                  ['data.batch_size=12'])
  with pytest.raises(ValueError, match='data.batch_size'):
    data_tasks.check_batch_shapes(config, row_shards=8, process_count=1)


def test_bucket_batches_hold_no_segment_ids_for_the_model():
  """One example per row: the model's defaults are the segment ids, and the
  model then knows that rows are not packed (cuDNN takes them)."""
  batch = {'inputs': np.ones((2, 4), np.int32),
           'inputs_segment_ids': np.ones((2, 4), np.int32),
           'inputs_positions': np.zeros((2, 4), np.int32)}
  assert set(data_tasks._without_packing(batch)) == {'inputs'}


def two_hosts(device):
  """Devices 0-3 on process 0, 4-7 on process 1, as on two 4-chip hosts."""
  return device.id // 4


@pytest.mark.parametrize('mesh_sizes', [
    {'data': 8}, {'data': 2, 'fsdp': 4}, {'fsdp': 8}, {'data': 4, 'tensor': 2}])
def test_layouts_that_split_rows_by_process_are_accepted(mesh_sizes):
  parallel.check_process_rows(parallel.make_mesh(mesh_sizes), two_hosts)


@pytest.mark.parametrize('mesh_sizes', [{'tensor': 8}, {'data': 2, 'tensor': 4},
                                        {'fsdp': 2, 'tensor': 4}])
def test_a_tensor_axis_across_processes_is_rejected(mesh_sizes):
  """A tensor axis spanning both hosts repeats rows on devices of both, but
  each process reads only its own rows."""
  mesh = parallel.make_mesh(mesh_sizes)
  mesh = jax.sharding.Mesh(  # Hosts alternate along the tensor axis.
      np.array(jax.devices()).reshape(4, 2).T.reshape(mesh.devices.shape),
      mesh.axis_names)
  with pytest.raises(ValueError, match='mesh.tensor'):
    parallel.check_process_rows(mesh, two_hosts)


@pytest.mark.parametrize('key', ['max_source_length', 'max_target_length'])
def test_data_longer_than_the_model_positions_is_a_config_error(key):
  with pytest.raises(config_lib.ConfigError,
                     match=rf'data\.{key}=300 .*model\.max_len=256'):
    config_lib.load_config('configs/wmt14_ende_base.py', [f'data.{key}=300'])
