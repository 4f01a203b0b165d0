"""Reading a Hugging Face folder's safetensors weights without torch: shards
with their index read equal to one model.safetensors; a truncated shard, a
missing shard and an index naming a file that is not there each fail with
one line naming the file."""
import json
import os

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip('safetensors')

from jaxformer.interop import safetensor_files  # noqa: E402
from jaxformer.interop.safetensor_files import INDEX, WeightsError  # noqa: E402


def tensors() -> dict:
  rng = np.random.default_rng(0)
  weights = {f'model.layers.{i}.mlp.up_proj.weight':
             rng.normal(size=(8, 4)).astype(np.float32) for i in range(5)}
  weights['model.embed_tokens.weight'] = rng.normal(size=(16, 4)).astype(
      ml_dtypes.bfloat16)
  weights['model.norm.weight'] = np.ones(4, np.float16)
  return weights


def write_single(folder) -> None:
  from safetensors.numpy import save_file
  os.makedirs(folder, exist_ok=True)
  save_file(tensors(), os.path.join(folder, 'model.safetensors'))


def write_sharded(folder, shards: int = 3, index: bool = True) -> dict:
  """The tensors in `shards` files as save_pretrained shards them; returns
  the index's weight_map."""
  from safetensors.numpy import save_file
  os.makedirs(folder, exist_ok=True)
  names = sorted(tensors())
  weight_map = {}
  for i in range(shards):
    file_name = f'model-{i + 1:05d}-of-{shards:05d}.safetensors'
    part = {n: tensors()[n] for n in names[i::shards]}
    save_file(part, os.path.join(folder, file_name), metadata={'format': 'pt'})
    weight_map.update({n: file_name for n in part})
  if index:
    with open(os.path.join(folder, INDEX), 'w') as f:
      json.dump({'metadata': {'total_size': 0}, 'weight_map': weight_map}, f)
  return weight_map


def assert_equal(weights, expected) -> None:
  assert sorted(weights) == sorted(expected)
  for name, value in expected.items():
    assert weights[name].dtype == value.dtype, name
    np.testing.assert_array_equal(weights[name], value)
    assert weights.shape(name) == value.shape


@pytest.mark.parametrize('index', [True, False], ids=['index', 'no-index'])
def test_shards_read_equal_to_one_file(tmp_path, index):
  write_single(tmp_path / 'single')
  write_sharded(tmp_path / 'sharded', index=index)
  single = safetensor_files.read_safetensors(str(tmp_path / 'single'))
  assert_equal(single, tensors())
  sharded = safetensor_files.read_safetensors(str(tmp_path / 'sharded'))
  assert_equal(sharded, {name: single[name] for name in single})


def test_a_folder_without_safetensors_has_none(tmp_path):
  assert safetensor_files.read_safetensors(str(tmp_path)) is None


def fails_with_one_line(folder, *words):
  with pytest.raises(WeightsError) as error:
    safetensor_files.read_safetensors(str(folder))
  message = str(error.value)
  assert '\n' not in message, message
  for word in words:
    assert word in message, (word, message)


SHARD_2 = 'model-00002-of-00003.safetensors'


def test_a_truncated_shard_is_named(tmp_path):
  write_sharded(tmp_path)
  data = (tmp_path / SHARD_2).read_bytes()
  (tmp_path / SHARD_2).write_bytes(data[:len(data) - 10])
  fails_with_one_line(tmp_path, str(tmp_path / SHARD_2), 'truncated')


@pytest.mark.parametrize('index', [True, False], ids=['index', 'no-index'])
def test_a_missing_shard_is_named(tmp_path, index):
  write_sharded(tmp_path, index=index)
  (tmp_path / SHARD_2).unlink()
  fails_with_one_line(tmp_path, str(tmp_path / SHARD_2), 'missing')


def test_an_index_naming_a_file_that_is_not_there_is_named(tmp_path):
  weight_map = write_sharded(tmp_path)
  weight_map['model.norm.weight'] = 'model-00004-of-00003.safetensors'
  (tmp_path / INDEX).write_text(json.dumps({'weight_map': weight_map}))
  fails_with_one_line(tmp_path, 'model-00004-of-00003.safetensors', INDEX,
                      'model.norm.weight')


def test_an_index_misplacing_a_tensor_is_named(tmp_path):
  weight_map = write_sharded(tmp_path)
  name = sorted(weight_map)[0]
  weight_map[name] = SHARD_2 if weight_map[name] != SHARD_2 else (
      'model-00001-of-00003.safetensors')
  (tmp_path / INDEX).write_text(json.dumps({'weight_map': weight_map}))
  fails_with_one_line(tmp_path, weight_map[name], name, INDEX)


def test_a_damaged_index_is_named(tmp_path):
  write_sharded(tmp_path)
  (tmp_path / INDEX).write_text('{"weight_map": ')
  fails_with_one_line(tmp_path, str(tmp_path / INDEX))
