"""Checking a run config before any work starts: its keys against the
defaults, the values of a fixed set against `CHOICES`, the ranges
(`config/ranges.py`), the model config (which checks its own values) and
the keys that only work together."""
import difflib

import ml_collections

from jaxformer.config import ranges as config_ranges
from jaxformer.config.run_defaults import CHOICES, default_config
from jaxformer.data import mixture
from jaxformer.model import config as model_config
from jaxformer.storage.errors import ConfigError
from jaxformer.train.tasks import TASKS


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks keys against the defaults and builds the model config (which
  checks its own values), so mistakes surface before any work starts."""
  _check_keys(config, default_config(), 'config')
  model_config.from_config_dict(config.model)
  _check_lengths_fit_model(config)
  for dotted, allowed in CHOICES.items():
    value = config
    for name in dotted.split('.'):
      value = value[name]
    if value not in allowed:
      raise ConfigError(f'{dotted}={value!r} is not one of {allowed}.')
  problems = config_ranges.out_of_range(config)
  if problems:
    raise ConfigError(' '.join(problems))
  try:
    mixture.parse(config.data)
    config_ranges.step_span(config.train.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _validate_budget_and_average(config)
  _validate_comet(config)


def _check_lengths_fit_model(config: ml_collections.ConfigDict) -> None:
  """The task's data lengths must fit the model's position table."""
  if config.task not in TASKS:
    return  # Reported by `validate`'s choices.
  for key in TASKS[config.task].length_keys():
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


def _validate_comet(config: ml_collections.ConfigDict) -> None:
  """eval.comet scores the translations decoded for BLEU, and
  checkpoint.best_metric='comet' reads its score."""
  comet = config.eval.comet
  if config.checkpoint.best_metric == 'comet' and not comet:
    raise ConfigError(
        "checkpoint.best_metric='comet' needs eval.comet: set eval.comet to "
        'a COMET checkpoint folder, or choose another best metric.')
  if not comet:
    return
  task = TASKS.get(config.task)
  if task is not None and not task.translates:
    raise ConfigError(
        f'eval.comet={comet!r} scores translations, and task='
        f'{config.task!r} does not translate: unset eval.comet.')
  if not config.eval.bleu_examples:
    raise ConfigError(
        f'eval.comet={comet!r} scores the eval.bleu_examples sentences '
        'decoded during training, and eval.bleu_examples=0 decodes none: set '
        'eval.bleu_examples > 0, or unset eval.comet.')


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
