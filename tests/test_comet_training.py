"""eval.comet: training scores the dev sentences it decodes for BLEU with a
COMET checkpoint folder too (eval_comet, eval_ema_comet with an average of
the parameters), equal to `comet_scores.corpus_report` of the same
translations computed apart; checkpoint.best_metric='comet' keeps the best
checkpoint by it; the test split's report adds COMET. A config that asks
for COMET where none can be computed, or a folder that is not a COMET
checkpoint, is refused in one line before any training."""
import json
import pathlib
import sys

import pytest

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.checkpoints import trained
from jaxformer.config.settings import load_config
from jaxformer.data import sources
from jaxformer.inference import evaluate
from jaxformer.run.metrics import read_metrics
from jaxformer.run.trainer import Trainer
from trained_runs import NO_PEAK, REPO, QUICKSTART, train

STEPS, EVERY, EXAMPLES = 8, 2, 8
RUN_FLAGS = [f'--config.train.num_steps={STEPS}',
             '--config.train.log_every=2', f'--config.eval.every={EVERY}',
             f'--config.checkpoint.every={EVERY}', '--config.checkpoint.keep=1',
             f'--config.eval.bleu_examples={EXAMPLES}',
             '--config.data.builtin.num_test=8',
             '--config.eval.show_examples=0', '--config.train.ema_decay=0.9',
             NO_PEAK]


@pytest.fixture(scope='module')
def comet_folder(tmp_path_factory) -> str:
  """A random-weight wmt22-comet-da-like folder (regression_metric)."""
  for module in ('torch', 'transformers', 'comet'):
    pytest.importorskip(module)
  sys.path.insert(0, str(pathlib.Path(__file__).parent / 'interop'))
  import comet_folders  # pylint: disable=import-outside-toplevel
  folder = str(tmp_path_factory.mktemp('comet') / 'comet-da')
  comet_folders.write_checkpoint(folder)
  return folder


def direct_comet(workdir: str, step: int, weights: str, folder: str) -> float:
  """COMET of the dev sentences decoded as the evaluator decodes them
  (greedy, the first bleu_examples) with the `weights` of `step`, scored
  by `corpus_report` directly."""
  from jaxformer.interop import comet, comet_scores
  model = trained.load(workdir, step, weights)
  _, hypotheses = evaluate.decode_split(
      model.params, model.model_config, model.config, model.source_tok,
      model.target_tok, 'dev', trained.local_mesh(), max_examples=EXAMPLES,
      beam_size=1)
  pairs = sources.read_split(model.config.data, 'dev')[:EXAMPLES]
  return comet_scores.corpus_report(
      comet.load(folder), [source for source, _ in pairs], hypotheses,
      [target for _, target in pairs])['comet']


# 'min' too: as the tiny model learns, its last step tends to score best,
# and the best checkpoint kept beside the last is then the last itself.
@pytest.mark.slow
@pytest.mark.parametrize('mode, pick', [('max', max), ('min', min)])
def test_training_keeps_the_checkpoint_of_the_best_comet(
    comet_folder, tmp_path, capfd, mode, pick):
  workdir = str(tmp_path / 'run')
  assert train(workdir, *RUN_FLAGS, f'--config.eval.comet={comet_folder}',
               '--config.checkpoint.best_metric=comet',
               f'--config.checkpoint.best_mode={mode}') == 0
  evals = {row['step']: row for row in read_metrics(workdir)
           if 'eval_loss' in row}
  assert sorted(evals) == list(range(EVERY, STEPS + 1, EVERY))
  comets = {step: row['eval_comet'] for step, row in evals.items()}
  assert all('eval_ema_comet' in row for row in evals.values())
  assert len(set(comets.values())) > 1, comets  # A real choice.
  best = pick(comets, key=comets.get)
  kept = checkpoint_lib.Checkpointer.reader(workdir).all_steps()
  assert sorted(kept) == sorted({best, STEPS}), (kept, comets)
  for weights, key in (('raw', 'eval_comet'), ('ema', 'eval_ema_comet')):
    assert direct_comet(workdir, best, weights, comet_folder) == (
        pytest.approx(evals[best][key], abs=1e-5))
  scores = json.loads((tmp_path / 'run' / 'test_scores.json').read_text())
  assert {'bleu', 'chrf', 'comet'} <= set(scores)
  assert f'COMET {scores["comet"]:.4f}' in capfd.readouterr().out


def refused(tmp_path, capfd, *flags: str) -> str:
  """The one line of error of a train command with `flags`, which must
  fail before any training."""
  assert train(tmp_path / 'run', *flags, NO_PEAK) == 1
  out, err = capfd.readouterr()
  assert 'Training steps' not in out
  lines = err.strip().splitlines()
  assert len(lines) == 1, err
  return lines[0]


def test_best_metric_comet_without_eval_comet_is_refused(tmp_path, capfd):
  line = refused(tmp_path, capfd, '--config.checkpoint.best_metric=comet')
  assert "checkpoint.best_metric='comet' needs eval.comet" in line
  assert 'set eval.comet to a COMET checkpoint folder' in line


@pytest.mark.parametrize('flags, said', [
    (['--config.task=language_model'], "task='language_model' does not "
     'translate: unset eval.comet'),
    (['--config.eval.bleu_examples=0'], 'set eval.bleu_examples > 0'),
])
def test_eval_comet_where_nothing_is_translated_is_refused(
    tmp_path, capfd, flags, said):
  line = refused(tmp_path, capfd, f'--config.eval.comet={tmp_path}', *flags)
  assert f'eval.comet={str(tmp_path)!r}' in line and said in line


def test_a_folder_that_is_not_a_comet_checkpoint_is_refused(tmp_path,
                                                           capfd):
  folder = tmp_path / 'not-comet'
  folder.mkdir()
  line = refused(tmp_path, capfd, f'--config.eval.comet={folder}')
  assert f'eval.comet {folder}: no hparams.yaml' in line
  assert not (tmp_path / 'run' / 'checkpoints').exists()


def test_a_trainer_given_eval_comet_and_no_scorer_is_refused(tmp_path):
  config = load_config(str(REPO / QUICKSTART),
                       [f'--config.eval.comet={tmp_path}'])
  with pytest.raises(ValueError, match='no scorer was passed: give the run '
                     r'one, Trainer\(config, workdir, scorer='):
    Trainer(config, str(tmp_path / 'run'))
