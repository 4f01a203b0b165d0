"""The FLOPs formula counts the matmul parameters the model has."""
import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn

from jaxformer.model import EncoderDecoder, ModelConfig
from jaxformer.train import flops

PAPER = ModelConfig(vocab_size=50, d_model=32, num_heads=4, d_ff=48,
                    num_encoder_layers=1, num_decoder_layers=1)
MODERN = PAPER.replace(num_kv_heads=1, head_dim=12, activation='swiglu',
                       position_embedding='rope', norm_type='rms',
                       norm_position='pre')


def kernel_sizes(tree) -> int:
  return sum(int(x.size) for path, x in
             jax.tree_util.tree_flatten_with_path(tree)[0]
             if 'kernel' in jax.tree_util.keystr(path))


@pytest.mark.parametrize('config', [PAPER, MODERN], ids=['paper', 'modern'])
def test_layer_matmul_parameters_are_the_layers_kernels(config):
  tokens = jnp.ones((1, 4), jnp.int32)
  params = nn.unbox(jax.eval_shape(
      EncoderDecoder(config).init, jax.random.PRNGKey(0), tokens,
      tokens)['params'])
  assert flops._layer_matmul_params(config, 1) == kernel_sizes(
      params['encoder']['layer_0'])
  assert flops._layer_matmul_params(config, 2) == kernel_sizes(
      params['decoder']['layer_0'])
