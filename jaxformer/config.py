"""Run configuration: Python files returning an `ml_collections.ConfigDict`,
with `--config.key=value` overrides from the command line.

A config file defines `get_config()` (optionally `get_config(arg)`, called
with the text after a colon: `configs/quickstart.py:runlocal`). Every file
starts from `default_config()`, so each key has one documented default.
"""
import ast
import difflib
import importlib.util
import os
import traceback
from collections.abc import Sequence

import ml_collections

from jaxformer import config_ranges
from jaxformer import decode
from jaxformer import parallel
from jaxformer.data.config import default_data_config
from jaxformer.model import config as model_config


class ConfigError(ValueError):
  """A config file or override that cannot be used as given."""


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = 'translation'  # translation | classification | regression | language_model
  c.seed = 0
  c.model = model_config.to_config_dict(model_config.ModelConfig())
  c.data = default_data_config()
  c.train = ml_collections.ConfigDict(dict(
      num_steps=100_000,
      schedule='rsqrt',  # rsqrt (the paper) | warmup_rsqrt | warmup_cosine
      learning_rate=1.0,  # rsqrt: the factor; others: the peak
      warmup_steps=4000,
      b1=0.9, b2=0.98, eps=1e-9,
      weight_decay=0.0,  # > 0: AdamW
      grad_clip_norm=0.0,  # 0: no clipping
      label_smoothing=0.1,
      grad_accum_steps=1,
      prng_impl='threefry2x32',  # threefry2x32 | rbg | unsafe_rbg
      nan_policy='stop',  # stop | skip (non-finite steps are not applied)
      log_every=100,
      peak_flops=0.0,  # FLOP/s of one device for MFU; 0: measure at start
      max_minutes=0.0,  # wall-clock budget (from the start); 0: none
      # With max_minutes and warmup_cosine: at the end of warm-up, fix
      # num_steps to what the budget allows (saved in the workdir).
      schedule_over_budget=False,
  ))
  c.mesh = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, tensor=1,
      axis_rules=[list(rule) for rule in parallel.DEFAULT_AXIS_RULES],
  ))
  c.eval = ml_collections.ConfigDict(dict(
      every=1000,  # steps; 0: only at the end
      split='dev',
      num_batches=0,  # 0: the whole split
      bleu_examples=256,  # dev sentences decoded for BLEU during training
      final_split='test',  # decoded with beam search after training; '' skips
      show_examples=5,  # example translations printed after training
      # > 1: the final evaluation uses the mean of the last N checkpoints.
      average_last=0,
  ))
  c.decode = ml_collections.ConfigDict(dict(
      beam_size=decode.BEAM_SIZE, alpha=decode.ALPHA,
      max_extra_len=decode.MAX_EXTRA_LEN, batch_size=64))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=1000, keep=3, best_metric='bleu', best_mode='max',
      async_save=True))
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address='', num_processes=0, process_id=-1,
      initialization_timeout=300, heartbeat_timeout=60,
      # Longer than process 0's work after training (the final report), or
      # the others fail at the exit barrier.
      shutdown_timeout=300))
  return c


def small_task_config(task: str, dataset: str, best_metric: str,
                      best_mode: str, runlocal: bool
                      ) -> ml_collections.ConfigDict:
  """The shared base of the quick classification, regression and language
  model configs: a 2-layer d_model 64 model on a built-in dataset, trained on
  CPU in minutes (`runlocal`: seconds, for tests). The caller picks the
  layers' side (encoder or decoder) and the lengths."""
  config = default_config()
  config.task = task
  config.model.update(
      d_model=64, num_heads=4, d_ff=256, max_len=64, embedding_dropout=0.0,
      residual_dropout=0.0)
  config.data.builtin.update(dataset=dataset, num_train=20_000, num_dev=500,
                             num_test=500)
  config.data.tokenizer.vocab_size = 256
  config.train.update(num_steps=1500, schedule='warmup_cosine',
                      learning_rate=2e-3, warmup_steps=100,
                      grad_clip_norm=1.0, label_smoothing=0.0, log_every=50)
  config.eval.update(every=500, bleu_examples=0, final_split='')
  config.checkpoint.update(every=500, keep=2, best_metric=best_metric,
                           best_mode=best_mode)
  if runlocal:
    config.model.update(d_model=32, num_heads=2, d_ff=64)
    config.data.builtin.update(num_train=1000, num_dev=64, num_test=64)
    config.data.tokenizer.vocab_size = 200
    config.train.update(num_steps=30, warmup_steps=5, log_every=10,
                        learning_rate=3e-3)
    config.eval.update(every=0)
    config.checkpoint.update(every=30, async_save=False)
  return config


def load_config(path_and_arg: str,
                overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path[:arg]` and applies `key=value` overrides."""
  path, _, arg = path_and_arg.partition(':')
  if not os.path.isfile(path):
    raise ConfigError(f'Config file {path!r} does not exist; configs live in '
                      'configs/, e.g. configs/quickstart.py.')
  module = _import_config_file(path)
  if not hasattr(module, 'get_config'):
    raise ConfigError(f'Config file {path} defines no get_config().')
  try:
    config = module.get_config(arg) if arg else module.get_config()
  except Exception as e:
    raise _error_in_file(path, e) from None
  for override in overrides:
    apply_override(config, override)
  validate(config)
  return config


def _import_config_file(path: str):
  """The config file as a module; a syntax error names its file and line."""
  spec = importlib.util.spec_from_file_location('jaxformer_user_config', path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except SyntaxError as e:
    where = f'{e.filename or path}:{e.lineno}' + (
        f':{e.offset}' if e.offset else '')
    code = f'\n  {e.text.rstrip()}' if e.text else ''
    raise ConfigError(f'{where}: syntax error in the config file: '
                      f'{e.msg}.{code}') from None
  except Exception as e:
    raise _error_in_file(path, e) from None
  return module


def _error_in_file(path: str, error: Exception) -> ConfigError:
  """`error`, raised while running the config file, at its line there."""
  lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__)
           if os.path.abspath(frame.filename) == os.path.abspath(path)]
  where = f'{path}:{lines[-1]}' if lines else path
  return ConfigError(f'{where}: the config file raised '
                     f'{type(error).__name__}: {error}')


def _parse_value(text: str, current):
  if isinstance(current, bool):
    if text.lower() in ('true', '1', 'yes'):
      return True
    if text.lower() in ('false', '0', 'no'):
      return False
    raise ConfigError(f'Expected true/false, got {text!r}.')
  if isinstance(current, str):
    return text
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    if current is None:
      return text
    raise ConfigError(f'Cannot parse {text!r} as {type(current).__name__}.')
  if isinstance(current, float) and isinstance(value, int):
    value = float(value)
  if current is not None and not isinstance(value, type(current)) and not (
      isinstance(current, (list, tuple)) and isinstance(value, (list, tuple))):
    raise ConfigError(f'Expected {type(current).__name__}, got {text!r}.')
  return value


def apply_override(config: ml_collections.ConfigDict, override: str) -> None:
  """Sets `a.b.c=value` (the leading `--config.` is optional). An unknown
  key is an error that names the closest known keys."""
  override = override.removeprefix('--').removeprefix('config.')
  if '=' not in override:
    raise ConfigError(f'Override {override!r} is not of the form key=value.')
  dotted, text = override.split('=', 1)
  *parents, leaf = dotted.split('.')
  node = config
  for depth, name in enumerate(parents + [leaf]):
    if name not in node:
      prefix = '.'.join(parents[:depth])
      known = sorted(node.keys())
      close = difflib.get_close_matches(name, known, n=3)
      hint = f' Did you mean {close}?' if close else f' Known keys: {known}.'
      raise ConfigError(
          f'Unknown config key {dotted!r}: {prefix or "config"} has no '
          f'{name!r}.{hint}')
    if depth < len(parents):
      node = node[name]
  try:
    node[leaf] = _parse_value(text, node[leaf])
  except ConfigError as e:
    raise ConfigError(f'--config.{dotted}: {e}') from None


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks keys against the defaults and builds the model config (which
  checks its own values), so mistakes surface before any work starts."""
  _check_keys(config, default_config(), 'config')
  model_config.from_config_dict(config.model)
  _check_lengths_fit_model(config)
  choices = {'train.schedule': ('rsqrt', 'warmup_rsqrt', 'warmup_cosine'),
             'train.nan_policy': ('stop', 'skip'),
             'train.prng_impl': ('threefry2x32', 'rbg', 'unsafe_rbg'),
             'task': ('translation', 'classification', 'regression',
                      'language_model'),
             'checkpoint.best_mode': ('min', 'max'),
             'eval.split': ('train', 'dev', 'test'),
             'eval.final_split': ('', 'train', 'dev', 'test'),
             'data.source': ('builtin', 'tsv', 'files', 'tfds', 'text'),
             'data.batching': ('pack', 'bucket'),
             'data.tokenizer.type': ('bpe', 'unigram', 'char', 'word'),
             'data.builtin.dataset': ('translation', 'number_parity',
                                      'number_value', 'sentences')}
  for dotted, allowed in choices.items():
    value = config
    for name in dotted.split('.'):
      value = value[name]
    if value not in allowed:
      raise ConfigError(f'{dotted}={value!r} is not one of {allowed}.')
  problems = config_ranges.out_of_range(config)
  if problems:
    raise ConfigError(' '.join(problems))
  _validate_budget_and_average(config)


_LENGTH_KEYS = {'translation': ('max_source_length', 'max_target_length'),
                'language_model': ('max_target_length',),
                'classification': ('max_source_length',),
                'regression': ('max_source_length',)}


def _check_lengths_fit_model(config: ml_collections.ConfigDict) -> None:
  """The task's data lengths must fit the model's position table."""
  for key in _LENGTH_KEYS.get(config.task, ()):
    if config.data[key] > config.model.max_len:
      raise ConfigError(
          f'data.{key}={config.data[key]} is above model.max_len='
          f'{config.model.max_len}: positions past max_len have no '
          f'embedding. Lower data.{key} or raise model.max_len.')


def _validate_budget_and_average(config: ml_collections.ConfigDict) -> None:
  train = config.train
  if train.schedule_over_budget and not train.max_minutes:
    raise ConfigError('train.schedule_over_budget=True needs a budget: set '
                      'train.max_minutes > 0.')
  if train.schedule_over_budget and train.schedule != 'warmup_cosine':
    raise ConfigError('train.schedule_over_budget=True needs '
                      "train.schedule='warmup_cosine' (the others do not "
                      f'depend on the step count), not {train.schedule!r}.')
  if train.schedule_over_budget and (
      train.warmup_steps < 2 * train.log_every):
    raise ConfigError(
        'train.schedule_over_budget=True measures the step time during '
        f'warm-up: train.warmup_steps={train.warmup_steps} must be at least '
        f'2 * train.log_every={2 * train.log_every}; lower train.log_every.')
  average = config.eval.average_last
  if average > 1 and config.checkpoint.keep < average:
    raise ConfigError(
        f'eval.average_last={average} needs that many checkpoints kept: set '
        f'checkpoint.keep >= {average} (it is {config.checkpoint.keep}).')
  if average > 1 and not config.checkpoint.every:
    raise ConfigError(f'eval.average_last={average} needs checkpoints during '
                      'training: set checkpoint.every > 0.')


def _check_keys(config, reference, where: str) -> None:
  for key in config.keys():
    if key not in reference:
      close = difflib.get_close_matches(key, list(reference.keys()), n=3)
      raise ConfigError(f'Unknown config key {where}.{key}'
                        + (f'; did you mean {close}?' if close else '.'))
    if isinstance(reference[key], ml_collections.ConfigDict) and key not in (
        'model',):
      if isinstance(config[key], ml_collections.ConfigDict):
        _check_keys(config[key], reference[key], f'{where}.{key}')
