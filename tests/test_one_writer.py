"""One writer per bulk --output and per training workdir
(jaxformer/storage/locks.py, parallel/run_lock.py): a second run is
refused in one line naming the holder (host, pid, start time), exits
non-zero and touches nothing; a dead holder's lock is taken over; on
gs:// the lock is an object, removed at release."""
import json
import os
import socket
import subprocess
import sys

import pytest

from test_bulk_generate import generate_command, prompts, run
from test_bulk_translate import REPO

from jaxformer.cli import main as cli
from jaxformer.parallel import run_lock
from jaxformer.storage import locks, paths

__all__ = ['prompts']

def refusal(what: str, lock: str, pid: int) -> str:
  return (f'{what} is in use by another run (host {socket.gethostname()}, '
          f'pid {pid}, started ')


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
  lock = str(tmp_path / 'out.txt.lock')
  with locks.exclusive(lock, '--output out.txt'):
    with pytest.raises(locks.LockHeld) as held:
      with locks.exclusive(lock, '--output out.txt'):
        pass
  assert str(held.value).startswith(refusal('--output out.txt', lock,
                                            os.getpid()))
  assert str(held.value).endswith(f'lock {lock}); wait for it to end, or '
                                  'stop it, then run this again.')
  with locks.exclusive(lock, '--output out.txt'):  # Released: taken again.
    assert json.loads((tmp_path / 'out.txt.lock.holder').read_text())[
        'pid'] == os.getpid()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
  lock = str(tmp_path / 'workdir' / 'train.lock')
  holder = subprocess.Popen(
      [sys.executable, '-c', 'import sys, time\n'
       'from jaxformer.storage import locks\n'
       f'with locks.exclusive({lock!r}, "w"):\n'
       '  print("held", flush=True); time.sleep(600)'],
      stdout=subprocess.PIPE, text=True, env=dict(os.environ,
                                                  PYTHONPATH=str(REPO)))
  assert holder.stdout.readline() == 'held\n'
  with pytest.raises(locks.LockHeld, match=f'pid {holder.pid}'):
    with locks.exclusive(lock, 'w'):
      pass
  holder.kill()
  holder.wait()
  with locks.exclusive(lock, 'w'):
    pass


@pytest.mark.slow
def test_a_second_bulk_run_on_the_same_output_is_refused(
    lm_export, prompts, tmp_path, capfd):
  out = tmp_path / 'out.jsonl'
  lock = str(tmp_path / '.out.jsonl.lock')
  with run_lock.one_writer(lock, f'--output {out}'):
    status, _, errors = run(capfd, *generate_command(lm_export[0], prompts,
                                                     out))
  assert status == 1
  assert errors.strip().splitlines()[-1].startswith(
      f'jaxformer generate: error: ' + refusal(f'--output {out}', lock,
                                               os.getpid()))
  assert sorted(os.listdir(tmp_path)) == ['.out.jsonl.lock']
  assert run(capfd, *generate_command(lm_export[0], prompts, out))[0] == 0


def test_a_second_training_in_a_workdir_is_refused(tmp_path, capfd):
  workdir = tmp_path / 'run'
  lock = str(workdir / 'train.lock')
  with locks.exclusive(lock, f'--workdir {workdir}'):
    capfd.readouterr()
    status = cli.main(['train', '--config', 'configs/quickstart.py:runlocal',
                       '--workdir', str(workdir),
                       '--config.train.num_steps=2'])
    errors = capfd.readouterr().err
  assert status == 1
  assert errors.strip().splitlines()[-1].startswith(
      f'jaxformer train: error: ' + refusal(f'--workdir {workdir}', lock,
                                            os.getpid()))
  assert sorted(os.listdir(workdir)) == ['train.lock']


def test_a_lock_on_gcs_is_an_object_removed_at_release(gcs_emulator):
  lock = 'gs://test-bucket/locks/run/train.lock'
  with locks.exclusive(lock, '--workdir gs://test-bucket/locks/run'):
    held = json.loads(paths.read_text(lock))
    assert held['pid'] == os.getpid()
    assert held['host'] == socket.gethostname()
  assert not paths.exists(lock)


def test_a_gcs_lock_of_a_process_that_is_gone_is_taken_over(gcs_emulator):
  lock = 'gs://test-bucket/locks/gone/train.lock'
  gone = subprocess.Popen([sys.executable, '-c', 'pass'])
  gone.wait()
  paths.write_text(lock, json.dumps(dict(
      host=socket.gethostname(), pid=gone.pid, start='2026-01-01T00:00:00')))
  with locks.exclusive(lock, 'w'):
    assert json.loads(paths.read_text(lock))['pid'] == os.getpid()
  assert not paths.exists(lock)
  # One that lives, and was rewritten recently, holds it.
  paths.write_text(lock, json.dumps(dict(
      host=socket.gethostname(), pid=os.getppid(), start='2026-01-01')))
  with pytest.raises(locks.LockHeld, match=f'pid {os.getppid()}, started '
                     '2026-01-01; lock gs://test-bucket/locks/gone/train'):
    with locks.exclusive(lock, 'w'):
      pass
  paths.remove(lock)


@pytest.mark.slow
def test_two_concurrent_bulk_runs_one_output(lm_export, prompts, tmp_path):
  """Two `generate --output` started together on one file: one writes it
  (as a run alone writes it), the other is refused with 1."""
  big = tmp_path / 'big.txt'
  big.write_text(prompts.read_text() * 6)
  solo = tmp_path / 'solo.jsonl'
  assert cli.main(generate_command(lm_export[0], big, solo)) == 0
  out = tmp_path / 'out.jsonl'
  environment = dict(os.environ, PYTHONPATH=str(REPO))
  runs = [subprocess.Popen(
      [sys.executable, '-m', 'jaxformer', *generate_command(
          lm_export[0], big, out)], env=environment, stderr=subprocess.PIPE,
      stdout=subprocess.DEVNULL, text=True) for _ in range(2)]
  errors = [r.communicate(timeout=600)[1] for r in runs]
  codes = sorted(r.returncode for r in runs)
  assert codes == [0, 1], errors
  refused = errors[[r.returncode for r in runs].index(1)]
  assert f'--output {out} is in use by another run' in refused
  assert out.read_bytes() == solo.read_bytes()
  assert not (tmp_path / 'out.jsonl.parts').exists()


TRAIN = ['--config', 'configs/quickstart.py:runlocal',
         '--config.train.num_steps=12', '--config.eval.every=0',
         '--config.eval.final_split=', '--config.eval.bleu_examples=0',
         '--config.train.peak_flops=1e9', '--config.checkpoint.every=6']


@pytest.mark.slow
def test_two_concurrent_trainings_in_one_workdir(tmp_path,
                                                 process_environment):
  """Two `jaxformer train` started together on one workdir (with other
  learning rates): one is refused with 1 and writes nothing; the other's
  checkpoints are those of the same run alone."""
  import jax
  import numpy as np
  from jaxformer.checkpoints import trained
  # The run alone loads the programs the one that was not refused compiled.
  environment = dict(process_environment, PYTHONPATH=str(REPO))
  workdir = tmp_path / 'shared'
  runs = [subprocess.Popen(
      [sys.executable, '-m', 'jaxformer', 'train', *TRAIN, '--workdir',
       str(workdir), f'--config.train.learning_rate={rate}'],
      env=environment, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
      text=True) for rate in (1e-3, 3e-3)]
  errors = [r.communicate(timeout=900)[1] for r in runs]
  codes = [r.returncode for r in runs]
  assert sorted(codes) == [0, 1], errors
  refused = errors[codes.index(1)]
  assert f'--workdir {workdir} is in use by another run' in refused
  rate = (1e-3, 3e-3)[codes.index(0)]
  solo = tmp_path / 'solo'
  subprocess.run([sys.executable, '-m', 'jaxformer', 'train', *TRAIN,
                  '--workdir', str(solo),
                  f'--config.train.learning_rate={rate}'],
                 env=environment, check=True, capture_output=True,
                 timeout=900)
  metrics = lambda w: [json.loads(line) for line in  # noqa: E731
                       (w / 'metrics.jsonl').read_text().splitlines()]
  assert [m.get('step') for m in metrics(workdir)] == [
      m.get('step') for m in metrics(solo)]
  for step in (6, 12):
    shared, alone = (trained.load(str(w), step).params for w in (workdir, solo))
    assert jax.tree.all(jax.tree.map(
        lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)),
        shared, alone))
