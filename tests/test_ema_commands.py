"""The moving average of the parameters in the commands: `export` and
`average` write it, `translate` and `evaluate` use it where a run keeps one
(`--weights ema|raw`), and training evaluates it beside the parameters."""
import json

import jax
import numpy as np
import pytest

from jaxformer.checkpoints import trained
from jaxformer.cli import main as cli
from jaxformer.run.metrics import read_metrics

import random_run
from random_run import CONFIG, as_numpy


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A workdir whose steps 1 and 2 keep an average that differs from the
  parameters (average = parameters + step); returns (workdir, parameters)."""
  tok = random_run.tokenizer(tmp_path_factory.mktemp('tokenizer'))
  config = random_run.config_for(tok, ema_decay=0.99)
  state = random_run.random_state(config)
  workdir = random_run.save_steps(
      tmp_path_factory.mktemp('ema_run'), config, tok,
      {step: state.replace(ema=jax.tree.map(lambda e, s=step: e + s,
                                            state.ema))
       for step in (1, 2)})
  return workdir, as_numpy(state.params)


def assert_params(got, want, shift: float):
  for a, b in zip(jax.tree.leaves(as_numpy(got)), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b + shift, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_commands_use_the_average_where_a_run_keeps_one(run):
  workdir, params = run
  model = trained.load(workdir)
  assert model.weights == 'ema'
  assert_params(model.params, params, 2.0)
  raw = trained.load(workdir, weights='raw')
  assert raw.weights == 'raw'
  assert_params(raw.params, params, 0.0)


@pytest.mark.slow
def test_export_and_average_write_the_average(run, tmp_path, capsys):
  workdir, params = run
  assert cli.main(['export', '--workdir', workdir,
                   '--out', str(tmp_path / 'ema')]) == 0
  assert cli.main(['export', '--workdir', workdir, '--weights', 'raw',
                   '--out', str(tmp_path / 'raw')]) == 0
  assert cli.main(['average', '--workdir', workdir, '--last', '2',
                   '--out', str(tmp_path / 'mean')]) == 0
  ema = trained.load(str(tmp_path / 'ema'))
  assert ema.weights == 'ema'
  assert_params(ema.params, params, 2.0)
  assert_params(trained.load(str(tmp_path / 'raw')).params, params, 0.0)
  mean = trained.load(str(tmp_path / 'mean'))
  assert mean.weights == 'ema'
  assert_params(mean.params, params, 1.5)
  capsys.readouterr()
  assert cli.main(['translate', '--workdir', str(tmp_path / 'raw'),
                   '--weights', 'ema']) == 1
  assert ('--weights ema: the export ' in capsys.readouterr().err)


@pytest.mark.slow
def test_evaluate_says_which_weights_it_used(run, capsys):
  workdir, _ = run
  for flags, weights in (([], 'ema'), (['--weights', 'raw'], 'raw')):
    assert cli.main(['evaluate', '--workdir', workdir, '--beam', '1',
                     *flags]) == 0
    assert json.loads(capsys.readouterr().out)['weights'] == weights


@pytest.mark.slow
def test_training_evaluates_the_average_beside_the_parameters(tmp_path,
                                                              capfd):
  workdir = str(tmp_path / 'run')
  assert cli.main(['train', '--config', CONFIG, '--workdir', workdir,
                   '--config.train.num_steps=4', '--config.train.log_every=2',
                   '--config.eval.every=2', '--config.eval.bleu_examples=4',
                   '--config.eval.final_split=', '--config.train.ema_decay=0.9',
                   '--config.train.peak_flops=1e9']) == 0
  evals = [row for row in read_metrics(workdir) if 'eval_loss' in row]
  assert len(evals) == 2
  for row in evals:
    assert {'eval_ema_loss', 'eval_ema_bleu', 'eval_bleu'} <= set(row)
  assert evals[0]['eval_ema_loss'] != evals[0]['eval_loss']
  capfd.readouterr()
  assert cli.main(['evaluate', '--workdir', workdir, '--beam', '1']) == 0
  assert json.loads(capfd.readouterr().out)['weights'] == 'ema'
