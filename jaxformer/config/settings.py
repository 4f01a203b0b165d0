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
from absl import flags
from ml_collections import config_flags

from jaxformer.config import ranges as config_ranges
from jaxformer.config.path_keys import resolve_paths, without_paths
from jaxformer.inference import search
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.data import mixture
from jaxformer.data.defaults import default_data_config
from jaxformer.model import config as model_config
from jaxformer.train.tasks import TASKS


class ConfigError(ValueError):
  """A config file or override that cannot be used as given."""


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = 'translation'  # translation | classification | regression | language_model
  c.seed = 0
  c.model = model_config.to_config_dict(model_config.ModelConfig())
  c.data = default_data_config()
  # A jaxformer export (`jaxformer import`, `export`, `average`) to start
  # from: its parameters, model and tokenizers (fine-tuning); '': a fresh
  # model. A resumed run continues from its own checkpoint.
  c.init = ml_collections.ConfigDict(dict(pretrained=''))
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
      peak_flops=0.0,  # a device's FLOP/s for MFU; 0: its chip's, or measured
      max_minutes=0.0,  # wall-clock budget (from the start); 0: none
      # With max_minutes and warmup_cosine: at the end of warm-up, fix
      # num_steps to what the budget allows, re-planned as the speed changes
      # (recorded in the workdir; docs/data.md).
      schedule_over_budget=False,
      # 'A:B': a jax.profiler trace of steps A-B in <workdir>/profile/
      # (process 0's, or every process's with profile_all_hosts); '': none.
      profile_steps='', profile_all_hosts=False,
  ))
  c.mesh = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, tensor=1,  # within one slice
      dcn_data=1,  # slices the data axis spans (docs/pods.md)
      axis_rules=[list(rule) for rule in mesh_lib.DEFAULT_AXIS_RULES],
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
      beam_size=search.BEAM_SIZE, alpha=search.ALPHA,
      max_extra_len=search.MAX_EXTRA_LEN, batch_size=64))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every=1000, keep=3, best_metric='bleu', best_mode='max',
      async_save=True))
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address='', num_processes=0, process_id=-1,
      # Where process 0's coordinator listens (host:port); '' takes
      # JAX_COORDINATOR_BIND_ADDRESS, else the interface the coordinator
      # address names (parallel/cluster.py `listen_address`).
      coordinator_bind_address='',
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


def encoder_finetune_config(task: str, best_metric: str
                            ) -> ml_collections.ConfigDict:
  """The shared base of configs/finetune_classify.py and finetune_regress.py:
  a pretrained encoder (init.pretrained) fine-tuned on 'tsv' files as BERT
  is: dropout 0.1, AdamW at a small peak learning rate after a short
  warm-up, cosine decay; the best checkpoint by the dev `best_metric`."""
  config = default_config()
  config.task = task
  config.init.pretrained = ''  # Required: --config.init.pretrained=EXPORT.
  config.model.update(embedding_dropout=0.1, residual_dropout=0.1,
                      attention_dropout=0.1, ffn_dropout=0.0)
  config.data.source = 'tsv'
  config.data.tsv.update(train='data/train.tsv', dev='data/dev.tsv', test='')
  config.data.update(max_source_length=128, batch_size=32)
  config.train.update(num_steps=2000, schedule='warmup_cosine',
                      learning_rate=2e-5, warmup_steps=200, grad_clip_norm=1.0,
                      label_smoothing=0.0, weight_decay=0.01, log_every=50)
  config.eval.update(every=200, bleu_examples=0, final_split='')
  config.checkpoint.update(every=200, keep=2, best_metric=best_metric,
                           best_mode='max')
  return config


def load_config(path_and_arg: str,
                overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """Loads `path[:arg]` and applies `key=value` overrides; the paths it
  names (path_keys.PATH_KEYS) are made absolute."""
  path, _, arg = path_and_arg.partition(':')
  path = os.path.expanduser(path)
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
  config = resolve_paths(with_overrides(config, overrides))
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


def _literal(text: str):
  """A Python literal, or else the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


class _ListParser(flags.ArgumentParser):
  """Lists (`mesh.axis_rules`, `data.labels`) given as Python literals."""

  def parse(self, argument):
    value = _literal(argument) if isinstance(argument, str) else argument
    if not isinstance(value, (list, tuple)):
      raise ValueError(f'expected a list such as [1, 2], got {argument!r}')
    return list(value)


class _UnsetParser(flags.ArgumentParser):
  """Keys whose default is None (`data.tfds.data_dir`): a literal or text."""

  def parse(self, argument):
    return _literal(argument) if isinstance(argument, str) else argument


# ml_collections parses scalars and tuples by the default's type; these two
# kinds of default it does not know.
config_flags.register_flag_parser_for_type(list, _ListParser())
config_flags.register_flag_parser_for_type(type(None), _UnsetParser())


def _check_key(config: ml_collections.ConfigDict, dotted: str) -> None:
  """Raises for a key `config` does not have, naming the closest known."""
  *parents, leaf = dotted.split('.')
  node = config
  for depth, name in enumerate(parents + [leaf]):
    if not isinstance(node, ml_collections.ConfigDict) or name not in node:
      prefix = '.'.join(parents[:depth])
      known = sorted(node.keys()) if hasattr(node, 'keys') else []
      close = difflib.get_close_matches(name, known, n=3)
      hint = f' Did you mean {close}?' if close else f' Known keys: {known}.'
      raise ConfigError(
          f'Unknown config key {dotted!r}: {prefix or "config"} has no '
          f'{name!r}.{hint}')
    node = node[name]


def _as_flag(override: str) -> str:
  """`--config.a.b=v`, from that or `config.a.b=v` or `a.b=v`."""
  override = override.removeprefix('--').removeprefix('config.')
  if '=' not in override:
    raise ConfigError(f'Override {override!r} is not of the form key=value.')
  return f'--config.{override}'


def with_overrides(config: ml_collections.ConfigDict,
                   overrides: Sequence[str]) -> ml_collections.ConfigDict:
  """A copy of `config` with `--config.a.b=value` overrides applied (the
  `--config.` is optional), each parsed by the type of its current value.

  The parsing is ml_collections' `config_flags` (Flax's and big_vision's
  convention), on flag values of our own: `DEFINE_config_dict` rather
  than `DEFINE_config_file`, because the file is loaded here (so that an
  error in it names its file and line) and absl must not parse the whole
  command line (argparse serves the subcommands). An unknown key is an
  error that names the closest known keys."""
  flags_argv = [_as_flag(o) for o in overrides]
  for flag in flags_argv:
    _check_key(config, flag[len('--config.'):].split('=', 1)[0])
  values = flags.FlagValues()
  argv = ['jaxformer'] + flags_argv
  try:
    config_flags.DEFINE_config_dict(
        'config', ml_collections.ConfigDict(config.to_dict()),
        flag_values=values, lock_config=False, sys_argv=argv)
    values(argv)
  except (flags.Error, TypeError, ValueError) as e:
    raise ConfigError(_flag_error(e)) from None
  return values['config'].value


def _flag_error(error: Exception) -> str:
  """absl's 'flag --config.a.b=v: reason' as '--config.a.b: reason'."""
  text = str(error).splitlines()[0]
  if text.startswith('flag --config.') and ': ' in text:
    flag, reason = text.removeprefix('flag ').split(': ', 1)
    return f'{flag.split("=", 1)[0]}: {reason}'
  return text


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks keys against the defaults and builds the model config (which
  checks its own values), so mistakes surface before any work starts."""
  _check_keys(config, default_config(), 'config')
  model_config.from_config_dict(config.model)
  _check_lengths_fit_model(config)
  choices = {'train.schedule': ('rsqrt', 'warmup_rsqrt', 'warmup_cosine'),
             'train.nan_policy': ('stop', 'skip'),
             'train.prng_impl': ('threefry2x32', 'rbg', 'unsafe_rbg'),
             'task': tuple(TASKS),
             'checkpoint.best_mode': ('min', 'max'),
             'eval.split': ('train', 'dev', 'test'),
             'eval.final_split': ('', 'train', 'dev', 'test'),
             'data.source': ('builtin', 'tsv', 'files', 'tfds', 'text',
                             'jsonl', 'parquet'),
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
  try:
    mixture.parse(config.data)
    config_ranges.step_span(config.train.profile_steps)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  _validate_budget_and_average(config)


def trained_model_config(saved: ml_collections.ConfigDict
                         ) -> ml_collections.ConfigDict:
  """The config a command uses for a trained model, from the one saved with
  it (which may come from anyone: a downloaded export): checked like a
  config file, the defaults standing in for keys it predates, and with no
  file path of its own (`path_keys.without_paths`), so that the data a
  command reads and where it writes come from the command's user."""
  config = default_config()
  _merge_saved(config, saved, 'the saved config')
  validate(config)
  return without_paths(config)


def _merge_saved(config: ml_collections.ConfigDict, saved, where: str):
  for key, value in saved.items():
    if key not in config:
      raise ConfigError(f'Unknown key {where}.{key}: not a model jaxformer '
                        'saved, or saved by a newer jaxformer.')
    if isinstance(config[key], ml_collections.ConfigDict) and key != 'model':
      if not isinstance(value, (dict, ml_collections.ConfigDict)):
        raise ConfigError(f'{where}.{key} is {value!r}, not a group of keys.')
      _merge_saved(config[key], value, f'{where}.{key}')
    else:
      config[key] = value


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
