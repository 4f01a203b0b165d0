"""Model configuration: presets, validation and the paper's parameter counts."""
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import linen as nn

from jaxformer.model import EncoderDecoder, ModelConfig, base, big
from jaxformer.model import from_config_dict


def num_params(config: ModelConfig) -> int:
  """Counted from shapes only: nothing is initialised."""
  tokens = jnp.ones((1, 4), jnp.int32)
  variables = jax.eval_shape(
      lambda: EncoderDecoder(config).init(jax.random.PRNGKey(0), tokens,
                                          tokens))
  return sum(int(np.prod(x.shape))
             for x in jax.tree.leaves(nn.unbox(variables['params'])))


def test_base_preset_is_table_3_base():
  config = from_config_dict(base())
  assert (config.d_model, config.num_heads, config.d_ff) == (512, 8, 2048)
  assert (config.num_encoder_layers, config.num_decoder_layers) == (6, 6)
  assert config.residual_dropout == 0.1
  assert config.vocab_size == 37000 and config.share_embeddings == 'all'


def test_big_preset_is_table_3_big():
  config = from_config_dict(big())
  assert (config.d_model, config.num_heads, config.d_ff) == (1024, 16, 4096)
  assert config.residual_dropout == 0.3


@pytest.mark.parametrize('preset, paper_count', [(base, 65e6), (big, 213e6)])
def test_parameter_count_matches_the_paper(preset, paper_count):
  count = num_params(from_config_dict(preset()))
  assert abs(count - paper_count) / paper_count < 0.05, count


def test_presets_are_editable_config_dicts():
  config = base()
  config.num_encoder_layers = 2
  config.dtype = 'bfloat16'
  model_config = from_config_dict(config)
  assert model_config.num_encoder_layers == 2
  assert model_config.compute_dtype == jnp.bfloat16


def test_unknown_key_is_named():
  config = base()
  config.num_layer = 4  # A typo of num_encoder_layers.
  with pytest.raises(ValueError, match='num_layer'):
    from_config_dict(config)


@pytest.mark.parametrize('key, value', [
    ('norm_position', 'middle'),
    ('activation', 'tanh'),
    ('share_embeddings', 'some'),
    ('attention_impl', 'flash'),
    ('remat_policy', 'everything'),
    ('norm_type', 'group'),
    ('position_embedding', 'alibi'),
    ('rope_scaling', 'yarn'),
])
def test_value_outside_the_choices_is_named(key, value):
  config = base()
  config[key] = value
  with pytest.raises(ValueError, match=f'model.{key}='):
    from_config_dict(config)


def test_d_model_not_divisible_by_heads_is_rejected():
  with pytest.raises(ValueError, match='num_heads'):
    from_config_dict(ml_collections.ConfigDict(
        {'d_model': 100, 'num_heads': 8}))


def test_shared_embeddings_need_one_vocabulary():
  with pytest.raises(ValueError, match='target_vocab_size'):
    ModelConfig(vocab_size=100, target_vocab_size=80, share_embeddings='all')
  config = ModelConfig(vocab_size=100, target_vocab_size=80,
                       share_embeddings='none')
  assert config.output_vocab_size == 80


# The keys of today's blocks, each 0 or off in the paper's model.
NEW_KEYS = ('num_kv_heads', 'head_dim', 'norm_type', 'rms_norm_epsilon',
            'norm_bias', 'rope_theta', 'rope_scaling', 'rope_scaling_factor',
            'rope_low_freq_factor', 'rope_high_freq_factor',
            'rope_original_max_len', 'logits_bias', 'qkv_bias')


def test_a_config_saved_before_the_new_keys_builds_the_same_model():
  saved = {k: v for k, v in base().to_dict().items() if k not in NEW_KEYS}
  config = from_config_dict(ml_collections.ConfigDict(saved))
  assert config == from_config_dict(base())
  assert (config.head_features, config.kv_heads) == (64, 8)


def test_llama3_scaling_needs_low_below_high_frequency_factor():
  with pytest.raises(ValueError, match='rope_low_freq_factor'):
    ModelConfig(position_embedding='rope', rope_scaling='llama3',
                rope_low_freq_factor=4.0, rope_high_freq_factor=4.0)


def test_rope_needs_an_even_head_width():
  with pytest.raises(ValueError, match='must be even'):
    ModelConfig(d_model=48, num_heads=2, head_dim=9,
                position_embedding='rope')
