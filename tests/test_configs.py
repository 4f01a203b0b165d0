"""Config files, command-line overrides and their errors."""
import pytest

from jaxformer.config import settings as config_lib


def test_every_config_file_loads_and_validates():
  import glob
  paths = sorted(glob.glob('configs/*.py'))
  assert 'configs/quickstart.py' in paths
  for path in paths:
    config_lib.load_config(path)


@pytest.mark.slow
def test_loading_every_config_imports_no_tensorflow():
  # A fresh interpreter: the test process itself has TensorFlow loaded.
  import subprocess
  import sys
  script = (
      'import glob, sys\n'
      'from jaxformer.config import settings\n'
      'from jaxformer.data import tokenizer\n'
      'for path in sorted(glob.glob("configs/*.py")):\n'
      '  settings.load_config(path)\n'
      'loaded = sorted(m for m in sys.modules if m.split(".")[0] in '
      '("tensorflow", "tensorflow_datasets"))\n'
      'assert not loaded, loaded\n')
  subprocess.run([sys.executable, '-c', script], check=True)


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


def test_the_cpu_recipe_s_swiglu_has_the_parameters_of_its_relu_ffn():
  # benchmarks/cpu_recipe.md compared them at equal parameters.
  import jax
  import jax.numpy as jnp
  from flax import linen as nn
  from jaxformer.model import EncoderDecoder, from_config_dict
  gated = from_config_dict(
      config_lib.load_config('configs/tsv_example.py:cpu').model)
  assert (gated.activation, gated.norm_type, gated.position_embedding) == (
      'swiglu', 'layer', 'sinusoidal')
  relu = gated.replace(activation='relu', d_ff=gated.d_ff * 3 // 2)

  def count(model_config):
    tokens = jnp.ones((1, 4), jnp.int32)
    variables = jax.eval_shape(lambda: EncoderDecoder(model_config).init(
        jax.random.PRNGKey(0), tokens, tokens))
    return sum(x.size for x in jax.tree.leaves(nn.unbox(variables['params'])))

  assert relu.d_ff == 768
  assert abs(count(gated) - count(relu)) < 0.001 * count(relu)


def test_a_missing_config_file_says_where_configs_live():
  with pytest.raises(config_lib.ConfigError, match='configs/'):
    config_lib.load_config('configs/nope.py')


def numeric_keys(config, prefix=''):
  for key, value in config.items():
    if hasattr(value, 'items'):
      yield from numeric_keys(value, f'{prefix}{key}.')
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      yield f'{prefix}{key}'


def test_every_numeric_key_has_a_range():
  from jaxformer.config import ranges as config_ranges
  missing = [k for k in numeric_keys(config_lib.default_config())
             if k not in config_ranges.RANGES]
  assert not missing, f'add these keys to config_ranges.RANGES: {missing}'


@pytest.mark.parametrize('override, message', [
    ('train.num_steps=-5', 'train.num_steps=-5 is out of range; it must be >= 1'),
    ('data.batch_size=0', 'data.batch_size=0 is out of range; it must be >= 1'),
    ('train.log_every=0', 'train.log_every=0 is out of range'),
    ('model.residual_dropout=1.0', 'must be in [0, 1)'),
    ('train.label_smoothing=-0.1', 'train.label_smoothing=-0.1'),
    ('train.learning_rate=0', 'train.learning_rate=0.0 is out of range; it '
     'must be > 0'),
    ('decode.alpha=-1', 'decode.alpha=-1.0'),
    ('decode.beam_size=0', 'decode.beam_size=0'),
    ('train.warmup_steps=0', 'train.warmup_steps=0'),
    ('data.tokenizer.vocab_size=2', 'it must be >= 5'),
    ('mesh.fsdp=0', 'mesh.fsdp=0 is out of range; it must be -1 or >= 1'),
    ('checkpoint.keep=0', 'checkpoint.keep=0'),
    ('checkpoint.best_mode=biggest', "checkpoint.best_mode='biggest' is not "
     'one of'),
    ('eval.split=valid', "eval.split='valid' is not one of"),
])
def test_an_out_of_range_value_names_the_key_and_the_range(override, message):
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.load_config('configs/quickstart.py', [override])
  assert message in str(error.value)


def test_mesh_sizes_may_be_minus_one_and_rates_their_bounds():
  config_lib.load_config('configs/quickstart.py', [
      'mesh.data=-1', 'mesh.fsdp=2', 'model.residual_dropout=0',
      'train.label_smoothing=0', 'data.tokenizer.character_coverage=1'])


def test_a_syntax_error_in_a_config_file_names_the_file_and_line(tmp_path):
  path = tmp_path / 'broken.py'
  path.write_text('def get_config():\n  return dict(a=1,\n\nx = (\n')
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.load_config(str(path))
  assert str(error.value).startswith(f'{path}:')
  assert 'syntax error in the config file' in str(error.value)


def test_an_exception_in_a_config_file_names_the_file_and_line(tmp_path):
  path = tmp_path / 'raises.py'
  path.write_text('from jaxformer.config.settings import default_config\n\n'
                  'def get_config():\n  config = default_config()\n'
                  '  config.train.num_steps = steps\n  return config\n')
  with pytest.raises(config_lib.ConfigError) as error:
    config_lib.load_config(str(path))
  assert str(error.value).startswith(f'{path}:5: the config file raised')


def shrink(config, tmp_path):
  """A runlocal-style override: the config's own settings with a tiny model,
  tiny batches and one step, so a config can be exercised in seconds."""
  config.model.update(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                      num_decoder_layers=1)
  config.data.tokenizer.update(vocab_size=64, sample_size=200)
  config.data.builtin.update(num_train=300, num_dev=8, num_test=8)
  config.data.update(max_source_length=32, max_target_length=32,
                     batch_size=8, tokens_per_batch=256)
  config.train.update(num_steps=1, warmup_steps=1, peak_flops=1e9)
  config.eval.update(every=0, num_batches=1, bleu_examples=0)
  config.checkpoint.update(every=0)
  if config.data.source == 'tsv':
    labels = [f'{i / 60}' if config.task == 'regression' else f'ziel {i} wörter'
              for i in range(60)]
    lines = '\n'.join(f'source {i} words\t{label}'
                      for i, label in enumerate(labels))
    for split in ('train', 'dev', 'test'):
      path = tmp_path / f'{split}.tsv'
      path.write_text(lines + '\n', encoding='utf-8')
      config.data.tsv[split] = str(path)
  return config


def tfds_splits_as_tsv(config, tmp_path):
  """Reads the config's tfds dataset (mocked: no downloads here) through the
  package's tfds source and continues from TSV copies, since the mock also
  redirects file writes such as checkpoints."""
  import tensorflow_datasets as tfds
  from jaxformer.data import sources
  with tfds.testing.mock_data(num_examples=64):
    for split in ('train', 'dev', 'test'):
      pairs = sources.read_split(config.data, split)
      assert len(pairs) == 64
      path = tmp_path / f'{split}.tsv'
      path.write_text(''.join(f'{s}\t{t}\n' for s, t in pairs),
                      encoding='utf-8')
      config.data.tsv[split] = str(path)
  config.data.source = 'tsv'


# configs/finetune_lora.py fine-tunes an imported model on chat data
# rendered with the import's chat template: it cannot start without one, so
# shrinking it here is no test of it (test_finetune_lora.py trains LoRA).
NEEDS_AN_IMPORT = ('configs/finetune_lora.py',)


@pytest.mark.slow
@pytest.mark.parametrize('path', sorted(
    set(__import__('glob').glob('configs/*.py')) - set(NEEDS_AN_IMPORT)))
@pytest.mark.usefixtures('tfds_scratch_in_tmp_path')
def test_every_config_trains_one_step_when_shrunk(path, tmp_path):
  from jaxformer.run.trainer import Trainer
  config = shrink(config_lib.load_config(path), tmp_path)
  if config.data.source == 'tfds':
    tfds_splits_as_tsv(config, tmp_path)
  trainer = Trainer(config, str(tmp_path / 'workdir'))
  metrics = trainer.run()
  assert int(trainer.state.step) == 1
  assert metrics['loss'] > 0 and metrics['eval_loss'] > 0
