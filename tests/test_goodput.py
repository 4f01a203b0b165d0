"""Where a run's time goes (run/goodput.py), its step traces
(train.profile_steps) and the chips' peak FLOP/s, on one tiny run that is
stopped at step 6 and resumed to step 10 (a third start, after the run
finished, trains nothing)."""
import contextlib
import glob
import io
import json
import pathlib
import re
import time

import pytest

from jaxformer.config.settings import ConfigError, load_config
from jaxformer.run import goodput as goodput_lib
from jaxformer.run.metrics import read_metrics
from jaxformer.run.signals import StopRequested
from jaxformer.run.trainer import Trainer
from jaxformer.train import flops
from user_commands import REPO, jaxformer

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py') + ':runlocal'
COMMON = ('train.peak_flops=1e9', 'train.num_steps=10', 'train.log_every=2',
          'checkpoint.every=4', 'eval.every=4', 'eval.bleu_examples=2',
          'eval.num_batches=1', 'eval.final_split=')
CAUSES = [f'time_{k}' for k in goodput_lib.CAUSES + ('train',)]


class StopAt(StopRequested):
  """A SIGTERM that arrives at `step`."""

  def __init__(self, step: int):
    super().__init__()
    self.step = step

  def at(self, step, checkpoints) -> bool:
    if step == self.step:
      self.signal_name = 'SIGTERM'
    return self.signal_name is not None


def timed_run(workdir, *overrides, stop=None):
  """(final metrics, seconds from set-up to return, printed text)."""
  config = load_config(CONFIG, COMMON + overrides)
  out, start = io.StringIO(), time.monotonic()
  with contextlib.redirect_stdout(out):
    final = Trainer(config, str(workdir)).run(stop)
  return final, time.monotonic() - start, out.getvalue()


def trace_files(workdir) -> list[str]:
  return glob.glob(f'{workdir}/profile/**/*.xplane.pb', recursive=True)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('goodput')
  first = timed_run(workdir, 'train.profile_steps=2:3', stop=StopAt(6))
  traces = trace_files(workdir)
  stopped = time.time()
  time.sleep(1.0)
  resumed = timed_run(workdir)
  again = timed_run(workdir)
  return dict(workdir=workdir, first=first, traces=traces, stopped=stopped,
              resumed=resumed, again=again)


@pytest.mark.slow
def test_fields_sum_to_the_wall_time_in_metrics_and_summary(runs):
  for final, seconds, printed in (runs['first'], runs['resumed']):
    assert set(CAUSES) <= set(final)
    assert sum(final[k] for k in CAUSES) == pytest.approx(
        final['time_wall'], rel=0.01)
    this_run = final['time_wall'] - final['time_restarts']
    assert this_run == pytest.approx(seconds, rel=0.01)
    assert final['goodput'] == pytest.approx(
        final['time_train'] / final['time_wall'])
    assert 0 < final['goodput'] < 1
    assert final['time_compile'] > 0 and final['time_startup'] > 0
    assert final['time_checkpoint'] > 0 and final['time_eval'] > 0
    assert final['time_input'] > 0
    assert f'Goodput {100 * final["goodput"]:.1f}% of' in printed
  records = [r for r in read_metrics(str(runs['workdir'])) if 'loss' in r]
  assert all('goodput' in r and 'time_compile' in r for r in records)
  first = records[0]
  assert sum(first[k] for k in CAUSES) == pytest.approx(first['time_wall'],
                                                        rel=0.01)


@pytest.mark.slow
def test_restart_loss_is_counted_after_a_stop_and_resume(runs):
  first, resumed, again = (runs[k][0] for k in ('first', 'resumed', 'again'))
  assert first['time_restarts'] == 0
  lost = resumed['time_restarts']
  record = json.loads((runs['workdir'] / 'goodput.json').read_text())
  # From the save of step 6 to the resumed run's first step: the first
  # run's end after that save (seconds on a loaded machine), the 1 s pause,
  # and the resumed run's start.
  after_save = runs['stopped'] - record['saved']['6']
  assert 1.0 + after_save <= lost <= 1.0 + after_save + runs['resumed'][1]
  assert 'training steps 7-10' in runs['resumed'][2].lower()
  # The resumed run finished: the next start loses nothing.
  assert again['time_restarts'] == pytest.approx(lost)
  assert len(record['starts']) == 3 and record['finished']
  assert {'4', '6', '8', '10'} <= set(record['saved'])


@pytest.mark.slow
def test_profile_steps_write_a_trace_only_when_asked(runs):
  assert len(runs['traces']) == 1
  assert glob.glob(f'{runs["workdir"]}/profile/**/perfetto_trace.json.gz',
                   recursive=True)
  assert trace_files(runs['workdir']) == runs['traces']  # None added later.


@pytest.mark.parametrize('value', ['3:2', '0:2', '5', 'a:b', '2:'])
def test_bad_profile_steps_are_refused(value):
  with pytest.raises(ConfigError, match='train.profile_steps=.*0 < A <= B'):
    load_config(CONFIG, [f'train.profile_steps={value}'])


def test_peak_flops_of_chips():
  assert flops.device_peak_flops('TPU v5 lite') == 197e12
  assert flops.device_peak_flops('TPU v5p') == 459e12
  assert flops.device_peak_flops('TPU v4') == 275e12
  assert flops.device_peak_flops('NVIDIA H100 80GB HBM3') == 989e12
  assert flops.device_peak_flops('NVIDIA H100 PCIe') == 756e12
  assert flops.device_peak_flops('cpu') is None


@pytest.mark.slow
def test_the_quick_starts_cpu_mfu_is_against_a_peak_it_stays_below(tmp_path):
  """The quick start's model and batches as a user runs them (one CPU
  device), for fewer steps: the measured peak is printed once, with its
  value, and the MFU against it is a possible one."""
  out = jaxformer(
      tmp_path, 'train', '--config', str(REPO / 'configs/quickstart.py'),
      '--workdir', 'run', '--config.train.num_steps=60',
      '--config.train.warmup_steps=20', '--config.train.log_every=20',
      '--config.eval.every=0', '--config.eval.bleu_examples=0',
      '--config.eval.final_split=', '--config.checkpoint.every=60',
      '--config.data.builtin.num_train=5000')
  peaks = re.findall(r'MFU is against ([\d,.]+) GFLOP/s per device, '
                     r'measured on this cpu', out, flags=re.IGNORECASE)
  assert len(peaks) == 1, out
  assert float(peaks[0].replace(',', '')) > 0
  mfu = float(re.search(r'MFU ([\d.]+)% in the last log window',
                        out).group(1))
  assert 0 < mfu < 100, out
