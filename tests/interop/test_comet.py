"""COMET in JAX (`jaxformer evaluate --comet DIR`): on random-weight
checkpoint folders that Unbabel's `comet` builds and saves
(comet_folders.py), jaxformer's sentence scores equal `comet`'s `predict`
within 1e-4, with a reference (regression_metric, wmt22-comet-da's class;
the unified metric with a reference) and without (referenceless_regression
_metric; unified_metric as CometKiwi), sentences longer than the encoder's
positions included; `evaluate` puts them in its JSON beside BLEU
and chrF; a folder that is not a COMET checkpoint is refused in one line
naming what is missing."""
import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('comet', reason='unbabel-comet (the reference)')

import comet_folders  # noqa: E402
import hf_tokenizer_folders  # noqa: E402
import random_run  # noqa: E402

from jaxformer.cli import main as cli  # noqa: E402
from jaxformer.interop import comet, comet_scores  # noqa: E402
from jaxformer.storage import errors  # noqa: E402

# name -> (class_identifier, hparams): wmt22-comet-da's class; QE; CometKiwi
# (wmt22-cometkiwi-da's input segments and sparsemax); the unified metric
# with a reference (the mean of its three scores).
MODELS = {
    'comet-da': ('regression_metric', {}),
    'comet-qe': ('referenceless_regression_metric',
                 dict(pool='max', layer_norm=False, activations='Softplus')),
    'cometkiwi': ('unified_metric', dict(
        input_segments=['mt', 'src'], layer_transformation='sparsemax',
        final_activation='Sigmoid')),
    'unified-ref': ('unified_metric', dict(
        input_segments=['mt', 'src', 'ref'], layer_transformation='softmax')),
}


def samples(count: int = 20) -> list[dict]:
  """Source, translation and reference triples: an empty translation, and
  a source longer than the encoder's 36 tokens (cut as comet cuts)."""
  texts = hf_tokenizer_folders.training_texts(count + 2, seed=5)
  rows = [dict(src=texts[i], mt=texts[i + 1], ref=texts[i + 2])
          for i in range(count)]
  rows[0]['mt'] = ''
  rows[1]['src'] = ' '.join(texts[:12])
  return rows


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """name -> a COMET folder of MODELS[name]."""
  made = {}
  for seed, (name, (kind, hparams)) in enumerate(MODELS.items()):
    made[name] = str(tmp_path_factory.mktemp(name) / 'comet')
    comet_folders.write_checkpoint(made[name], kind, seed, **hparams)
  return made


@pytest.mark.slow
@pytest.mark.parametrize('name', MODELS)
def test_scores_equal_comet_predict(folders, name, monkeypatch):
  rows = samples()
  model = comet.load(folders[name])
  assert model.kind == MODELS[name][0]
  ours = comet_scores.sentence_scores(
      model, [r['src'] for r in rows], [r['mt'] for r in rows],
      [r['ref'] for r in rows], batch_size=8)
  theirs = comet_folders.comet_scores(folders[name], rows, monkeypatch)
  np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
  assert np.std(ours) > 1e-3  # Sentences' scores differ: a real check.


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """(a random-weight translation workdir, its config)."""
  return random_run.one_step_run(tmp_path_factory)


@pytest.mark.slow
def test_evaluate_prints_comet_beside_bleu(folders, run, tmp_path, capsys,
                                           monkeypatch):
  workdir, config = run
  hypotheses = str(tmp_path / 'hypotheses.txt')
  folder = folders['comet-da']
  assert cli.main(['evaluate', '--workdir', workdir, '--beam', '1',
                   '--comet', folder, '--hypotheses', hypotheses]) == 0
  report = json.loads(capsys.readouterr().out)
  assert {'bleu', 'chrf', 'comet', 'comet_sentences'} <= set(report)
  assert report['comet_model'] == 'regression_metric'
  with open(hypotheses, encoding='utf-8') as f:
    translations = f.read().split('\n')[:-1]
  from jaxformer.data import sources
  pairs = sources.read_split(config.data, 'test')
  rows = [dict(src=s, mt=mt, ref=r) for (s, r), mt in zip(pairs, translations)]
  theirs = comet_folders.comet_scores(folder, rows, monkeypatch)
  np.testing.assert_allclose(report['comet_sentences'], theirs, atol=1e-4,
                             rtol=0)
  assert report['comet'] == pytest.approx(np.mean(theirs), abs=1e-4)


def _copy_without(folders, tmp_path, name: str) -> str:
  copy = str(tmp_path / 'copy')
  shutil.copytree(folders['comet-da'], copy)
  target = os.path.join(copy, name)
  (shutil.rmtree if os.path.isdir(target) else os.remove)(target)
  return copy


@pytest.mark.slow
@pytest.mark.parametrize('missing, said', [
    ('hparams.yaml', 'no hparams.yaml'),
    ('checkpoints', 'no checkpoints/model.ckpt'),
    ('encoder', 'is not a local folder with config.json'),
    ('encoder/config.json', 'is not a local folder with config.json'),
])
def test_a_folder_that_is_not_a_comet_checkpoint_is_refused(
    folders, tmp_path, capsys, missing, said):
  copy = _copy_without(folders, tmp_path, missing)
  if missing.startswith('encoder'):  # pretrained_model names the original.
    with open(os.path.join(copy, 'hparams.yaml')) as f:
      text = f.read()
    with open(os.path.join(copy, 'hparams.yaml'), 'w') as f:
      f.write(text.replace(folders['comet-da'], copy))
  assert cli.main(['evaluate', '--workdir', str(tmp_path / 'none'),
                   '--comet', copy]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and said in err[0], err


def test_a_folder_of_another_model_is_refused(tmp_path):
  assert issubclass(comet.CometError, errors.InteropError)
  (tmp_path / 'hparams.yaml').write_text('class_identifier: xcomet_metric\n')
  with pytest.raises(comet.CometError, match='class_identifier'):
    comet.load(str(tmp_path))
  with pytest.raises(comet.CometError, match='no such folder'):
    comet.load(str(tmp_path / 'absent'))
