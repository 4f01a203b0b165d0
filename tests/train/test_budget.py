"""train.max_minutes (a wall-clock budget, optionally with the schedule over
it) and eval.average_last, on the tiny runlocal quick start. The budget's
clock is replaced by one that advances a fixed amount per reading, so the
runs are deterministic."""
import itertools
import json
import os
import pathlib

import jax
import numpy as np
import pytest

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.cli import train_commands
from jaxformer.config.settings import ConfigError, load_config
from jaxformer.run import budget as budget_lib
from jaxformer.train import schedule as schedules
from jaxformer.run.trainer import Trainer
from jaxformer.run.metrics import read_metrics

CONFIG = str(pathlib.Path(__file__).resolve().parents[2] / 'configs'
             / 'quickstart.py') + ':runlocal'
COMMON = ('train.peak_flops=1e9', 'eval.every=0', 'eval.bleu_examples=4',
          'eval.num_batches=1', 'train.log_every=5')


def fake_clock(seconds):
  """A clock whose reading r (from 0) shows seconds(r)."""
  readings = itertools.count()
  return lambda: float(seconds(next(readings)))


def trainer(workdir, *overrides, clock=lambda r: r) -> Trainer:
  config = load_config(CONFIG, COMMON + overrides)
  result = Trainer(config, str(workdir))
  result.budget = budget_lib.Budget(
      config.train.max_minutes, config.train.log_every,
      clock=fake_clock(clock))
  return result


def test_budget_and_estimate():
  budget = budget_lib.Budget(1.0, clock=fake_clock(lambda r: 25 * r))  # Reading 0: start.
  assert [budget.spent(s) for s in (1, 2, 3)] == [False, False, True]
  assert not budget_lib.Budget(0.0, clock=fake_clock(lambda r: 1e9 * r)).spent(1)
  assert budget_lib.estimate_steps(100, 0.5, 30.0) == 160
  assert budget_lib.estimate_steps(100, 0.5, -3.0) == 100


def test_progress_reads_wall_time_and_leaves_the_budget_clock_alone():
  budget = budget_lib.Budget(1.0, clock=fake_clock(lambda r: 1e6 + 25 * r))
  assert 59.0 < budget.wall_seconds_left() <= 60.0
  assert [budget.spent(s) for s in (1, 2, 3)] == [False, False, True]


def test_budget_stops_saves_and_reports_like_a_finished_run(tmp_path, capfd):
  # 12 readings of 10 s: one at the start, then one per step, so the
  # 2-minute budget is spent at step 12 of 20.
  run = trainer(tmp_path, 'train.max_minutes=2', 'train.num_steps=20',
                clock=lambda r: 10 * r)
  run.run()
  assert run.finished and int(run.state.step) == 12
  assert checkpoint_lib.Checkpointer.reader(str(tmp_path)).latest_step() == 12
  records = read_metrics(str(tmp_path))
  assert any(r['step'] == 12 and 'eval_loss' in r for r in records)
  assert 'budget is spent' in capfd.readouterr().out
  train_commands.report_translation(run)
  assert set(json.load(open(tmp_path / 'test_scores.json'))) == {
      'bleu', 'chrf', 'exact_match'}


def test_schedule_over_budget_is_fixed_written_and_reused(tmp_path):
  overrides = ('train.max_minutes=1', 'train.num_steps=1000',
               'train.schedule=warmup_cosine', 'train.warmup_steps=10',
               'train.schedule_over_budget=true', 'checkpoint.every=10')
  # Readings of 1 s: the start, steps 1-10 and the mark at step 5, so 12 s
  # at step 10 and 1.2 s per step since the mark; the 47 s left (after the
  # reading of `remaining`) allow 39 more steps. Then the machine slows down
  # to 10 s per reading and the budget stops the run after step 15.
  run = trainer(tmp_path, *overrides,
                clock=lambda r: r if r <= 13 else 13 + 10 * (r - 13))
  run.run()
  fixed = json.load(open(tmp_path / budget_lib.STEPS_FILE))
  assert fixed['num_steps'] == 49
  assert fixed['seconds_per_step'] == pytest.approx(1.2)
  assert run.finished and int(run.state.step) == 15
  schedule = schedules.warmup_cosine_schedule(2e-3, 10, 49)
  records = {r['step']: r for r in read_metrics(str(tmp_path))
             if 'learning_rate' in r}
  assert records[10]['learning_rate'] == pytest.approx(2e-3 * 9 / 10)
  assert records[15]['learning_rate'] == pytest.approx(float(schedule(14)))

  # A resumed run (with another budget) keeps the fixed count.
  resumed = trainer(tmp_path, *overrides, 'train.max_minutes=30')
  resumed.run()
  assert resumed.config.train.num_steps == 49
  assert int(resumed.state.step) == 49 and resumed.finished
  records = {r['step']: r for r in read_metrics(str(tmp_path))
             if 'learning_rate' in r}
  assert records[49]['learning_rate'] == pytest.approx(float(schedule(48)))
  assert records[49]['learning_rate'] < 1e-5


def test_average_last_evaluates_and_exports_the_mean(tmp_path):
  run = trainer(tmp_path, 'train.num_steps=15', 'checkpoint.every=5',
                'checkpoint.keep=3', 'eval.average_last=3')
  run.run()
  reader = checkpoint_lib.Checkpointer.reader(str(tmp_path))
  target = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      run.state.params)
  expected = [reader.restore_params(s, target) for s in (5, 10, 15)]
  got = jax.tree.leaves(run.state.params)
  for index, leaf in enumerate(got):
    mean = np.mean([jax.tree.leaves(e)[index] for e in expected], axis=0)
    np.testing.assert_allclose(leaf, mean, rtol=1e-5, atol=1e-6)
  assert os.path.isdir(tmp_path / 'average_5-15' / 'params')
  assert any('eval_average_loss' in r for r in read_metrics(str(tmp_path)))


@pytest.mark.parametrize('overrides, message', [
    (('train.max_minutes=-1',), 'train.max_minutes=-1.0 is out of range; it must be >= 0'),
    (('train.schedule_over_budget=true',), 'needs a budget'),
    (('train.schedule_over_budget=true', 'train.max_minutes=5'),
     "needs train.schedule='warmup_cosine'"),
    (('eval.average_last=5', 'checkpoint.keep=2'), 'checkpoint.keep >= 5'),
])
def test_bad_budget_or_average_is_a_clear_error(overrides, message):
  with pytest.raises(ConfigError, match=message.replace('(', r'\(')):
    load_config(CONFIG, overrides)


def test_the_cpu_recipe_loads_with_a_budget_and_averaging():
  config = load_config('configs/tsv_example.py:cpu')
  assert config.train.max_minutes == 15 and config.train.schedule_over_budget
  assert config.eval.average_last <= config.checkpoint.keep
  assert config.data.batching == 'pack'
  with pytest.raises(ValueError, match="unknown variant"):
    load_config('configs/tsv_example.py:gpu')
