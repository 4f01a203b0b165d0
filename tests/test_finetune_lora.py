"""LoRA fine-tuning through `jaxformer train` (model.lora on a language
model export): the loss falls, the export's weights come out bitwise as
they went in, the adapters moved; a SIGKILLed LoRA run resumes bitwise."""
import jax
import numpy as np
import pytest
from flax import traverse_util

from jaxformer.checkpoints import trained
from jaxformer.config.settings import load_config
from jaxformer.model import lora
from jaxformer.run.metrics import read_metrics
from jaxformer.run.trainer import Trainer
from test_fault_tolerance import kill_resume_and_compare
from test_finetune_lm import CONFIG, _overrides, setup  # noqa: F401
from trained_runs import process_output, train_process

LORA = ['model.lora.targets=q,v,o,ffn_in', 'model.lora.rank=4',
        'model.lora.alpha=8']


def _flat(params):
  return traverse_util.flatten_dict(jax.tree.map(np.asarray, params))


@pytest.mark.slow
def test_a_lora_finetune_trains_the_adapters_alone(setup, tmp_path):
  root, exports = setup
  config = load_config(f'{CONFIG}:tsv',
                       _overrides(root, exports['own'], 'tsv', 8) + LORA)
  Trainer(config, str(tmp_path)).run()
  losses = [r['loss'] for r in read_metrics(str(tmp_path)) if 'loss' in r]
  assert losses[-1] < losses[0], losses
  start, tuned = _flat(trained.load(exports['own']).params), _flat(
      trained.load(str(tmp_path)).params)
  adapters = {path for path in tuned if lora.is_adapter(path)}
  assert adapters and set(tuned) - adapters == set(start)
  for path in start:
    assert tuned[path].tobytes() == start[path].tobytes(), path
  assert all(np.abs(tuned[p]).max() > 0 for p in adapters
             if p[-1] == 'lora_b')


@pytest.mark.slow
def test_a_killed_lora_finetune_resumes_bitwise(setup, tmp_path,
                                                process_environment):
  root, exports = setup
  steps = 12
  overrides = _overrides(root, exports['hf'], 'tsv', steps) + LORA
  flags = [f'--config.{o}' for o in overrides]
  kill_resume_and_compare(
      lambda workdir: train_process(workdir, f'{CONFIG}:tsv', flags,
                                    process_environment),
      process_output, tmp_path, steps)
