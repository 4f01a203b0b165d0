"""The run config's names in one place, for config files (`configs/*.py`)
and commands. Each job is its own module:

- `run_defaults.py`: every key's default, and the values a key of a fixed
  set may take (`CHOICES`), declared beside them;
- `presets.py`: the recipes config files start from;
- `loading.py`: config files, the config saved with a trained model;
- `overrides.py`: `--config.key=value` from the command line;
- `validation.py`: the checks a config passes before any work starts.
"""
from jaxformer.config.loading import load_config, trained_model_config
from jaxformer.config.overrides import with_overrides
from jaxformer.config.presets import encoder_finetune_config, small_task_config
from jaxformer.config.run_defaults import CHOICES, default_config
from jaxformer.config.validation import validate
from jaxformer.storage.errors import ConfigError

__all__ = ['CHOICES', 'ConfigError', 'default_config',
           'encoder_finetune_config', 'load_config', 'small_task_config',
           'trained_model_config', 'validate', 'with_overrides']
