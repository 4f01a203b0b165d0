"""The language model's per-token loss mask ('targets_loss_mask'): a mask
of ones changes nothing, bitwise; masked tokens add nothing to the loss
sums or the gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.model import ModelConfig
from jaxformer.train import loss as losses
from jaxformer.train import tasks

TASK = tasks.TASKS['language_model']
CONFIG = ModelConfig(vocab_size=29, d_model=16, num_heads=2, d_ff=32,
                     num_encoder_layers=0, num_decoder_layers=1, max_len=8,
                     share_embeddings='all')


@pytest.fixture(scope='module')
def setup():
  model = TASK.model(CONFIG)
  rng = np.random.default_rng(0)
  targets = rng.integers(4, 29, (3, 8)).astype(np.int32)
  segment_ids = np.ones((3, 8), np.int32)
  segment_ids[2, 6:] = 0
  targets[2, 6:] = 0
  batch = {'targets': targets, 'targets_segment_ids': segment_ids,
           'targets_positions': np.tile(np.arange(8, dtype=np.int32), (3, 1))
           * segment_ids}
  params = model.init(jax.random.key(0), targets)['params']

  @jax.jit
  def sums_and_grads(params, batch):
    def loss(params):
      sums = TASK.loss_sums(model, params, batch, None, 0.1)
      return sums['loss'], sums
    return jax.grad(loss, has_aux=True)(params)[::-1]
  return model, params, batch, sums_and_grads


def _equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.slow
def test_a_mask_of_ones_changes_nothing_bitwise(setup):
  _, params, batch, sums_and_grads = setup
  ones = dict(batch, targets_loss_mask=np.ones((3, 8), np.int32))
  _equal(sums_and_grads(params, ones), sums_and_grads(params, batch))


def _prompt_mask():
  mask = np.zeros((3, 8), np.int32)
  mask[:, 3:] = 1
  return mask


@pytest.mark.slow
def test_the_masked_loss_is_that_of_the_unmasked_tokens(setup):
  model, params, batch, sums_and_grads = setup
  masked = dict(batch, targets_loss_mask=_prompt_mask())
  sums, grads = sums_and_grads(params, masked)
  weights = (batch['targets_segment_ids'] * _prompt_mask()).astype(np.float32)

  def reference(params):
    logits = model.apply({'params': params}, batch['targets'],
                         batch['targets_segment_ids'],
                         batch['targets_positions'])
    sums = losses.token_metrics(logits, jnp.asarray(batch['targets']),
                                weights, 0.1)
    return sums['loss'], sums
  expected_grads, expected = jax.grad(reference, has_aux=True)(params)
  assert float(sums['weight']) == weights.sum() == 3 * 5 - 2
  for name in ('loss', 'nll', 'correct'):
    np.testing.assert_allclose(sums[name], expected[name], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               grads, expected_grads)


@pytest.mark.slow
def test_masked_tokens_add_nothing_to_loss_or_gradients(setup):
  """The targets under a trailing mask (whose changes reach no unmasked
  prediction) may be anything: the sums and gradients stay the same."""
  _, params, batch, sums_and_grads = setup
  mask = np.ones((3, 8), np.int32)
  mask[:, 5:] = 0
  changed = batch['targets'].copy()
  changed[:, 5:] = (changed[:, 5:] + 7) % 25 + 4
  changed[2, 6:] = 0
  first = sums_and_grads(params, dict(batch, targets_loss_mask=mask))
  second = sums_and_grads(params, dict(batch, targets=changed,
                                       targets_loss_mask=mask))
  assert float(first[0]['weight']) == 15
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0,
                                                       atol=1e-7),
               first, second)
