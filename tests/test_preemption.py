"""SIGTERM ends a run within the grace period: at most two steps and the save
after the signal, at any moment (a random one, during an asynchronous save,
an evaluation, the first compile, or the setup before it).

Steps take about a second here (the quick-start model, batches of 64 on
two CPU devices) and metrics are logged only at checkpoints, so nothing but
the loop's own bound keeps steps from queueing up ahead of the device.
"""
import json
import os
import pathlib
import random
import shutil
import signal
import time

import cpu_devices
import pytest

from jaxformer.checkpoints import trained
from jaxformer.run.metrics import read_metrics
from test_fault_tolerance import (
    Training, checkpoint_steps, logged_steps, numbers)

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py')
NUM_STEPS = 10
SLOW = (f'train.num_steps={NUM_STEPS}', 'train.log_every=1000',
        'train.peak_flops=1e9', 'checkpoint.every=1000', 'eval.every=0',
        'eval.final_split=', 'eval.bleu_examples=0', 'eval.num_batches=1',
        'data.batch_size=64', 'data.builtin.num_train=4000',
        'data.builtin.num_dev=40', 'data.builtin.num_test=40',
        'data.tokenizer.sample_size=2000')
# Grace for what is not a step or the save: the signal's delivery, the
# interpreter's exit and a shared, busy machine.
SLACK_SECONDS = 15


@pytest.fixture(scope='module')
def environment():
  """Two devices per run, and no compilation cache: every run compiles, as
  the reference did, so the reference's duration scales the moments of a
  signal (with a cache, later runs skip the compile and end before them)."""
  return dict(os.environ,
              XLA_FLAGS=cpu_devices.xla_flags(2),
              JAXFORMER_COMPILATION_CACHE='off', TF_CPP_MIN_LOG_LEVEL='2')


def slow_run(workdir, environment, *overrides) -> Training:
  return Training(workdir, environment, CONFIG, SLOW + overrides)


def started(run: Training) -> bool:
  return 'Training steps' in run.output()


def stopped_at(run: Training) -> int:
  """The step announced as saved on SIGTERM."""
  marker = 'SIGTERM received: saved the checkpoint of step '
  text = run.output()
  assert marker in text, text
  return int(text.split(marker)[1].split()[0])


def send_sigterm(run: Training) -> tuple[int, float]:
  """Sends SIGTERM; (exit code, seconds until the process exited)."""
  sent = time.monotonic()
  run.process.send_signal(signal.SIGTERM)
  code = run.finish(timeout=300)
  return code, time.monotonic() - sent


def terminate(run: Training) -> float:
  """Sends SIGTERM; seconds until the process exited 0."""
  code, seconds = send_sigterm(run)
  assert code == 0, run.output()
  return seconds


def ended_before(run: Training) -> bool:
  """Whether the run had trained all its steps before the signal came: it
  then ends 0, or, with the signal in its last moments (the interpreter's
  exit, after the handler is gone), as killed by SIGTERM."""
  return ('SIGTERM received' not in run.output()
          and 'Goodput' in run.output())


@pytest.fixture(scope='module')
def slow_reference(tmp_path_factory, environment):
  """An uninterrupted run: its workdir, its records of the last step and the
  seconds from the start of training (compile included) to its last step."""
  workdir = tmp_path_factory.mktemp('slow_uninterrupted')
  run = slow_run(workdir, environment)
  run.wait_until(lambda: started(run), 'the start of training')
  start = time.monotonic()
  run.wait_until(lambda: f'step {NUM_STEPS}/{NUM_STEPS}' in run.output(),
                 'the last step')
  training_seconds = time.monotonic() - start
  assert run.finish() == 0, run.output()
  return workdir, last_step_records(workdir), training_seconds


def last_step_records(workdir) -> list[dict]:
  """The training and evaluation records of step NUM_STEPS."""
  return [r for r in read_metrics(str(workdir)) if r['step'] == NUM_STEPS]


def fresh_workdir(tmp_path, reference) -> pathlib.Path:
  """A workdir with the reference's tokenizer but not its token cache: each
  run tokenises its data as the reference did, so their timings compare."""
  workdir = tmp_path / 'run'
  shutil.copytree(reference[0] / 'tokenizer', workdir / 'tokenizer',
                  ignore=shutil.ignore_patterns('token_cache'))
  return workdir


def step_seconds(reference) -> float:
  """An upper bound of one step: the reference's mean, compile included."""
  return reference[1][0]['step_time']


@pytest.mark.slow
def test_sigterm_at_a_random_moment_saves_within_two_steps_and_resumes_exactly(
    tmp_path, environment, slow_reference):
  # A moment from the first compile to well before the last step: the
  # reference's own duration scales it to this machine's speed. A run can
  # go twice as fast as the reference did (the other test worker busy then,
  # idle now) and finish first: then again, the window halved.
  step = NUM_STEPS
  for attempt in range(3):
    workdir = fresh_workdir(tmp_path / f'try{attempt}', slow_reference)
    run = slow_run(workdir, environment)
    run.wait_until(lambda: started(run), 'the start of training')
    time.sleep(random.uniform(0.15, 0.5) / 2 ** attempt * slow_reference[2])
    code, seconds = send_sigterm(run)
    if ended_before(run) and code in (0, -signal.SIGTERM):
      continue
    assert code == 0, run.output()
    step = stopped_at(run)
    if step < NUM_STEPS:
      break
  assert step < NUM_STEPS  # Unbounded dispatch ran to the end unstopped.
  assert checkpoint_steps(workdir)[-1] == step
  save_seconds = 5  # A generous bound of one synchronous save here.
  assert seconds < (2 * step_seconds(slow_reference) + save_seconds
                    + SLACK_SECONDS), run.output()

  resumed = slow_run(workdir, environment)
  assert resumed.finish() == 0, resumed.output()
  assert f'Resuming from the checkpoint of step {step}' in resumed.output()
  assert numbers(last_step_records(workdir)) == numbers(slow_reference[1])


@pytest.mark.slow
def test_sigterm_during_an_asynchronous_save_commits_both_checkpoints(
    tmp_path, environment, slow_reference):
  workdir = fresh_workdir(tmp_path, slow_reference)
  run = slow_run(workdir, environment, 'checkpoint.every=2')
  checkpoints = workdir / 'checkpoints'
  run.wait_until(lambda: checkpoints.is_dir() and any(
      p.name.startswith('2.') or p.name == '2' for p in checkpoints.iterdir()),
                 'the save of step 2')
  terminate(run)

  step = stopped_at(run)
  assert 2 in checkpoint_steps(workdir)
  assert checkpoint_steps(workdir)[-1] == step
  assert not [p for p in checkpoints.iterdir() if not p.name.isdigit()]
  for saved in (2, step):
    trained.load(str(workdir), saved)  # Restores, or raises.


@pytest.mark.slow
def test_sigterm_during_an_evaluation_stops_at_its_step(
    tmp_path, environment, slow_reference):
  workdir = fresh_workdir(tmp_path, slow_reference)
  run = slow_run(workdir, environment, 'eval.every=3',
                 'eval.bleu_examples=40')
  run.wait_until(lambda: 3 in logged_steps(workdir), 'the step before the '
                 'evaluation')
  terminate(run)

  assert stopped_at(run) == 3
  assert checkpoint_steps(workdir) == [3]
  records = [r for r in read_metrics(str(workdir)) if r['step'] == 3]
  assert any('eval_bleu' in r for r in records)


@pytest.mark.slow
def test_sigterm_during_the_first_compile_or_setup_exits_cleanly(
    tmp_path, tmp_path_factory, environment, slow_reference):
  # A model shape no earlier run compiled, so the compile takes a while.
  uncached = ('model.d_ff=384',)
  workdir = fresh_workdir(tmp_path, slow_reference)
  run = slow_run(workdir, environment, *uncached)
  run.wait_until(lambda: started(run), 'the start of training')
  terminate(run)
  step = stopped_at(run)
  assert step <= 2
  assert checkpoint_steps(workdir) == [step]
  trained.load(str(workdir), step)

  workdir = tmp_path / 'setup'
  shutil.copytree(slow_reference[0] / 'tokenizer', workdir / 'tokenizer',
                  ignore=shutil.ignore_patterns('token_cache'))
  run = slow_run(workdir, environment, *uncached)
  run.wait_until(lambda: (workdir / 'config.json').exists(),
                 'the setup of the run')
  terminate(run)
  assert 'received before the first step: nothing was trained' in run.output()
  assert checkpoint_steps(workdir) == []
  assert json.loads((workdir / 'config.json').read_text())['model'][
      'd_ff'] == 384
