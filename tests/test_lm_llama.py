"""configs/lm_llama.py: every preset builds, the Llama shapes have Meta's
parameter counts, and the tiny one trains on CPU. (The 1b and 8b compiles
for v5p slices take many minutes of CPU; their figures are in the config's
docstring and docs/pods.md.)"""
import pytest

from jaxformer.config import settings
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import run_spec
from jaxformer.train.state import count_params

CONFIG = 'configs/lm_llama.py'
# Hugging Face's num_parameters() of meta-llama/Llama-3.2-1B and
# Llama-3.1-8B (tied and untied head).
PARAMS = {'tiny': 90_432, '125m': 128_404_224, '1b': 1_235_814_400,
          '8b': 8_030_261_248}


@pytest.mark.parametrize('preset', sorted(PARAMS))
def test_every_preset_builds_with_its_parameter_count(preset):
  config = settings.load_config(f'{CONFIG}:{preset}')
  assert config.model.norm_type == 'rms' and config.model.activation == 'swiglu'
  assert config.model.position_embedding == 'rope'
  assert config.model.num_kv_heads < config.model.num_heads
  config = run_spec.with_expected_vocabulary(config)
  mesh = mesh_lib.make_mesh({'data': 1, 'fsdp': -1, 'tensor': 1})
  spec = run_spec.RunSpec.build(config, mesh)
  assert count_params(spec.abstract_params()) == PARAMS[preset]


def test_the_accelerator_presets_shard_scan_and_rematerialise():
  for preset in ('125m', '1b', '8b'):
    config = settings.load_config(f'{CONFIG}:{preset}')
    assert (config.mesh.data, config.mesh.fsdp) == (1, -1)
    assert config.model.scan_layers and config.model.remat_policy == 'dots'
    assert config.model.dtype == 'bfloat16'
    assert config.data.source == 'text' and config.data.lm_rows == 'packed'
    assert (config.model.rope_scaling == 'llama3') == (preset != '125m')
  assert settings.load_config(f'{CONFIG}:1b').model.share_embeddings == 'all'
  assert settings.load_config(f'{CONFIG}:8b').model.share_embeddings == 'none'


def test_an_unknown_preset_names_the_presets():
  with pytest.raises(settings.ConfigError,
                     match=r'lm_llama.py:2b is not a preset; choose one of '
                     r'tiny, 125m, 1b, 8b'):
    settings.load_config(f'{CONFIG}:2b')


@pytest.mark.slow  # 30 steps and the tokenizer: ~20 s of CPU.
def test_tiny_trains_on_cpu(tmp_path):
  from jaxformer.run.trainer import Trainer
  config = settings.load_config(f'{CONFIG}:tiny')
  trainer = Trainer(config, str(tmp_path / 'workdir'))
  metrics = trainer.run()
  assert int(trainer.state.step) == config.train.num_steps
  # From ln(256) = 5.5 nats a token at the start.
  assert metrics['loss'] < 5.0, metrics
