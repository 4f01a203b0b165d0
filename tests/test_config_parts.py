"""The config layer's pieces: defaults with their allowed values beside
them, presets, loading, overrides and validation (`jaxformer/config/`)."""
import ast
import pathlib

import pytest

from jaxformer.config import run_defaults, settings, validation
from jaxformer.inference import search

CONFIG = pathlib.Path(__file__).resolve().parents[1] / 'jaxformer' / 'config'


def value_at(config, dotted: str):
  for name in dotted.split('.'):
    config = config[name]
  return config


def test_every_default_is_one_of_its_allowed_values():
  config = run_defaults.default_config()
  assert set(run_defaults.CHOICES) >= {
      'task', 'train.schedule', 'eval.split', 'checkpoint.best_mode',
      'data.source', 'data.tokenizer.type'}
  for dotted, allowed in run_defaults.CHOICES.items():
    assert value_at(config, dotted) in allowed, dotted
  validation.validate(config)


@pytest.mark.parametrize('dotted', sorted(run_defaults.CHOICES))
def test_a_value_outside_a_keys_choices_is_refused(dotted):
  config = run_defaults.default_config()
  *parents, leaf = dotted.split('.')
  node = value_at(config, '.'.join(parents)) if parents else config
  node[leaf] = 'not-a-choice'
  with pytest.raises(settings.ConfigError,
                     match=f"{dotted}='not-a-choice' is not one of"):
    validation.validate(config)


def test_the_decode_defaults_are_the_searchs():
  decode = run_defaults.default_config().decode
  assert (decode.beam_size, decode.alpha, decode.max_extra_len) == (
      search.BEAM_SIZE, search.ALPHA, search.MAX_EXTRA_LEN)


def test_the_config_layer_imports_nothing_above_training():
  above = ('jaxformer.inference', 'jaxformer.run', 'jaxformer.aot',
           'jaxformer.interop', 'jaxformer.cli')
  for path in CONFIG.glob('*.py'):
    if path.name == 'resume.py':  # Reads the checkpoints' saved config.
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith(above), (path.name, node.module)


def test_presets_start_from_the_defaults():
  config = settings.small_task_config('classification', 'number_parity',
                                      'accuracy', 'max', runlocal=True)
  assert config.train.num_steps == 30 and config.task == 'classification'
  validation.validate(config)
  assert settings.encoder_finetune_config(
      'regression', 'pearson').data.source == 'tsv'
