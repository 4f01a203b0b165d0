"""Losses and metrics. Every function returns *sums* over the batch, so the
caller can normalise by the global count (tokens or examples) once, after
summing microbatches and devices."""
import functools
import math

import jax
import jax.numpy as jnp


def smoothed_cross_entropy(logits: jax.Array, targets: jax.Array,
                           label_smoothing: float) -> jax.Array:
  """Cross entropy against (1 - eps) * one_hot + eps / vocab.

  Written without a one-hot: -sum_v q_v log p_v = logsumexp(logits)
  - (1 - eps) * logits[target] - eps * mean_v(logits).

  Args:
    logits: [..., vocab] float32.
    targets: [...] int.

  Returns:
    [...] float32 per-position loss.
  """
  log_normalizer = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  loss = log_normalizer - (1.0 - label_smoothing) * target_logit
  if label_smoothing:
    loss -= label_smoothing * jnp.mean(logits, axis=-1)
  return loss


def is_top(target_logit: jax.Array, top_logit: jax.Array) -> jax.Array:
  """Whether the target is the prediction: its logit is the largest (a
  tie for the largest counts too).

  The same as argmax(logits) == target but for ties, from the max the
  softmax needs anyway: XLA's CPU argmax is a reduction of (value, index)
  pairs that took 7% of the `small` train step (A/B in one process, 3
  rounds: 676-689 ms with it, 633-642 ms without).
  """
  return target_logit >= top_logit


def token_metrics(logits: jax.Array, targets: jax.Array, weights: jax.Array,
                  label_smoothing: float) -> dict[str, jax.Array]:
  """Sums over real target tokens.

  Args:
    logits: [batch, length, vocab] float32; targets: [batch, length] int;
    weights: [batch, length] float32, 1 at real tokens, 0 at padding.

  Returns:
    'loss' (smoothed), 'nll', 'correct' and 'weight' (the token count), each a
    scalar sum.
  """
  loss = smoothed_cross_entropy(logits, targets, label_smoothing)
  nll = smoothed_cross_entropy(logits, targets, 0.0) if label_smoothing else loss
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = is_top(target_logit, jnp.max(logits, axis=-1))
  return {
      'loss': jnp.sum(loss * weights),
      'nll': jnp.sum(nll * weights),
      'correct': jnp.sum(correct * weights),
      'weight': jnp.sum(weights),
  }


# The most logits `output_token_metrics` makes at a time: 16 MiB of float32
# ([512, 8000] for the `small` config, which trains as fast as with the
# whole [2048, 8000] and needs 12% less temporary memory for its step).
OUTPUT_CHUNK_LOGITS = 2 ** 22


def output_token_metrics(x: jax.Array, kernel: jax.Array, bias, targets,
                         weights, label_smoothing: float,
                         chunk_logits: int = OUTPUT_CHUNK_LOGITS):
  """`token_metrics` of the logits x kernel^T + bias, computed over chunks of
  positions so that the [batch, length, vocab] logits never exist whole.

  Differentiated, each chunk's logits are made once: the forward pass also
  computes the gradient of the loss sums with respect to x, kernel and bias
  (the softmax minus the target, times the output layer), and the backward
  pass only scales it. A train step holds neither the logits nor their
  gradient: measured, its temporary memory falls from 563 to 494 MiB for the
  `small` config and from 2,261 to 1,886 MiB for `base` (32 x (64+64) on
  CPU), and 65,536 rows of the quickstart fit in 8.0 GiB per v5e chip, where
  their logits alone took 21 GiB. Equal to `token_metrics` of the full
  logits up to float rounding (tests/train/test_loss.py).

  Args:
    x: [batch, length, d] (the last hidden states); kernel: [vocab, d];
      bias: [vocab] or None; targets: [batch, length] int; weights:
      [batch, length] float32; chunk_logits: the most logits per chunk.

  Returns:
    token_metrics' sums: 'loss', 'nll', 'correct', 'weight'.
  """
  batch, length, _ = x.shape
  span = max(1, min(length, chunk_logits // (batch * kernel.shape[0])))
  chunks = math.ceil(length / span)
  pad = chunks * span - length
  if pad:  # Padded positions weigh 0.
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    weights = jnp.pad(weights, ((0, 0), (0, pad)))
  loss, nll, correct = _chunked_output_sums(x, kernel, bias, targets,
                                            weights.astype(jnp.float32),
                                            float(label_smoothing), span)
  return {'loss': loss, 'nll': nll, 'correct': correct,
          'weight': jnp.sum(weights)}


def _by_chunk(a: jax.Array, span: int) -> jax.Array:
  """[batch, chunks * span, ...] -> [chunks, batch, span, ...]: the scan runs
  over positions, so a batch sharded over devices stays sharded."""
  return jnp.swapaxes(a.reshape(a.shape[0], -1, span, *a.shape[2:]), 0, 1)


def _from_chunks(a: jax.Array) -> jax.Array:
  a = jnp.swapaxes(a, 0, 1)
  return a.reshape(a.shape[0], -1, *a.shape[3:])


def _output_chunk(x, kernel, bias, targets, weights, label_smoothing,
                  with_grads):
  """One chunk's (loss, nll, correct) sums and, with_grads, the gradient of
  the nll sum with respect to x [b, s, d] and to the kernel and bias."""
  logits = jnp.einsum('bsd,vd->bsv', x, kernel,
                      preferred_element_type=jnp.float32)
  if bias is not None:
    logits += bias.astype(jnp.float32)
  top = jnp.max(logits, axis=-1, keepdims=True)
  exp = jnp.exp(logits - top)
  total = jnp.sum(exp, axis=-1)
  log_normalizer = top[..., 0] + jnp.log(total)
  target_logit = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
  nll = log_normalizer - target_logit
  loss = nll
  if label_smoothing:
    loss = nll + label_smoothing * (target_logit - jnp.mean(logits, axis=-1))
  correct = is_top(target_logit, top[..., 0])
  sums = (jnp.sum(loss * weights), jnp.sum(nll * weights),
          jnp.sum(correct * weights))
  if not with_grads:
    return sums, None
  vocab = jnp.arange(kernel.shape[0], dtype=targets.dtype)
  # d nll / d logits = weight * (softmax - one_hot(target)).
  d_logits = weights[..., None] * (
      exp / total[..., None] - (targets[..., None] == vocab))
  d_x = jnp.einsum('bsv,vd->bsd', d_logits, kernel.astype(jnp.float32))
  d_kernel = jnp.einsum('bsv,bsd->vd', d_logits, x.astype(jnp.float32))
  d_bias = (jnp.zeros(kernel.shape[:1], jnp.float32) if bias is None
            else jnp.sum(d_logits, axis=(0, 1)))
  return sums, (d_x, d_kernel, d_bias)


def _scan_chunks(x, kernel, bias, targets, weights, label_smoothing, span,
                 with_grads):
  def body(carry, chunk):
    sums, grads = _output_chunk(*chunk[:1], kernel, bias, *chunk[1:],
                                label_smoothing, with_grads)
    carry = jax.tree.map(jnp.add, carry,
                         (sums, grads[1:] if with_grads else ()))
    return carry, grads[0] if with_grads else None
  zero = jnp.zeros((), jnp.float32)
  init = ((zero, zero, zero),
          (jnp.zeros(kernel.shape, jnp.float32),
           jnp.zeros(kernel.shape[:1], jnp.float32)) if with_grads else ())
  (sums, grads), d_x = jax.lax.scan(
      body, init, (_by_chunk(x, span), _by_chunk(targets, span),
                   _by_chunk(weights, span)))
  return sums, ((_from_chunks(d_x),) + grads if with_grads else None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked_output_sums(x, kernel, bias, targets, weights, label_smoothing,
                         span):
  return _scan_chunks(x, kernel, bias, targets, weights, label_smoothing,
                      span, with_grads=False)[0]


def _chunked_output_sums_fwd(x, kernel, bias, targets, weights,
                             label_smoothing, span):
  sums, grads = _scan_chunks(x, kernel, bias, targets, weights,
                             label_smoothing, span, with_grads=True)
  return sums, (grads, x, kernel, bias, targets, weights)


def _chunked_output_sums_bwd(label_smoothing, span, residuals, cotangents):
  """The nll gradient, scaled by the loss and nll cotangents, plus the label
  smoothing term of the loss: d loss / d logits = d nll / d logits
  + eps * weight * (one_hot(target) - 1 / vocab), whose products with x and
  the kernel are a gather and a scatter-add instead of matmuls."""
  del span
  (d_x, d_kernel, d_bias), x, kernel, bias, targets, weights = residuals
  d_loss, d_nll, _ = cotangents
  scale = d_loss + d_nll
  d_x, d_kernel, d_bias = scale * d_x, scale * d_kernel, scale * d_bias
  if label_smoothing:
    eps = d_loss * label_smoothing
    vocab = kernel.shape[0]
    k = kernel.astype(jnp.float32)
    w = weights[..., None]
    d_x += eps * w * (jnp.take(k, targets, axis=0) - jnp.mean(k, axis=0))
    wx = (w * x.astype(jnp.float32)).reshape(-1, x.shape[-1])
    d_kernel += eps * (
        jnp.zeros_like(d_kernel).at[targets.reshape(-1)].add(wx)
        - jnp.sum(wx, axis=0) / vocab)
    d_bias += eps * (
        jnp.zeros_like(d_bias).at[targets.reshape(-1)].add(weights.reshape(-1))
        - jnp.sum(weights) / vocab)
  return (d_x.astype(x.dtype), d_kernel.astype(kernel.dtype),
          None if bias is None else d_bias.astype(bias.dtype), None, None)


_chunked_output_sums.defvjp(_chunked_output_sums_fwd, _chunked_output_sums_bwd)


def summarise(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Averages from the sums of `token_metrics`, `class_metrics` or
  `regression_metrics` (summed over microbatches and devices)."""
  count = jnp.maximum(sums['weight'], 1.0)
  out = {'loss': sums['loss'] / count, 'weight': sums['weight']}
  if 'nll' in sums:
    out['nll'] = sums['nll'] / count
    out['perplexity'] = jnp.exp(jnp.minimum(out['nll'], 50.0))
    out['accuracy'] = sums['correct'] / count
  if 'true_positives' in sums:
    out['macro_f1'] = macro_f1(sums)
  if 'sum_pv' in sums:
    out['mse'] = out['loss']
    out['pearson'] = pearson(sums)
  return out


def class_metrics(log_probs: jax.Array, labels: jax.Array, weights: jax.Array,
                  label_smoothing: float) -> dict[str, jax.Array]:
  """Sums over real examples of a classifier.

  Args:
    log_probs: [batch, classes]; labels: [batch] int; weights: [batch].

  Returns:
    'loss', 'nll', 'correct', 'weight', and per-class 'true_positives',
    'predicted' and 'actual' counts [classes] for macro-F1.
  """
  sums = token_metrics(log_probs, labels, weights, label_smoothing)
  num_classes = log_probs.shape[-1]
  predicted = jax.nn.one_hot(jnp.argmax(log_probs, -1), num_classes)
  actual = jax.nn.one_hot(labels, num_classes)
  w = weights[:, None]
  sums['true_positives'] = jnp.sum(predicted * actual * w, axis=0)
  sums['predicted'] = jnp.sum(predicted * w, axis=0)
  sums['actual'] = jnp.sum(actual * w, axis=0)
  return sums


def macro_f1(sums: dict[str, jax.Array]) -> jax.Array:
  """Unweighted mean over classes of F1 = 2 TP / (predicted + actual)."""
  denominator = sums['predicted'] + sums['actual']
  f1 = jnp.where(denominator > 0,
                 2 * sums['true_positives'] / jnp.maximum(denominator, 1), 0.0)
  present = (sums['actual'] > 0) | (sums['predicted'] > 0)
  return jnp.sum(f1) / jnp.maximum(jnp.sum(present), 1)


def regression_metrics(predictions: jax.Array, values: jax.Array,
                       weights: jax.Array) -> dict[str, jax.Array]:
  """Sums over real examples for MSE and Pearson correlation.

  Args:
    predictions, values: [batch, dim] float32; weights: [batch].
  """
  w = weights[:, None]
  squared_error = jnp.sum((predictions - values) ** 2 * w)
  return {
      'loss': squared_error,
      'weight': jnp.sum(weights) * predictions.shape[-1],
      'sum_p': jnp.sum(predictions * w), 'sum_v': jnp.sum(values * w),
      'sum_pp': jnp.sum(predictions ** 2 * w),
      'sum_vv': jnp.sum(values ** 2 * w),
      'sum_pv': jnp.sum(predictions * values * w),
  }


def pearson(sums: dict[str, jax.Array]) -> jax.Array:
  n = jnp.maximum(sums['weight'], 1.0)
  cov = sums['sum_pv'] / n - sums['sum_p'] * sums['sum_v'] / n ** 2
  var_p = sums['sum_pp'] / n - (sums['sum_p'] / n) ** 2
  var_v = sums['sum_vv'] / n - (sums['sum_v'] / n) ** 2
  return cov / jnp.sqrt(jnp.maximum(var_p * var_v, 1e-12))
