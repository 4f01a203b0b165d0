"""The paper's learning-rate schedule and the optimizer built from config."""
import ml_collections
import numpy as np
import pytest

from jaxformer.train import schedule


def test_paper_schedule_follows_the_formula():
  lr = schedule.paper_schedule(d_model=512, warmup_steps=4000)
  for step in (1, 100, 3999, 4000, 4001, 100_000):
    expected = 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)
    np.testing.assert_allclose(lr(step - 1), expected, rtol=1e-6)
  # Peak at the end of warm-up.
  assert lr(3999) > lr(2000) and lr(3999) > lr(8000)


def test_warmup_schedules_peak_at_the_configured_rate():
  rsqrt = schedule.warmup_rsqrt_schedule(1e-3, 100)
  cosine = schedule.warmup_cosine_schedule(1e-3, 100, 1000)
  np.testing.assert_allclose(rsqrt(99), 1e-3, rtol=1e-6)
  np.testing.assert_allclose(rsqrt(399), 5e-4, rtol=1e-6)
  np.testing.assert_allclose(cosine(100), 1e-3, rtol=1e-6)
  assert cosine(1000) < 1e-9


def test_unknown_schedule_is_a_clear_error():
  train = ml_collections.ConfigDict(dict(schedule='linear'))
  with pytest.raises(ValueError, match='train.schedule'):
    schedule.make_schedule(train, 512)
