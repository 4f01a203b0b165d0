"""The output layer's loss over chunks of positions: the same sums and
gradients as from the full logits, chunks sized per device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import chunked_loss, loss


def _output_layer_problem(seed, batch, length, d, vocab, with_bias):
  keys = jax.random.split(jax.random.key(seed), 5)
  x = jax.random.normal(keys[0], (batch, length, d))
  kernel = jax.random.normal(keys[1], (vocab, d))
  bias = jax.random.normal(keys[2], (vocab,)) if with_bias else None
  targets = jax.random.randint(keys[3], (batch, length), 0, vocab)
  weights = (jax.random.uniform(keys[4], (batch, length)) > 0.3).astype(
      jnp.float32)
  return x, kernel, bias, targets, weights


def _full_logits_metrics(x, kernel, bias, targets, weights, eps):
  logits = jnp.einsum('btd,vd->btv', x, kernel)
  if bias is not None:
    logits += bias
  return loss.token_metrics(logits, targets, weights, eps)


@pytest.mark.slow
@pytest.mark.parametrize('with_bias', [False, True])
@pytest.mark.parametrize('eps', [0.0, 0.1])
@pytest.mark.parametrize('chunk_logits', [1, 3 * 4 * 29, 10 ** 9])
def test_output_token_metrics_and_gradients_equal_the_full_logits(
    with_bias, eps, chunk_logits):
  """Chunks of one position, of 4 positions (7 is padded to 8) and all 7."""
  x, kernel, bias, targets, weights = _output_layer_problem(
      0, 3, 7, 16, 29, with_bias)

  def objective(metrics_fn, x, kernel, bias):
    sums = metrics_fn(x, kernel, bias, targets, weights, eps)
    # Both differentiable sums, with cotangents that tell them apart.
    return sums['loss'] + 0.3 * sums['nll'], sums

  fused = functools.partial(chunked_loss.output_token_metrics,
                            chunk_logits=chunk_logits, min_rows=1)
  argnums = (1, 2, 3) if with_bias else (1, 2)
  (expected, expected_sums), expected_grads = jax.value_and_grad(
      objective, argnums, has_aux=True)(_full_logits_metrics, x, kernel, bias)
  (value, sums), grads = jax.jit(jax.value_and_grad(
      objective, argnums, has_aux=True), static_argnums=0)(fused, x, kernel,
                                                           bias)
  np.testing.assert_allclose(value, expected, rtol=1e-5)
  for name in ('loss', 'nll', 'correct', 'weight'):
    np.testing.assert_allclose(sums[name], expected_sums[name], rtol=1e-5)
  for grad, expected_grad in zip(grads, expected_grads):
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5)
  # Undifferentiated (evaluation), the same sums.
  plain = fused(x, kernel, bias, targets, weights, eps)
  np.testing.assert_allclose(plain['loss'], expected_sums['loss'], rtol=1e-5)


@pytest.mark.slow
def test_output_token_metrics_in_bfloat16_keep_the_input_dtypes():
  x, kernel, bias, targets, weights = _output_layer_problem(1, 2, 5, 8, 13,
                                                            True)
  x, kernel = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
  grads = jax.grad(lambda x, k, b: chunked_loss.output_token_metrics(
      x, k, b, targets, weights, 0.1)['loss'], (0, 1, 2))(x, kernel, bias)
  assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float32]
  expected = _full_logits_metrics(x.astype(jnp.float32),
                                  kernel.astype(jnp.float32), bias, targets,
                                  weights, 0.1)['loss']
  np.testing.assert_allclose(chunked_loss.output_token_metrics(
      x, kernel, bias, targets, weights, 0.1)['loss'], expected, rtol=1e-5)


def test_chunks_have_256_rows_per_device_or_fill_the_logits_budget():
  v5e = chunked_loss.chunk_logits_budget(16 * 1024 ** 3)
  assert v5e == 2 ** 26 and chunked_loss.chunk_logits_budget(None) == 2 ** 22
  # wmt14_ende_base's widest bucket on a v5e-8: 96 x 256 rows, 12 per chip,
  # a 37,000-piece vocabulary: 2 chunks of 128 positions (1,536 rows per
  # chip) where the global batch made 256 chunks of 1.
  assert chunked_loss.chunk_span(12, 256, 37000, v5e) == 128
  # A budget of 1 position: still 256 rows per device (22 positions of
  # 12): 11 chunks of 24 (the last one 16 positions of padding).
  assert chunked_loss.chunk_span(12, 256, 37000, 12 * 37000) == 24
  # 8 rows of 40 positions: one chunk of 320 rows, not 2 of 32 positions.
  assert chunked_loss.chunk_span(8, 40, 1000, 1) == 40
  # Evened out: 100 positions would leave 56 in the third chunk.
  assert chunked_loss.chunk_span(1, 256, 1000, 100 * 1000, min_rows=1) == 86
  # The `small` config on a CPU: 32 x 64 rows, 16 positions (512 rows).
  assert chunked_loss.chunk_span(32, 64, 8000, 2 ** 22) == 16
  # Whole outputs: fewer rows than the least, or logits within budget.
  assert chunked_loss.chunk_span(2, 7, 29, 1) == 7
  assert chunked_loss.chunk_span(3, 7, 29, 10 ** 9, min_rows=1) == 7


def test_chunks_are_sized_by_the_rows_on_each_device_of_the_mesh():
  mesh = mesh_lib.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  assert chunked_loss.output_chunking(64, 512, 8000).row_shards == 1
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    chunking = chunked_loss.output_chunking(64, 512, 8000)
  assert (chunking.row_shards, chunking.rows_per_device) == (4, 16)
  assert (chunking.span, chunking.chunks) == (32, 16)  # 2 ** 22 logits.
  assert chunking.chunk_rows_per_device == 512


@pytest.mark.slow
def test_sharded_output_token_metrics_equal_the_full_logits():
  """Over data x fsdp x tensor, each row shard's kernel gradient summed in
  the loop and reduced after it: the same sums and gradients."""
  x, kernel, bias, targets, weights = _output_layer_problem(2, 4, 7, 16, 32,
                                                            True)
  mesh = mesh_lib.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})

  def objective(metrics_fn, x, kernel, bias):
    sums = metrics_fn(x, kernel, bias, targets, weights, 0.1)
    return sums['loss'] + 0.3 * sums['nll']

  fused = functools.partial(chunked_loss.output_token_metrics, chunk_logits=1,
                            min_rows=2)  # 1 row per device: 3 chunks of 3.
  expected = jax.value_and_grad(objective, (1, 2, 3))(_full_logits_metrics,
                                                      x, kernel, bias)
  rows = jax.sharding.NamedSharding(mesh, mesh_lib.BATCH_SPEC)
  with mesh_lib.activate(mesh, mesh_lib.DEFAULT_AXIS_RULES):
    assert chunked_loss.output_chunking(4, 7, 32, 1, 2).chunks == 3
    value, grads = jax.jit(jax.value_and_grad(objective, (1, 2, 3)),
                           static_argnums=0)(fused, jax.device_put(x, rows),
                                             kernel, bias)
  np.testing.assert_allclose(value, expected[0], rtol=1e-5)
  for grad, expected_grad in zip(grads, expected[1]):
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-4, atol=1e-5)


def _dots(jaxpr):
  """Every dot_general of a jaxpr, its sub-jaxprs (scan bodies, custom_vjp
  rules) included."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _dots(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _dots(sub)


@pytest.mark.slow
def test_bfloat16_output_matmuls_take_bfloat16_and_accumulate_in_float32():
  x, kernel, bias, targets, weights = _output_layer_problem(1, 2, 5, 8, 13,
                                                            True)
  x, kernel = x.astype(jnp.bfloat16), kernel.astype(jnp.bfloat16)
  jaxpr = jax.make_jaxpr(jax.grad(lambda x, k, b: chunked_loss.output_token_metrics(
      x, k, b, targets, weights, 0.1)['loss'], (0, 1, 2)))(x, kernel, bias)
  dots = list(_dots(jaxpr.jaxpr))
  assert len(dots) == 3  # Logits; their gradient times the kernel and x.
  for dot in dots:
    assert [v.aval.dtype for v in dot.invars] == [jnp.bfloat16] * 2
    assert dot.params['preferred_element_type'] == jnp.float32
