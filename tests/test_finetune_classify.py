"""configs/finetune_classify.py and finetune_regress.py: a jaxformer encoder
export (with token types) fine-tuned on TSVs of texts or sentence pairs;
the dev metrics computed exactly from every example's prediction; bad
labels and files refused in one line before any training."""
import base64
import json
import math
import pathlib
import random

import jax
import numpy as np
import pytest
from scipy import stats

from jaxformer.checkpoints import exports as exports_lib
from jaxformer.checkpoints import trained
from jaxformer.inference import predict
from jaxformer.cli import main as cli
from jaxformer.config.settings import load_config
from jaxformer.data import labelled
from jaxformer.data import sources
from jaxformer.data import task_batches
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.run import pretrained
from jaxformer.run.metrics import read_metrics
from jaxformer.run.trainer import Trainer
from jaxformer.train import dev_metrics
from jaxformer.train import run_spec

from test_fault_tolerance import kill_resume_and_compare
from trained_runs import process_output, train_process

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {'classification': str(ROOT / 'configs' / 'finetune_classify.py'),
           'regression': str(ROOT / 'configs' / 'finetune_regress.py')}
QUICK = {'classification': 'classify_quick.py', 'regression':
         'regress_quick.py'}
WORDS = 'one two three four five six seven eight nine ten'.split()


def _text(rng: random.Random) -> str:
  return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))


def write_pairs(path: pathlib.Path, count: int, seed: int, task: str) -> None:
  """Pair lines: 'same' when both texts have as many words (classification),
  or the first's share of the words (regression)."""
  rng, lines = random.Random(seed), []
  for _ in range(count):
    a, b = _text(rng), _text(rng)
    n, m = len(a.split()), len(b.split())
    label = (['other', 'same'][n == m] if task == 'classification'
             else f'{n / (n + m):.4f}')
    lines.append(f'{a}\t{b}\t{label}\n')
  path.write_text(''.join(lines))


def _export(root: pathlib.Path, task: str) -> str:
  """A tiny encoder with token types, freshly initialised, exported with
  the tokenizer trained on the built-in data (its classes: 'even', 'odd')."""
  config = load_config(str(ROOT / 'configs' / QUICK[task]) + ':runlocal',
                       ['model.type_vocab_size=2'])
  tokenizers = tokenizer_lib.get_or_train(config.data, str(root / task))
  run = run_spec.RunSpec.build(config, run_spec.run_mesh(config), tokenizers)
  extra = {'config': json.loads(run.config.to_json_best_effort()),
           'tokenizers': [base64.b64encode(t.serialized_model_proto()).decode()
                          for t in tokenizers]}
  exports_lib.export_params(str(root / f'{task}_export'),
                            run.init_state().params, extra)
  return str(root / f'{task}_export')


class Exports(dict):
  """Each task's export, made when first asked for."""

  def __init__(self, root):
    super().__init__()
    self.root = root

  def __missing__(self, task):
    self[task] = _export(self.root, task)
    return self[task]


@pytest.fixture(scope='module')
def exports(tmp_path_factory):
  root = tmp_path_factory.mktemp('finetune_classify')
  return root, Exports(root)


def overrides(root, export, task, steps=6, **files):
  names = {split: str(root / f'{task}_{split}.tsv') for split in ('train',
                                                                 'dev')}
  names.update(files)
  return [f'init.pretrained={export}', f'data.tsv.train={names["train"]}',
          f'data.tsv.dev={names["dev"]}', f'train.num_steps={steps}',
          'train.warmup_steps=1', 'train.learning_rate=3e-3',
          'train.log_every=1', 'train.peak_flops=1e9', 'eval.every=3',
          'checkpoint.every=3', 'checkpoint.keep=1',
          'checkpoint.async_save=False', 'data.max_source_length=16',
          'data.batch_size=8']


@pytest.fixture(scope='module')
def data(exports):
  """Pair TSVs of each task; classification's labels are not the export's."""
  root, paths = exports
  for task in CONFIGS:
    write_pairs(root / f'{task}_train.tsv', 48, 0, task)
    write_pairs(root / f'{task}_dev.tsv', 20, 1, task)
  # The classifier's head knows 'even' and 'odd': its data is relabelled.
  for split in ('train', 'dev'):
    path = root / f'classification_{split}.tsv'
    path.write_text(path.read_text().replace('\tsame\n', '\teven\n')
                    .replace('\tother\n', '\todd\n'))
  return root, paths


# ------------------------------------------------------------ tokens, rows


@pytest.mark.slow
def test_encode_pair_is_a_then_b_each_ending_with_eos(exports):
  tokenizer = trained.load(exports[1]['classification']).source_tok
  a, b = tokenizer.encode(['three four', 'five'])
  ids, types = tokenizer.encode_pair('three four', 'five')
  assert a[-1] == b[-1] == tokenizer.eos_id
  assert ids == a + b
  assert types == [0] * len(a) + [1] * len(b)


@pytest.mark.slow
def test_predict_rows_of_pairs_and_single_texts_with_our_tokenizer(exports):
  saved = trained.load(exports[1]['classification'])
  tokenizer, model_config = saved.source_tok, saved.model_config
  assert model_config.type_vocab_size
  a, b = tokenizer.encode(['three four', 'five'])
  warnings = []
  rows = predict.encode_rows(tokenizer, model_config,
                             ['three four\tfive', 'three four'], 64,
                             warnings.append)
  assert rows['inputs'][0, :len(a + b)].tolist() == a + b
  assert rows['inputs_token_types'][0, :len(a + b)].tolist() == (
      [0] * len(a) + [1] * len(b))
  assert rows['inputs'][1, :len(a)].tolist() == a
  assert not rows['inputs_token_types'][1].any() and not warnings
  cut = predict.encode_rows(tokenizer, model_config, [' '.join(['six'] * 40)
                                                      + '\tfive'], 8,
                            warnings.append)
  assert cut['inputs'].shape[1] <= 8 and len(warnings) == 1


def test_a_pair_is_cut_longest_first_keeping_each_end():
  ids, types = [10, 11, 12, 13, 1, 20, 21, 1], [0] * 5 + [1] * 3
  assert labelled.cut_pair(ids, types, 8) == (ids, types)
  assert labelled.cut_pair(ids, types, 6) == ([10, 11, 1, 20, 21, 1],
                                              [0, 0, 0, 1, 1, 1])
  # A tie is cut from the second part, as Hugging Face's longest_first.
  assert labelled.cut_pair(ids, types, 5) == ([10, 11, 1, 20, 1],
                                              [0, 0, 0, 1, 1])
  # One type throughout (RoBERTa's): the end is cut, its last token kept.
  assert labelled.cut_pair(ids, [0] * 8, 4) == ([10, 11, 12, 1], [0] * 4)


@pytest.mark.slow
def test_pair_tsv_batches_carry_the_token_types(data):
  root, paths = data
  config = load_config(CONFIGS['classification'], overrides(
      root, paths['classification'], 'classification'))
  config, tokenizers = pretrained.pretrained_start(config)
  batch = next(task_batches.eval_batches(config, *tokenizers, 'dev'))
  texts, labels = labelled.read_split(config.data, 'dev')
  assert isinstance(texts[0], tuple) and labels[0] in ('even', 'odd')
  ids, types = tokenizers[0].encode_pair(*texts[0])
  width = len(ids)
  np.testing.assert_array_equal(batch['inputs'][0, :width], ids)
  np.testing.assert_array_equal(batch['inputs_token_types'][0, :width], types)
  assert (batch['inputs_token_types'][0, width:] == 0).all()
  assert batch['labels'][0] == ['even', 'odd'].index(labels[0])
  # Without a token-type table the batches have none.
  config.model.type_vocab_size = 0
  batch = next(task_batches.eval_batches(config, *tokenizers, 'dev'))
  assert 'inputs_token_types' not in batch


@pytest.mark.slow
def test_a_model_without_labels_gets_a_fresh_head_for_the_datas(
    data, tmp_path):
  """An export without labels (an encoder imported without a head) takes
  the train split's labels and a fresh head of their number; the body is
  the export's."""
  root, paths = data
  start = trained.load(paths['classification'])
  extra, _ = exports_lib.restore_export(paths['classification'])
  extra['config']['data']['labels'] = []
  headless = str(tmp_path / 'headless')
  exports_lib.export_params(headless, start.params, extra)
  train = tmp_path / 'train.tsv'
  train.write_text('one\ttwo\tc\nthree\tfour\ta\nfive\tsix\tb\n')
  config = load_config(CONFIGS['classification'], overrides(
      root, headless, 'classification', train=str(train), dev=str(train)))
  trainer = Trainer(config, str(tmp_path / 'run'))
  try:
    params = trainer.initial_state().params
  finally:
    trainer.checkpoints.close()
  assert trainer.config.data.labels == ['a', 'b', 'c']
  assert params['classifier']['kernel'].shape == (3, 32)
  assert (np.asarray(params['classifier']['bias']) == 0).all()
  for (path, ours), theirs in zip(
      jax.tree_util.tree_leaves_with_path(params['body']),
      jax.tree.leaves(start.params['body'])):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs),
                                  err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------- metrics


def _ranks(values):
  """Average ranks from 1, by counting (the textbook definition)."""
  return [sum(v < x for v in values) + (sum(v == x for v in values) + 1) / 2
          for x in values]


def _correlation(x, y):
  n = len(x)
  mx, my = sum(x) / n, sum(y) / n
  cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
  return cov / math.sqrt(sum((a - mx) ** 2 for a in x)
                         * sum((b - my) ** 2 for b in y))


def test_metrics_equal_their_definitions():
  rng = np.random.default_rng(0)
  predicted, labels = rng.integers(0, 4, 50), rng.integers(0, 3, 50)
  f1s = []
  for c in sorted(set(predicted) | set(labels)):
    tp = sum(p == c == l for p, l in zip(predicted, labels))
    f1s.append(2 * tp / (sum(predicted == c) + sum(labels == c)))
  assert dev_metrics.macro_f1(predicted, labels) == pytest.approx(
      sum(f1s) / len(f1s), abs=1e-15)
  assert dev_metrics.accuracy(predicted, labels) == sum(
      predicted == labels) / 50
  x = rng.normal(size=40).round(1)  # Ties among the ranks.
  y = (x + rng.normal(size=40)).round(1)
  assert dev_metrics.pearson(x, y) == pytest.approx(
      _correlation(list(x), list(y)), abs=1e-12)
  assert dev_metrics.spearman(x, y) == pytest.approx(
      _correlation(_ranks(list(x)), _ranks(list(y))), abs=1e-12)
  assert dev_metrics.spearman(x, y) == pytest.approx(
      stats.spearmanr(x, y).statistic, abs=1e-12)
  np.testing.assert_array_equal(dev_metrics.average_ranks(x),
                                stats.rankdata(x))
  assert dev_metrics.pearson(np.ones(5), np.arange(5)) == 0.0


# -------------------------------------------------------------- fine-tune


def _finetune(data, task, tmp_path, **files):
  root, paths = data
  workdir = tmp_path / task
  Trainer(load_config(CONFIGS[task], overrides(root, paths[task], task,
                                               **files)),
          str(workdir)).run()
  return workdir


def _dev_rows(workdir):
  """The dev split's predictions by the latest checkpoint, and its labels."""
  model = trained.load(str(workdir))
  rows = task_batches.task_rows(model.config, 'dev', model.source_tok)
  outputs = model.task.model(model.model_config).apply(
      {'params': model.params}, rows['inputs'],
      inputs_token_types=rows['inputs_token_types'])
  return np.asarray(outputs), rows


@pytest.mark.slow
@pytest.mark.parametrize('task', list(CONFIGS))
def test_a_pair_finetune_reports_exact_dev_metrics(data, tmp_path, task):
  workdir = _finetune(data, task, tmp_path)
  records = read_metrics(str(workdir))
  last = [r for r in records if 'eval_loss' in r][-1]
  outputs, batch = _dev_rows(workdir)
  if task == 'classification':
    predicted, labels = outputs.argmax(-1).tolist(), batch['labels'].tolist()
    assert last['eval_accuracy'] == sum(
        p == l for p, l in zip(predicted, labels)) / len(labels)
    assert last['eval_macro_f1'] == pytest.approx(dev_metrics.macro_f1(
        np.array(predicted), np.array(labels)), abs=1e-12)
  else:
    x, y = list(outputs[:, 0]), list(batch['values'][:, 0])
    assert last['eval_pearson'] == pytest.approx(_correlation(x, y), abs=1e-6)
    assert last['eval_spearman'] == pytest.approx(
        _correlation(_ranks(x), _ranks(y)), abs=1e-6)
  # The best step by the dev metric is kept beside the latest.
  metric = {'classification': 'eval_accuracy',
            'regression': 'eval_spearman'}[task]
  evals = {r['step']: r[metric] for r in records if metric in r}
  assert sorted(evals) == [3, 6]
  kept = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir()
                if p.name.isdigit())
  assert kept == ([3, 6] if evals[3] > evals[6] else [6])
  tuned, start = trained.load(str(workdir)), trained.load(data[1][task])
  assert tuned.config.data.labels == start.config.data.labels
  types = [np.asarray(p) for path, p in jax.tree_util.tree_leaves_with_path(
      tuned.params) if "'token_types'" in jax.tree_util.keystr(path)]
  assert len(types) == 1 and types[0].shape == (2, 32)


# -------------------------------------------------------------- bad input


def _error(capfd, data, tmp_path, task, extra=(), **files):
  root, paths = data
  code = cli.main(['train', '--config', CONFIGS[task], '--workdir',
                   str(tmp_path / 'run')] + [
      f'--config.{o}' for o in overrides(root, paths[task], task, **files)]
                  + list(extra))
  err = capfd.readouterr().err.strip().splitlines()
  assert code == 1
  return err[-1]


@pytest.mark.slow
def test_a_label_the_pretrained_head_lacks_is_named(data, tmp_path, capfd):
  root = data[0]
  dev = root / 'classification_dev.tsv'
  bad = tmp_path / 'dev.tsv'
  lines = dev.read_text().splitlines(keepends=True)
  bad.write_text(''.join(lines[:3]) + 'one\ttwo\tmaybe\n' + ''.join(lines[3:]))
  line = _error(capfd, data, tmp_path, 'classification', dev=str(bad))
  assert "example 4: label 'maybe' is not one of the labels ['even', 'odd']" \
      in line and data[1]['classification'] in line
  assert not (tmp_path / 'run' / 'checkpoints').exists() or not list(
      (tmp_path / 'run' / 'checkpoints').iterdir())


@pytest.mark.slow
def test_mixed_column_counts_are_refused_naming_the_line(
    data, tmp_path, capfd):
  bad = tmp_path / 'train.tsv'
  bad.write_text('one two\tthree\teven\nfour\todd\n')
  line = _error(capfd, data, tmp_path, 'classification', train=str(bad))
  assert line.startswith('jaxformer train: error: ')
  assert f'{bad}:2: 2 column(s), but line 1 has 3' in line
  with pytest.raises(sources.DataError, match=r':1: 4 column\(s\)'):
    bad.write_text('a\tb\tc\td\n')
    labelled.read_split(load_config(CONFIGS['classification'], [
        f'data.tsv.train={bad}']).data, 'train')


def test_a_best_metric_the_task_lacks_is_refused(data, tmp_path, capfd):
  line = _error(capfd, data, tmp_path, 'classification',
                ['--config.checkpoint.best_metric=spearman'])
  assert ("checkpoint.best_metric='spearman' is not a metric of task "
          "'classification': choose one of ['loss', 'nll', 'perplexity', "
          "'accuracy', 'macro_f1']") in line


# ----------------------------------------------------------------- resume


@pytest.mark.slow
def test_a_killed_pair_finetune_resumes_bitwise(data, tmp_path,
                                               process_environment):
  """SIGKILL after a checkpoint, then the same command: the metrics (the
  dev evaluations too) and the parameters equal an uninterrupted run's."""
  root, paths = data
  steps = 10
  flags = [f'--config.{o}' for o in overrides(
      root, paths['classification'], 'classification', steps)] + [
          '--config.checkpoint.every=2', '--config.checkpoint.keep=10',
          '--config.eval.every=4']
  got = kill_resume_and_compare(
      lambda workdir: train_process(workdir, CONFIGS['classification'], flags,
                                    process_environment),
      process_output, tmp_path, steps)
  assert any('eval_macro_f1' in record for record in got)
