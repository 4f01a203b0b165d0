"""The trainer's parts: named hooks at boundaries (`run/hooks.py`), the
boundary hooks of a run ('eval', 'checkpoint'), and the result it returns."""
import pathlib

import pytest

from jaxformer.config.settings import load_config
from jaxformer.run.hooks import Boundary, Hooks
from jaxformer.run.metrics import read_metrics

QUICKSTART = str(pathlib.Path(__file__).resolve().parents[2] / 'configs'
                 / 'quickstart.py') + ':runlocal'


def boundary(step: int, last: bool = False, stopping: bool = False):
  return Boundary(step, state=None, metrics={}, last=last, stopping=stopping)


def test_a_hook_runs_at_its_multiples_and_at_the_last_step():
  hooks, ran = Hooks(), []
  hooks.add('every_3', lambda b: ran.append(('every_3', b.step)), every=3)
  hooks.add('at_end', lambda b: ran.append(('at_end', b.step)), every=0)
  assert [s for s in range(1, 10) if hooks.wanted_at(s)] == [3, 6, 9]
  assert hooks.run(boundary(3)) == ['every_3']
  assert hooks.run(boundary(4)) == []
  assert hooks.run(boundary(5, stopping=True)) == []
  assert hooks.run(boundary(7, last=True)) == ['every_3', 'at_end']
  assert ran == [('every_3', 3), ('every_3', 7), ('at_end', 7)]


def test_hooks_run_in_the_order_added_and_see_each_others_metrics():
  hooks = Hooks()
  hooks.add('first', lambda b: b.metrics.update(eval_x=1.0), every=2)
  hooks.add('second', lambda b: b.metrics.update(
      seen=b.metrics.get('eval_x')), every=2)
  at = boundary(4)
  hooks.run(at)
  assert at.metrics == {'eval_x': 1.0, 'seen': 1.0}


def test_a_hook_name_is_used_once_and_every_is_not_negative():
  hooks = Hooks()
  hooks.add('eval', lambda b: None, every=5)
  with pytest.raises(ValueError, match="named 'eval' is already added"):
    hooks.add('eval', lambda b: None, every=5)
  with pytest.raises(ValueError, match='every=-1 is below 0'):
    hooks.add('other', lambda b: None, every=-1)
  assert hooks.names() == ['eval']


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """Six steps of the quick start with a hook of its own every 4 steps;
  eval every 3, a checkpoint every 2, a log line every 5."""
  from jaxformer.run.trainer import Trainer
  workdir = tmp_path_factory.mktemp('hooks')
  config = load_config(QUICKSTART, [
      'train.num_steps=6', 'train.log_every=5', 'eval.every=3',
      'eval.num_batches=1', 'eval.bleu_examples=0', 'checkpoint.every=2',
      'checkpoint.keep=10', 'checkpoint.async_save=False',
      'train.peak_flops=1e9'])  # No CPU peak measured: test_goodput's.
  trainer = Trainer(config, str(workdir))
  assert trainer.hooks.names() == ['eval', 'checkpoint']
  seen = []
  trainer.hooks.add('mine', lambda b: seen.append(
      (b.step, int(b.state.step), b.last, sorted(b.metrics))), every=4)
  return trainer, trainer.train(), seen, workdir


# The fast tier's one training through the trainer (about 15 s).
def test_a_run_calls_its_hooks_and_returns_its_result(trained):
  trainer, result, seen, workdir = trained
  assert result.finished and int(result.state.step) == 6
  assert result.metrics['loss'] > 0 and 'eval_loss' in result.metrics
  # Each boundary's hooks see the metrics logged there and the state of
  # the step; the last step is every hook's.
  assert [(step, state, last) for step, state, last, _ in seen] == [
      (4, 4, False), (6, 6, True)]
  assert 'eval_loss' not in seen[0][3] and 'eval_loss' in seen[1][3]
  # 'checkpoint' saved every 2 steps, 'eval' every 3 (and last) with a save.
  from jaxformer.checkpoints.manager import Checkpointer
  assert Checkpointer.reader(str(workdir)).all_steps() == [2, 3, 4, 6]
  logged = [(r['step'], 'eval_loss' in r) for r in read_metrics(str(workdir))]
  assert logged == [(2, False), (3, False), (3, True), (4, False), (5, False),
                    (6, False), (6, True)]
