"""Training survives being killed, terminated and fed non-finite losses.

`jaxformer train` runs as a subprocess (2 CPU devices) where a signal or the
exit status is what is tested; the rest runs in-process. All share one
uninterrupted reference run.
"""
import json
import pathlib
import shutil
import signal
import time

import jax
import numpy as np
import pytest

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.config.settings import load_config
from jaxformer.run.log_window import NonFiniteLossError
from jaxformer.run.trainer import Trainer
from jaxformer.run.metrics import read_metrics
from jaxformer.run import goodput
from trained_runs import train_process

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py') + ':runlocal'
NUM_STEPS = 40
OVERRIDES = (f'train.num_steps={NUM_STEPS}', 'train.log_every=1',
             'train.peak_flops=1e9', 'checkpoint.every=10', 'eval.every=0',
             'eval.final_split=', 'eval.bleu_examples=0', 'eval.num_batches=1')
# Wall-clock measurements, which differ between equal runs.
TIMING_KEYS = ('tokens_per_second', 'step_time', 'mfu', *goodput.FIELDS)


def numbers(records: list[dict]) -> list[dict]:
  """The records without their timings: what must repeat exactly."""
  return [{k: v for k, v in r.items() if k not in TIMING_KEYS}
          for r in records]


def logged_steps(workdir: pathlib.Path) -> list[int]:
  """Steps in metrics.jsonl so far (a line being written is skipped)."""
  try:
    lines = (workdir / 'metrics.jsonl').read_text().splitlines()
  except FileNotFoundError:
    return []
  steps = []
  for line in lines:
    try:
      steps.append(json.loads(line)['step'])
    except json.JSONDecodeError:
      pass
  return steps


def checkpoint_steps(workdir: pathlib.Path) -> list[int]:
  directory = workdir / 'checkpoints'
  if not directory.is_dir():
    return []
  return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def kill_resume_and_compare(train, output, root: pathlib.Path, steps: int
                            ) -> list[dict]:
  """`train(workdir)` (a `jaxformer train` subprocess of `steps` steps) run
  through in one workdir; in another SIGKILLed once it holds a checkpoint
  and logged step 5, then run again: asserts that it resumed and ended with
  the same metrics and parameters; returns the metrics. `output(workdir)`
  is what the runs printed."""
  from jaxformer.checkpoints import trained
  reference = root / 'reference'
  assert train(reference).wait(600) == 0, output(reference)
  workdir = root / 'killed'
  killed = train(workdir)
  deadline = time.monotonic() + 600
  while not (checkpoint_steps(workdir) and max(logged_steps(workdir),
                                               default=0) >= 5):
    assert killed.poll() is None, output(workdir)
    assert time.monotonic() < deadline, output(workdir)
    time.sleep(0.01)
  killed.send_signal(signal.SIGKILL)
  killed.wait()
  restored = checkpoint_steps(workdir)[-1]
  assert restored < steps
  assert train(workdir).wait(600) == 0, output(workdir)
  assert f'Resuming from the checkpoint of step {restored}' in output(workdir)
  expected = numbers(read_metrics(str(reference)))
  got = numbers(read_metrics(str(workdir)))
  assert all(record in expected for record in got)
  assert all(record in got for record in expected)
  ours, theirs = trained.load(str(workdir)), trained.load(str(reference))
  assert ours.step == theirs.step == steps
  for a, b in zip(jax.tree.leaves(ours.params), jax.tree.leaves(theirs.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  return got


@pytest.fixture(scope='module')
def environment(process_environment):
  """Two devices per run and one compilation cache for all runs (the
  test run's)."""
  return process_environment


class Training:
  """`jaxformer train` on a workdir in a subprocess, output to a log file."""

  def __init__(self, workdir: pathlib.Path, environment: dict,
               config: str = CONFIG, overrides=OVERRIDES):
    self.workdir = workdir
    self.first_record = len(logged_steps(workdir))
    workdir.mkdir(exist_ok=True)
    self.log_path = workdir / f'log_{self.first_record}_{time.time_ns()}.txt'
    self.process = train_process(workdir, config,
                                 [f'--config.{o}' for o in overrides],
                                 environment, log=self.log_path)

  def wait_until(self, condition, what: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
      if self.process.poll() is not None:
        pytest.fail(f'training exited ({self.process.returncode}) before '
                    f'{what}:\n{self.output()}')
      if time.monotonic() > deadline:
        self.process.kill()
        pytest.fail(f'no {what} after {timeout} s:\n{self.output()}')
      time.sleep(0.01)

  def finish(self, timeout: float = 600) -> int:
    return self.process.wait(timeout)

  def output(self) -> str:
    return self.log_path.read_text()

  def records(self) -> list[dict]:
    return read_metrics(str(self.workdir))[self.first_record:]


@pytest.fixture(scope='module')
def reference(tmp_path_factory, environment):
  """An uninterrupted run: its workdir and metrics."""
  workdir = tmp_path_factory.mktemp('uninterrupted')
  run = Training(workdir, environment)
  assert run.finish() == 0, run.output()
  return workdir, read_metrics(str(workdir))


def between(records: list[dict], first: int, last: int) -> list[dict]:
  return [r for r in records if first <= r['step'] <= last]


def new_workdir(tmp_path: pathlib.Path, reference) -> pathlib.Path:
  """A workdir holding only the reference run's tokenizer."""
  workdir = tmp_path / 'run'
  shutil.copytree(reference[0] / 'tokenizer', workdir / 'tokenizer')
  return workdir


@pytest.mark.slow
def test_killed_then_terminated_run_repeats_the_uninterrupted_one_exactly(
    tmp_path, environment, reference):
  _, expected = reference
  workdir = new_workdir(tmp_path, reference)

  killed = Training(workdir, environment)
  killed.wait_until(lambda: checkpoint_steps(workdir)
                    and max(logged_steps(workdir)) >= 12,
                    'a checkpoint and step 12')
  killed.process.send_signal(signal.SIGKILL)
  killed.finish()
  assert numbers(killed.records()) == numbers(
      between(expected, 1, killed.records()[-1]['step']))

  restored = checkpoint_steps(workdir)[-1]
  terminated = Training(workdir, environment)
  terminated.wait_until(lambda: len(logged_steps(workdir))
                        > terminated.first_record, 'a step after resuming')
  terminated.process.send_signal(signal.SIGTERM)
  assert terminated.finish() == 0, terminated.output()
  stopped_at = terminated.records()[-1]['step']
  assert stopped_at < NUM_STEPS
  assert (f'Resuming from the checkpoint of step {restored}'
          in terminated.output())
  assert (f'SIGTERM received: saved the checkpoint of step {stopped_at}'
          in terminated.output())
  assert stopped_at in checkpoint_steps(workdir)
  assert numbers(terminated.records()) == numbers(
      between(expected, restored + 1, stopped_at))

  resumed = Training(workdir, environment)
  assert resumed.finish() == 0, resumed.output()
  assert (f'Resuming from the checkpoint of step {stopped_at}'
          in resumed.output())
  assert numbers(resumed.records()) == numbers(
      between(expected, stopped_at + 1, NUM_STEPS))


def in_process_config(*overrides):
  return load_config(CONFIG, [f'--config.{o}' for o in OVERRIDES + overrides])


@pytest.mark.slow
def test_non_finite_loss_stops_naming_the_step_and_last_good_checkpoint(
    tmp_path, reference):
  workdir = tmp_path / 'run'
  shutil.copytree(reference[0], workdir)
  exploding = ('train.learning_rate=1e30', f'train.num_steps={NUM_STEPS + 4}',
               'checkpoint.every=1')

  with pytest.raises(NonFiniteLossError) as error:
    Trainer(in_process_config(*exploding), str(workdir)).run()

  # Step 41 applies a huge but finite update, step 42 cannot be finite.
  assert checkpoint_steps(workdir)[-1] == NUM_STEPS + 1
  assert f'at step {NUM_STEPS + 2}' in str(error.value)
  assert (f'last good checkpoint is step {NUM_STEPS + 1}'
          in str(error.value))

  skipping = Trainer(in_process_config(*exploding, 'train.nan_policy=skip'),
                     str(workdir))
  kept_params = jax.device_get(skipping.initial_state().params)
  skipping.run()
  skipped = [r for r in read_metrics(str(workdir))
             if r['step'] > NUM_STEPS + 1 and 'loss' in r]
  assert [r['skipped_steps'] for r in skipped] == [1.0, 1.0, 1.0]
  assert int(skipping.state.step) == NUM_STEPS + 4
  for got, kept in zip(jax.tree.leaves(jax.device_get(skipping.state.params)),
                       jax.tree.leaves(kept_params)):
    np.testing.assert_array_equal(got, kept)


@pytest.mark.slow
def test_resuming_with_another_model_fails_listing_the_keys(tmp_path,
                                                            reference):
  workdir = tmp_path / 'run'
  shutil.copytree(reference[0], workdir)

  with pytest.raises(checkpoint_lib.CheckpointError) as error:
    Trainer(in_process_config('model.d_model=64', 'model.num_encoder_layers=2'),
            str(workdir))
  assert 'model.d_model: saved 32, now 64' in str(error.value)
  assert 'model.num_encoder_layers: saved 1, now 2' in str(error.value)

  Trainer(in_process_config('train.num_steps=80', 'train.learning_rate=1e-3'),
          str(workdir))
