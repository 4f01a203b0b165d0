"""From SIGTERM to exit (jaxformer/runtime/stop_clock.py): each phase is
timed on stderr under JAXFORMER_DEBUG, and once the stop's checkpoint is
committed the rest (reports, Python's exit hooks: the distributed runtime,
Orbax, tf.data threads) cannot hold the process past EXIT_SECONDS."""
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from test_fault_tolerance import logged_steps
from test_preemption import (SLACK_SECONDS, environment, fresh_workdir,
                             send_sigterm, slow_reference, slow_run,
                             step_seconds, stopped_at)

__all__ = ['environment', 'slow_reference']

REPO = pathlib.Path(__file__).resolve().parents[1]

STOPPED = '''
import atexit, sys, time
from jaxformer.cli import exiting
from jaxformer.runtime import stop_clock
stop_clock.signalled('SIGTERM')
atexit.register(time.sleep, 600)  # An exit hook that never ends.
stop_clock.phase('run ended (checkpoint committed, goodput reported)')
stop_clock.bound_exit(2)
if sys.argv[1] == 'stuck':
  stop_clock.phase('a report')
  time.sleep(600)
exiting.exit_process(0)
'''


def stopped(how: str) -> list[str]:
  """The stderr lines after the first of a process stopped as STOPPED
  says; asserts it ends with 0 in well under the 600 s its hooks take."""
  start = time.monotonic()
  result = subprocess.run(
      [sys.executable, '-c', STOPPED, how], capture_output=True, text=True,
      timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO),
                            JAXFORMER_DEBUG='1'))
  assert result.returncode == 0, result.stderr
  assert time.monotonic() - start < 60
  lines = result.stderr.strip().splitlines()
  assert re.fullmatch(r'jaxformer: SIGTERM \+\d+\.\d\d s: run ended '
                      r'\(checkpoint committed, goodput reported\)', lines[0])
  return lines[1:]


def test_once_the_checkpoint_is_committed_the_exit_hooks_are_skipped():
  (line,) = stopped('exit')
  assert re.fullmatch(r'jaxformer: SIGTERM \+\d+\.\d\d s: exit \(the '
                      r'checkpoint is committed: no exit hooks\)', line)


@pytest.mark.slow
def test_a_stuck_phase_cannot_hold_the_process_past_the_bound():
  lines = stopped('stuck')
  assert lines[0].endswith(': a report')
  assert lines[1] == ('jaxformer: exiting took over 2 s after the '
                      'checkpoint was committed (in: a report); ending the '
                      'process.')


# The moments a signal falls: in a step after the first (a signal during
# the first compile waits for it: XLA's compile cannot be interrupted), at
# a log boundary, in an evaluation.
MOMENTS = {
    'a step': (('train.log_every=1',),
               lambda run, workdir: 1 in logged_steps(workdir)),
    'a log boundary': (('train.log_every=2',),
                       lambda run, workdir: 2 in logged_steps(workdir)),
    'an evaluation': (('eval.every=3', 'eval.bleu_examples=40'),
                      lambda run, workdir: 3 in logged_steps(workdir)),
}


@pytest.mark.slow
@pytest.mark.parametrize('moment', MOMENTS)
def test_each_phase_from_sigterm_to_exit_is_timed_and_bounded(
    tmp_path, environment, slow_reference, moment):
  overrides, ready = MOMENTS[moment]
  workdir = fresh_workdir(tmp_path, slow_reference)
  run = slow_run(workdir, dict(environment, JAXFORMER_DEBUG='1'), *overrides)
  run.wait_until(lambda: ready(run, workdir), moment)
  code, seconds = send_sigterm(run)
  assert code == 0, run.output()
  stopped_at(run)
  phases = re.findall(r'jaxformer: SIGTERM \+(\d+\.\d\d) s: (.*)',
                      run.output())
  names = [name for _, name in phases]
  assert names[0].endswith(('finished; saving it', 'saving its step')), names
  assert names[1:] == ['run ended (checkpoint committed, goodput reported)',
                       'exit (the checkpoint is committed: no exit hooks)']
  times = [float(t) for t, _ in phases]
  assert times == sorted(times)
  assert seconds < 2 * step_seconds(slow_reference) + SLACK_SECONDS
