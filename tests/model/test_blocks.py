"""The blocks beside the paper's: RMSNorm, gated FFNs, grouped-query
attention, head widths of their own, biases on request, and how the mesh
splits fewer key/value heads."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from jaxformer.model import DecoderLM, EncoderDecoder, ModelConfig, layers
from jaxformer.model.attention import MultiHeadAttention
from jaxformer.model.masks import attention_mask
from jaxformer.parallel import mesh as mesh_lib

SMALL = ModelConfig(vocab_size=50, d_model=16, num_heads=4, d_ff=24,
                    num_encoder_layers=1, num_decoder_layers=1, max_len=16)
X = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 16))
TOKENS = jnp.array([[5, 9, 13, 2, 7, 0], [4, 8, 15, 16, 23, 42]])


def init(module, *args):
  return nn.unbox(module.init(jax.random.PRNGKey(1), *args)['params'])


def randomized(params, seed=2):
  """The same tree with every leaf random, so biases and scales count."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(tree, [jax.random.normal(k, x.shape) * 0.5
                                   for k, x in zip(keys, leaves)])


# Norms.


def test_rms_norm_divides_by_the_root_mean_square_and_scales():
  config = SMALL.replace(norm_type='rms', rms_norm_epsilon=1e-5)
  norm = layers.norm(config, 'n')
  params = randomized(init(norm, X))
  assert set(params) == {'scale'}
  x = np.asarray(X, np.float64)
  want = x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(
      params['scale'])
  np.testing.assert_allclose(norm.apply({'params': params}, X), want,
                             rtol=1e-5, atol=1e-6)


def test_layer_norm_without_bias_has_only_a_scale():
  norm = layers.norm(SMALL.replace(norm_bias=False), 'n')
  assert set(init(norm, X)) == {'scale'}
  assert set(init(layers.norm(SMALL, 'n'), X)) == {'scale', 'bias'}


# Feed-forward networks.


def silu(x):
  return x / (1 + np.exp(-x))


def gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


@pytest.mark.parametrize('activation, act', [('swiglu', silu),
                                             ('geglu', gelu_tanh)])
@pytest.mark.parametrize('use_bias', [True, False])
def test_gated_feed_forward_is_act_of_the_gate_times_the_up_projection(
    activation, act, use_bias):
  ffn = layers.FeedForward(SMALL.replace(activation=activation,
                                         use_bias=use_bias))
  params = randomized(init(ffn, X))
  assert set(params) == {'wi_0', 'wi_1', 'wo'}
  assert params['wi_0']['kernel'].shape == (24, 16)  # d_ff as given.
  x = np.asarray(X, np.float64)

  def linear(name, h):
    p = {k: np.asarray(v, np.float64) for k, v in params[name].items()}
    return h @ p['kernel'].T + p.get('bias', 0)

  want = linear('wo', act(linear('wi_0', x)) * linear('wi_1', x))
  np.testing.assert_allclose(ffn.apply({'params': params}, X), want,
                             rtol=1e-4, atol=1e-5)
  assert ('bias' in params['wo']) == use_bias


# Grouped-query attention.


def repeated_kv_params(params, group: int):
  """Multi-head parameters that compute what grouped ones do: each
  key/value head copied to the query heads of its group."""
  def repeat(p):
    return {k: jnp.repeat(v, group, axis=0) for k, v in p.items()}
  return dict(params, key=repeat(params['key']), value=repeat(params['value']))


@pytest.mark.slow
@pytest.mark.parametrize('kind', ['self', 'causal', 'cross'])
@pytest.mark.parametrize('kv_heads', [1, 2])
def test_grouped_query_attention_equals_multi_head_with_repeated_kv(
    kind, kv_heads):
  grouped = SMALL.replace(num_kv_heads=kv_heads, qkv_bias=True)
  memory = X[:, :4] + 1.0 if kind == 'cross' else X
  ids = jnp.array([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
  mask = attention_mask(ids, ids[:, :memory.shape[1]], kind == 'causal')
  params = randomized(init(MultiHeadAttention(grouped, kind), X, memory,
                           mask))
  assert params['key']['kernel'].shape == (kv_heads, 4, 16)
  got = MultiHeadAttention(grouped, kind).apply({'params': params}, X,
                                                memory, mask)
  want = MultiHeadAttention(SMALL.replace(qkv_bias=True), kind).apply(
      {'params': repeated_kv_params(params, 4 // kv_heads)}, X, memory, mask)
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.slow
def test_as_many_kv_heads_as_heads_is_the_multi_head_model():
  params = init(EncoderDecoder(SMALL), TOKENS, TOKENS)
  explicit = EncoderDecoder(SMALL.replace(num_kv_heads=4))
  assert jax.tree.map(jnp.shape, init(explicit, TOKENS, TOKENS)) == (
      jax.tree.map(jnp.shape, params))
  np.testing.assert_array_equal(
      explicit.apply({'params': params}, TOKENS, TOKENS),
      EncoderDecoder(SMALL).apply({'params': params}, TOKENS, TOKENS))


def test_kv_heads_must_divide_the_heads():
  with pytest.raises(ValueError, match='num_kv_heads=3 must divide'):
    SMALL.replace(num_kv_heads=3)


# Head width, biases.


@pytest.mark.slow
def test_head_dim_of_its_own_sets_the_projection_shapes():
  config = SMALL.replace(num_heads=3, num_kv_heads=1, head_dim=8)  # 3 x 8 != 16
  params = init(DecoderLM(config), TOKENS)['decoder']['layer_0']
  attention = params['self_attention']
  assert attention['query']['kernel'].shape == (3, 8, 16)
  assert attention['key']['kernel'].shape == (1, 8, 16)
  assert attention['out']['kernel'].shape == (16, 3, 8)
  with pytest.raises(ValueError, match='model.head_dim'):
    SMALL.replace(num_heads=3)


def bias_paths(params) -> list[str]:
  return [jax.tree_util.keystr(path) for path, _ in
          jax.tree_util.tree_flatten_with_path(params)[0]
          if 'bias' in jax.tree_util.keystr(path)]


@pytest.mark.slow
def test_no_bias_anywhere_when_asked():
  config = SMALL.replace(use_bias=False, norm_type='rms', norm_position='pre',
                         share_embeddings='none', logits_bias=False,
                         activation='swiglu', position_embedding='rope',
                         num_kv_heads=2)
  assert bias_paths(init(EncoderDecoder(config), TOKENS, TOKENS)) == []
  assert bias_paths(init(DecoderLM(config), TOKENS)) == []
  layer_norm = config.replace(norm_type='layer', norm_bias=False)
  assert bias_paths(init(DecoderLM(layer_norm), TOKENS)) == []


def test_qkv_biases_apart_from_the_output_bias():
  config = SMALL.replace(use_bias=False, qkv_bias=True,
                         position_embedding='rope')
  attention = init(DecoderLM(config), TOKENS)['decoder']['layer_0'][
      'self_attention']
  assert {name for name in attention if 'bias' in attention[name]} == {
      'query', 'key', 'value'}
  # Without rotary positions a key bias changes nothing, and there is none.
  paper = init(DecoderLM(SMALL), TOKENS)['decoder']['layer_0'][
      'self_attention']
  assert {name for name in paper if 'bias' in paper[name]} == {
      'query', 'value', 'out'}


# Sharding.


def kv_sharding(kv_heads: int, tensor: int):
  config = SMALL.replace(num_heads=8, num_kv_heads=kv_heads, d_model=32)
  variables = jax.eval_shape(
      lambda: DecoderLM(config).init(jax.random.PRNGKey(0), TOKENS))
  mesh = mesh_lib.make_mesh({'data': -1, 'tensor': tensor},
                            jax.devices()[:8])
  shardings = mesh_lib.logical_shardings(
      nn.get_partition_spec(variables), mesh, mesh_lib.DEFAULT_AXIS_RULES,
      shapes=nn.unbox(variables))
  attention = shardings['params']['decoder']['layer_0']['self_attention']
  return (tuple(attention['query']['kernel'].spec),
          tuple(attention['key']['kernel'].spec))


def test_kv_heads_split_over_tensor_only_where_it_divides_them():
  assert kv_sharding(kv_heads=2, tensor=2) == (
      ('tensor', None, 'fsdp'), ('tensor', None, 'fsdp'))
  # 2 kv heads on 4 tensor devices: replicated; the query heads still split.
  query, key = kv_sharding(kv_heads=2, tensor=4)
  assert query[0] == 'tensor' and key[0] is None
