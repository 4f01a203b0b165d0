"""Config files, command-line overrides and their errors."""
import pytest

from jaxformer import config as config_lib


def test_every_config_file_loads_and_validates():
  import glob
  paths = sorted(glob.glob('configs/*.py'))
  assert 'configs/quickstart.py' in paths
  for path in paths:
    config_lib.load_config(path)


def test_overrides_are_parsed_with_the_type_of_the_default():
  config = config_lib.load_config('configs/quickstart.py', [
      '--config.train.num_steps=7', 'train.learning_rate=1e-3',
      '--config.model.norm_position=pre', '--config.checkpoint.async_save=false',
      '--config.data.tfds.data_dir=/data'])
  assert config.train.num_steps == 7
  assert config.train.learning_rate == 1e-3
  assert config.model.norm_position == 'pre'
  assert config.checkpoint.async_save is False
  assert config.data.tfds.data_dir == '/data'


def test_an_unknown_key_names_the_closest_known_ones():
  with pytest.raises(config_lib.ConfigError, match="num_steps"):
    config_lib.load_config('configs/quickstart.py',
                           ['--config.train.num_step=5'])


def test_a_value_of_the_wrong_type_is_rejected():
  with pytest.raises(config_lib.ConfigError, match='train.num_steps'):
    config_lib.load_config('configs/quickstart.py',
                           ['--config.train.num_steps=many'])


def test_an_invalid_model_setting_names_the_key():
  with pytest.raises(ValueError, match='num_heads'):
    config_lib.load_config('configs/quickstart.py',
                           ['--config.model.num_heads=3'])


def test_a_missing_config_file_says_where_configs_live():
  with pytest.raises(config_lib.ConfigError, match='configs/'):
    config_lib.load_config('configs/nope.py')
