"""Label-smoothed cross entropy and the metric sums behind every task."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.train import chunked_loss, loss


@pytest.mark.slow
def test_smoothed_cross_entropy_matches_the_explicit_distribution():
  logits = jax.random.normal(jax.random.key(0), (3, 5, 11))
  targets = jax.random.randint(jax.random.key(1), (3, 5), 0, 11)
  eps = 0.1
  q = (1 - eps) * jax.nn.one_hot(targets, 11) + eps / 11
  expected = -jnp.sum(q * jax.nn.log_softmax(logits), axis=-1)
  np.testing.assert_allclose(loss.smoothed_cross_entropy(logits, targets, eps),
                             expected, rtol=1e-5)


def test_without_smoothing_it_is_the_negative_log_likelihood():
  logits = jax.random.normal(jax.random.key(0), (4, 7))
  targets = jnp.array([0, 3, 6, 2])
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None],
                             axis=-1)[:, 0]
  np.testing.assert_allclose(loss.smoothed_cross_entropy(logits, targets, 0.0),
                             nll, rtol=1e-6)


def test_token_metrics_ignore_padding_and_normalise_by_real_tokens():
  logits = jnp.log(jnp.array([[[0.7, 0.2, 0.1], [0.1, 0.8, 0.1],
                               [0.3, 0.3, 0.4]]]))
  targets = jnp.array([[0, 2, 0]])
  weights = jnp.array([[1.0, 1.0, 0.0]])
  summary = loss.summarise(loss.token_metrics(logits, targets, weights, 0.0))
  np.testing.assert_allclose(summary['nll'],
                             -(np.log(0.7) + np.log(0.1)) / 2, rtol=1e-6)
  assert summary['accuracy'] == 0.5
  assert summary['weight'] == 2
  np.testing.assert_allclose(summary['perplexity'], np.exp(summary['nll']),
                             rtol=1e-6)


@pytest.mark.slow
def test_a_target_is_correct_where_argmax_picks_it_or_it_ties_the_top():
  logits = jax.random.normal(jax.random.key(0), (4, 9, 13))
  targets = jax.random.randint(jax.random.key(1), (4, 9), 0, 13)
  weights = jnp.ones((4, 9))
  correct = loss.token_metrics(logits, targets, weights, 0.1)['correct']
  assert correct == jnp.sum(jnp.argmax(logits, -1) == targets)
  assert correct == chunked_loss.output_token_metrics(
      logits, jnp.eye(13), None, targets, weights, 0.1)['correct']
  tied = jnp.array([[[2.0, 5.0, 5.0, 1.0]]])
  assert loss.token_metrics(tied, jnp.array([[2]]), jnp.ones((1, 1)),
                            0.0)['correct'] == 1


@pytest.mark.slow
def test_macro_f1_and_pearson():
  log_probs = jnp.log(jax.nn.one_hot(jnp.array([0, 0, 1, 1]), 2) * 0.98 + 0.01)
  labels = jnp.array([0, 1, 1, 1])
  sums = loss.class_metrics(log_probs, labels, jnp.ones(4), 0.0)
  # class 0: P=2, A=1, TP=1 -> F1 2/3; class 1: P=2, A=3, TP=2 -> F1 4/5.
  np.testing.assert_allclose(loss.macro_f1(sums), (2 / 3 + 4 / 5) / 2,
                             rtol=1e-6)
  predictions = jnp.array([[1.0], [2.0], [3.0], [5.0]])
  values = 2 * predictions + 1
  sums = loss.regression_metrics(predictions, values, jnp.ones(4))
  np.testing.assert_allclose(loss.pearson(sums), 1.0, rtol=1e-5)
