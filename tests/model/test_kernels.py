"""The attention kernels against the einsums: the Pallas splash kernel in
interpret mode (the TPU kernel's own code, run on CPU), sharded and not, and
the whole model with attention_impl='splash'; the backend policy's choices;
cuDNN where a GPU is present."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.model import (DecoderLM, EncoderDecoder, ModelConfig, backend,
                             kernels)
from jaxformer.model.dot_product import einsum_attention
from jaxformer.model.masks import attention_mask

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

# [batch 2, length 24]: suffix padding, and two packed examples + padding.
PADDED = np.array([[1] * 24, [1] * 17 + [0] * 7], np.int32)
PACKED = np.array([[1] * 10 + [2] * 14, [1] * 5 + [2] * 9 + [3] * 6 + [0] * 4],
                  np.int32)


def qkv(dtype, t=24, s=24, heads=2, head_dim=32, seed=0, kv_heads=None):
  """Queries [2, t, heads, h]; keys, values [2, s, kv_heads (heads), h]."""
  keys = jax.random.split(jax.random.PRNGKey(seed), 3)
  kv_heads = kv_heads or heads
  return tuple(jax.random.normal(k, (2, n, m, head_dim)).astype(dtype)
               for k, n, m in zip(keys, (t, s, s), (heads, kv_heads, kv_heads)))


def einsum_out(q, k, v, q_ids, k_ids, causal):
  return einsum_attention(q, k, v, attention_mask(q_ids, k_ids, causal))[0]


def loss_fn(attend, q_ids):
  """A loss over real query positions only, with fixed random weights."""
  def loss(q, k, v):
    out = attend(q, k, v).astype(jnp.float32)
    weights = jax.random.normal(jax.random.PRNGKey(1), out.shape)
    return jnp.sum(out * weights * (q_ids != 0)[:, :, None, None])
  return loss


def assert_close(actual, expected, q_ids, tolerance):
  real = np.asarray(q_ids) != 0
  actual = np.asarray(actual, np.float32)[real]
  expected = np.asarray(expected, np.float32)[real]
  scale = max(1.0, float(np.abs(expected).max()))
  np.testing.assert_allclose(actual, expected, atol=tolerance * scale,
                             rtol=tolerance)


# Interpret mode is slow: every layout in float32, two in bfloat16, and
# grouped-query attention (4 query heads over 2 key/value heads, passed to
# the kernel as they are: the gradients of a shared head sum over its group).
@pytest.mark.slow
@pytest.mark.parametrize('ids, causal, dtype, heads', [
    (PADDED, False, jnp.float32, 2), (PADDED, True, jnp.float32, 2),
    (PACKED, False, jnp.float32, 2), (PACKED, True, jnp.float32, 2),
    (PADDED, False, jnp.bfloat16, 2), (PACKED, True, jnp.bfloat16, 2),
    (PACKED, True, jnp.float32, 4)],
    ids=['padded-f32', 'padded-causal-f32', 'packed-f32', 'packed-causal-f32',
         'padded-bf16', 'packed-causal-bf16', 'packed-causal-f32-gqa'])
def test_splash_equals_einsum_forward_and_gradients(ids, causal, dtype, heads):
  q, k, v = qkv(dtype, heads=heads, kv_heads=2)
  ids = jnp.asarray(ids)

  def splash(q, k, v):
    return kernels.local_splash_attention(q, k, v, ids, ids, causal,
                                          interpret=True)

  def einsum(q, k, v):
    return einsum_out(q, k, v, ids, ids, causal)

  tolerance = TOLERANCE[dtype]
  assert_close(jax.jit(splash)(q, k, v), jax.jit(einsum)(q, k, v), ids,
               tolerance)
  splash_grads = jax.jit(jax.grad(loss_fn(splash, ids), (0, 1, 2)))(q, k, v)
  einsum_grads = jax.jit(jax.grad(loss_fn(einsum, ids), (0, 1, 2)))(q, k, v)
  for name, got, want in zip('qkv', splash_grads, einsum_grads):
    assert np.isfinite(np.asarray(got, np.float32)).all(), name
    # dq per query position; dk, dv per key position (all keys count).
    rows = ids if name == 'q' else jnp.ones_like(ids)
    assert_close(got, want, rows, 4 * tolerance)


@pytest.mark.slow
def test_splash_cross_attention_of_other_length_equals_einsum():
  q, k, v = qkv(jnp.float32, t=8, s=136)
  q_ids = jnp.array([[1] * 8, [1] * 5 + [0] * 3])
  k_ids = jnp.array([[1] * 136, [1] * 100 + [0] * 36])
  got = kernels.local_splash_attention(q, k, v, q_ids, k_ids, False,
                                       interpret=True)
  assert got.shape == q.shape
  assert_close(got, einsum_out(q, k, v, q_ids, k_ids, False), q_ids, 2e-5)


@pytest.mark.slow
def test_sharded_splash_equals_einsum_on_a_data_by_tensor_mesh():
  """Rows over `data`, heads over `tensor`: shard_map hands each device its
  own rows and heads."""
  mesh = mesh_lib.make_mesh({'data': 2, 'tensor': 2}, jax.devices()[:4])
  q, k, v = qkv(jnp.float32)
  ids = jnp.asarray(PACKED)
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    got = jax.jit(lambda q, k, v: kernels.splash_attention(
        q, k, v, ids, ids, True, interpret=True))(q, k, v)
    text = jax.jit(lambda q, k, v: kernels.splash_attention(
        q, k, v, ids, ids, True, interpret=True)).lower(q, k, v).as_text()
  assert 'shard_map' in text or 'manual' in text
  assert_close(got, einsum_out(q, k, v, ids, ids, True), ids, 2e-5)


@pytest.mark.slow
@pytest.mark.parametrize('kv_heads', [2, 1])
def test_sharded_grouped_splash_equals_einsum(kv_heads):
  """4 query heads over `tensor`=2: 2 kv heads split with them; 1 (MQA)
  cannot be, and is repeated for the kernel."""
  mesh = mesh_lib.make_mesh({'data': 2, 'tensor': 2}, jax.devices()[:4])
  q, k, v = qkv(jnp.float32, heads=4, kv_heads=kv_heads, head_dim=16)
  ids = jnp.asarray(PADDED)
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    got = jax.jit(lambda q, k, v: kernels.splash_attention(
        q, k, v, ids, ids, True, interpret=True))(q, k, v)
  assert_close(got, einsum_out(q, k, v, ids, ids, True), ids, 2e-5)


@pytest.mark.slow
def test_model_with_splash_attention_equals_einsum_model():
  config = ModelConfig(vocab_size=32, d_model=64, num_heads=2, d_ff=64,
                       num_encoder_layers=1, num_decoder_layers=1)
  inputs = jnp.array([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0]])
  targets = jnp.array([[11, 12, 1, 0], [13, 14, 15, 1]])
  model = EncoderDecoder(config.replace(attention_impl='einsum'))
  params = model.init(jax.random.PRNGKey(0), inputs, targets)
  splash = EncoderDecoder(config.replace(attention_impl='splash'))
  got = jax.jit(splash.apply)(params, inputs, targets)
  want = jax.jit(model.apply)(params, inputs, targets)
  real = np.asarray(targets) != 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                             atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('impl', ['fused', 'splash'])
def test_grouped_rotary_lm_with_each_kernel_equals_einsum_model(impl):
  config = ModelConfig(vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2,
                       d_ff=48, num_decoder_layers=1, norm_type='rms',
                       norm_position='pre', activation='swiglu',
                       position_embedding='rope')
  targets = jnp.array([[11, 12, 13, 1, 0, 0], [13, 14, 15, 16, 17, 1]])
  params = DecoderLM(config).init(jax.random.PRNGKey(0), targets)
  want = jax.jit(DecoderLM(config).apply)(params, targets)
  got = jax.jit(DecoderLM(config.replace(attention_impl=impl)).apply)(
      params, targets)
  real = np.asarray(targets) != 0
  np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real],
                             atol=1e-4)


@pytest.mark.parametrize('platform, dtype, expected', [
    ('cpu', jnp.float32, 'einsum'), ('cpu', jnp.bfloat16, 'einsum'),
    ('gpu', jnp.bfloat16, 'cudnn'), ('gpu', jnp.float16, 'cudnn'),
    ('gpu', jnp.float32, 'einsum'),
    ('tpu', jnp.float32, 'splash'), ('tpu', jnp.bfloat16, 'splash')])
def test_auto_attention_per_platform(platform, dtype, expected):
  assert backend.attention_kernel('auto', platform, dtype) == expected
  for impl in ('einsum', 'fused', 'cudnn', 'splash'):
    assert backend.attention_kernel(impl, platform, dtype) == impl


def test_auto_takes_the_einsums_on_tpu_below_one_splash_block():
  short = (backend.SPLASH_MIN_LENGTH // 2, backend.SPLASH_MIN_LENGTH)
  assert backend.attention_kernel('auto', 'tpu', jnp.bfloat16, short) == (
      'einsum')
  assert backend.attention_kernel('auto', 'tpu', jnp.bfloat16,
                                  short[::-1]) == 'einsum'
  assert backend.attention_kernel('splash', 'tpu', jnp.bfloat16, short) == (
      'splash')


def test_unknown_attention_impl_is_an_error_naming_the_key():
  with pytest.raises(ValueError, match='model.attention_impl'):
    backend.attention_kernel('flash', 'cpu', jnp.float32)


def test_platform_is_that_of_the_mesh_in_context():
  assert backend.platform() == jax.default_backend()
  # CPU devices, also where the default backend is a GPU's (one device).
  mesh = mesh_lib.make_mesh({'data': 2}, jax.devices('cpu')[:2])
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    assert jax.jit(lambda: jnp.zeros(()) + len(backend.platform())
                   ).trace().jaxpr is not None
    assert backend.platform() == 'cpu'


@pytest.mark.skipif(jax.default_backend() != 'gpu',
                    reason='cuDNN flash attention needs an NVIDIA GPU')
@pytest.mark.parametrize('causal', [False, True])
@pytest.mark.parametrize('kv_heads', [2, 1])  # Multi-head, multi-query.
def test_cudnn_equals_einsum_on_padded_rows(causal, kv_heads):
  q, k, v = qkv(jnp.bfloat16, t=128, s=128, head_dim=64, kv_heads=kv_heads)
  ids = jnp.asarray(np.array([[1] * 128, [1] * 90 + [0] * 38], np.int32))
  got = jax.jit(lambda q, k, v: kernels.cudnn_attention(
      q, k, v, ids, ids, causal))(q, k, v)
  text = jax.jit(lambda q, k, v: kernels.cudnn_attention(
      q, k, v, ids, ids, causal)).lower(q, k, v).as_text()
  assert 'cudnn' in text.lower()
  assert_close(got, einsum_out(q, k, v, ids, ids, causal), ids, 3e-2)
