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
from jaxformer.run.signals import StopRequested

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


@pytest.mark.slow
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


OVER_BUDGET = ('train.max_minutes=1', 'train.num_steps=1000',
               'train.schedule=warmup_cosine', 'train.warmup_steps=10',
               'train.schedule_over_budget=true', 'checkpoint.every=0')
PEAK = 2e-3  # The runlocal learning rate.


def step_times(first, then, switch):
  """Budget seconds at step r (reading r: one at the start, then one per
  step): `first` seconds per step up to step `switch`, `then` after."""
  return lambda r: first * min(r, switch) + then * max(r - switch, 0)


def learning_rates(workdir):
  return {r['step']: r['learning_rate'] for r in read_metrics(str(workdir))
          if 'learning_rate' in r}


class StopAt(StopRequested):
  """A stop (as by SIGTERM) after step `step`."""

  def __init__(self, step):
    super().__init__()
    self.step = step

  def at(self, step, checkpoints):
    if step == self.step:
      self.signal_name = 'SIGTERM'
    return super().at(step, checkpoints)


@pytest.fixture(scope='module')
def slow_then_fast(tmp_path_factory):
  """An uninterrupted run at 1.5 s per step to step 20, then 0.5 s."""
  workdir = tmp_path_factory.mktemp('slow_then_fast')
  run = trainer(workdir, *OVER_BUDGET, clock=step_times(1.5, 0.5, 20))
  run.run()
  return run, workdir


def check_ends_decayed_with_the_budget(run, workdir, seconds, step_time):
  last = int(run.state.step)
  assert run.finished and last == run.config.train.num_steps
  # The last step ends within one step's time of the 60 s budget.
  assert 60 - step_time < seconds(last) < 60 + step_time
  assert learning_rates(workdir)[last] < PEAK / 100


@pytest.mark.slow
def test_a_run_that_slows_down_replans_to_end_decayed_with_the_budget(
    tmp_path):
  # Planned at warm-up's end at 0.5 s per step: 120 steps. From step 40
  # steps take 1.5 s, so the budget ends at step 66; the re-plans at half
  # and three quarters of the budget's time shrink the decay to end there.
  seconds = step_times(0.5, 1.5, 40)
  run = trainer(tmp_path, *OVER_BUDGET, clock=seconds)
  run.run()
  check_ends_decayed_with_the_budget(run, tmp_path, seconds, 1.5)
  assert int(run.state.step) == 66
  plan = json.load(open(tmp_path / budget_lib.STEPS_FILE))['plan']
  assert [(e['step'], e['num_steps'], e['at']) for e in plan][0] == (
      10, 120, 0.0)
  assert plan[-1]['num_steps'] == 66 and plan[-1]['seconds_per_step'] == 1.5


@pytest.mark.slow
def test_a_run_that_speeds_up_replans_to_end_decayed_with_the_budget(
    slow_then_fast):
  # Planned at 1.5 s per step: 40 steps; from step 20 steps take 0.5 s, so
  # the budget allows 80.
  run, workdir = slow_then_fast
  check_ends_decayed_with_the_budget(run, workdir, step_times(1.5, 0.5, 20),
                                     0.5)
  assert int(run.state.step) == 80
  recorded = json.load(open(workdir / budget_lib.STEPS_FILE))
  assert recorded == {
      'num_steps': 80, 'seconds_per_step': 0.5, 'max_minutes': 1.0,
      'plan': [
          # Fixed at warm-up's end (1.5 s per step from step 5 to 10).
          {'step': 10, 'num_steps': 40, 'seconds_per_step': 1.5, 'at': 0.0},
          # Where the decay passes 25%: the same speed, the same end.
          {'step': 18, 'num_steps': 40, 'seconds_per_step': 1.5, 'at': 0.25},
          # Half the budget's time: 0.5 s per step since step 20; the 2 s
          # more than that from step 18 to 20 are taken for a compile.
          {'step': 25, 'num_steps': 76, 'seconds_per_step': 0.5, 'at': 0.5},
          {'step': 50, 'num_steps': 80, 'seconds_per_step': 0.5, 'at': 0.75},
          {'step': 69, 'num_steps': 80, 'seconds_per_step': 0.5, 'at': 0.9}]}
  schedule = schedules.replanned_cosine_schedule(
      PEAK, 10, [(e['step'], e['num_steps']) for e in recorded['plan']])
  for step, rate in learning_rates(workdir).items():
    assert rate == pytest.approx(float(schedule(step - 1)), rel=1e-5)


@pytest.mark.slow
def test_a_resumed_run_follows_the_recorded_plan_bitwise(
    tmp_path, slow_then_fast):
  seconds = step_times(1.5, 0.5, 20)
  first = trainer(tmp_path, *OVER_BUDGET, clock=seconds)
  with StopAt(35) as stop:
    first.run(stop)
  assert int(first.state.step) == 35 and not first.finished
  assert [e['step'] for e in json.load(
      open(tmp_path / budget_lib.STEPS_FILE))['plan']] == [10, 18, 25]
  # The resumed command's budget goes on from the first's (the clock then
  # reads 37.5 s), so the plans after step 35 are those of a run without
  # the stop.
  resumed = trainer(tmp_path, *OVER_BUDGET, clock=lambda r: seconds(35 + r))
  resumed.budget.start, resumed.budget.seconds = 0.0, seconds(35)
  resumed.run()
  run, workdir = slow_then_fast
  assert int(resumed.state.step) == int(run.state.step) and resumed.finished
  assert (tmp_path / budget_lib.STEPS_FILE).read_text() == (
      workdir / budget_lib.STEPS_FILE).read_text()
  assert learning_rates(tmp_path) == learning_rates(workdir)


def test_replanned_schedule_stretches_the_decay_and_reads_old_files(
    tmp_path):
  plan = [(10, 49), (20, 80), (30, 80), (40, 60)]
  schedule = schedules.replanned_cosine_schedule(PEAK, 10, plan)
  fixed = schedules.warmup_cosine_schedule(PEAK, 10, 49)
  rates = [float(schedule(s)) for s in range(70)]
  assert rates[:21] == pytest.approx([float(fixed(s)) for s in range(21)])
  assert rates[60:] == [0.0] * 10 and rates[59] > 0
  assert all(a >= b for a, b in zip(rates[10:], rates[11:]))
  # 20 to 40 covers the first plan's decay from 10/39 over 60 steps.
  progress = 10 / 39 + (1 - 10 / 39) * 20 / 60
  assert rates[40] == pytest.approx(PEAK / 2 * (1 + np.cos(np.pi * progress)))
  (tmp_path / budget_lib.STEPS_FILE).write_text(json.dumps(
      {'num_steps': 49, 'seconds_per_step': 1.2, 'max_minutes': 1}))
  assert budget_lib.read_plan(str(tmp_path), 10) == [
      {'step': 10, 'num_steps': 49, 'seconds_per_step': 1.2, 'at': 0.0}]


@pytest.mark.slow
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
