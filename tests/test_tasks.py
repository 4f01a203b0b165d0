"""Classification, regression and language modelling end to end: batches,
training with the one loop, then `jaxformer predict` / `generate`."""
import json
import os

import numpy as np
import pytest

from jaxformer.cli import main as cli
from jaxformer.config.settings import load_config
from jaxformer.data import builtin
from jaxformer.data import sources
from jaxformer.data import labelled, lm_rows, row_layouts, task_batches
from jaxformer.run.trainer import train
from jaxformer.parallel.row_share import RowShare


# ------------------------------------------------------------------- data


def test_builtin_task_examples_label_the_written_number():
  assert builtin.number_of('she bought forty-two red apples .') == 42
  assert builtin.number_of('last week the farmer sold nine thousand one '
                           'hundred three cups .') == 9103
  parity = builtin.task_examples('number_parity', 50, 0, 'dev')
  values = builtin.task_examples('number_value', 50, 0, 'dev')
  for (text, label), (same_text, value) in zip(parity, values):
    number = builtin.number_of(text)
    assert same_text == text
    assert label == ('odd' if number % 2 else 'even')
    assert float(value) == pytest.approx(number / builtin.MAX_NUMBER, abs=1e-6)


def test_label_vocabulary_sorts_names_and_numbers():
  assert row_layouts.label_vocabulary(['pos', 'neg', 'pos']) == ['neg', 'pos']
  assert row_layouts.label_vocabulary(['10', '2', '-1']) == ['-1', '2', '10']


def test_unknown_label_names_the_fix():
  with pytest.raises(sources.DataError, match=r"\['maybe'\].*data.labels"):
    row_layouts.label_ids(['yes', 'maybe'], ['no', 'yes'], 'dev')


def test_bad_regression_value_names_the_line():
  assert row_layouts.parse_values(['0.5 1', '2 -3'], 2, 'train').tolist() == [
      [0.5, 1.0], [2.0, -3.0]]
  with pytest.raises(sources.DataError, match='train example 2.*regression_dim'):
    row_layouts.parse_values(['0.5', 'high'], 1, 'train')


def test_pad_token_rows_cuts_long_texts_to_eos():
  rows = labelled.pad_token_rows([[5, 6, 1], [7, 8, 9, 10, 1]], 4)
  np.testing.assert_array_equal(rows['inputs'], [[5, 6, 1, 0], [7, 8, 9, 1]])
  np.testing.assert_array_equal(rows['inputs_segment_ids'],
                                [[1, 1, 1, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(rows['inputs_positions'],
                                [[0, 1, 2, 0], [0, 1, 2, 3]])


def test_pack_documents_restarts_segments_and_positions():
  rows = lm_rows.pack_documents([[5, 6, 1], [7, 1], [8, 9, 3, 4, 1]], 4)
  np.testing.assert_array_equal(rows['targets'],
                                [[5, 6, 1, 7], [1, 8, 9, 3], [4, 1, 0, 0]])
  np.testing.assert_array_equal(rows['targets_segment_ids'],
                                [[1, 1, 1, 2], [1, 2, 2, 2], [1, 1, 0, 0]])
  np.testing.assert_array_equal(rows['targets_positions'],
                                [[0, 1, 2, 0], [0, 0, 1, 2], [0, 1, 0, 0]])


def _numbered_rows(n):
  return {'labels': np.arange(1, n + 1, dtype=np.int32)}


def test_train_batches_resume_and_shard_by_process():
  rows = _numbered_rows(10)
  full = task_batches.row_train_batches(rows, 4, seed=3)
  first_seven = [next(full)['labels'] for _ in range(7)]
  resumed = task_batches.row_train_batches(rows, 4, seed=3, start_step=5)
  np.testing.assert_array_equal(next(resumed)['labels'], first_seven[5])
  # An epoch is 3 batches (the last completed with empty rows, label 0).
  epoch = np.concatenate(first_seven[:3])
  assert sorted(epoch[epoch > 0]) == list(range(1, 11))
  assert (epoch == 0).sum() == 2
  halves = [next(task_batches.row_train_batches(rows, 4, seed=3, start_step=1,
                                              share=RowShare.of_process(p, 2)))
            for p in range(2)]
  np.testing.assert_array_equal(
      np.concatenate([h['labels'] for h in halves]), first_seven[1])


def test_eval_batches_visit_every_example_once():
  rows = _numbered_rows(7)
  seen = []
  for process in range(2):
    for batch in task_batches.row_eval_batches(
        rows, 4, share=RowShare.of_process(process, 2)):
      real = batch['example_index'] >= 0
      np.testing.assert_array_equal(batch['labels'][real],
                                    batch['example_index'][real] + 1)
      assert (batch['labels'][~real] == 0).all()
      seen += batch['example_index'][real].tolist()
  assert sorted(seen) == list(range(7))


# ------------------------------------------------------- end to end


def _train_losses(config_path, workdir, steps=16):
  config = load_config(config_path, [
      f'train.num_steps={steps}', 'train.log_every=1', 'train.peak_flops=1e9',
      f'checkpoint.every={steps}'])
  final = train(config, str(workdir))
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    losses = [record['loss'] for record in map(json.loads, f)
              if 'loss' in record and 'eval_loss' not in record]
  return losses, final


def _assert_learns(losses):
  assert len(losses) >= 12
  assert np.mean(losses[-4:]) < 0.9 * np.mean(losses[:4]), losses


@pytest.mark.slow
def test_classification_trains_and_predicts(tmp_path, capfd):
  losses, final = _train_losses('configs/classify_quick.py:runlocal', tmp_path)
  _assert_learns(losses)
  assert {'eval_accuracy', 'eval_macro_f1'} <= set(final)
  saved = json.load(open(tmp_path / 'config.json'))
  assert saved['data']['labels'] == ['even', 'odd']
  assert saved['model']['num_classes'] == 2
  texts = tmp_path / 'texts.txt'
  texts.write_text('she bought forty-two red apples .\nhe sold three cars .\n')
  capfd.readouterr()
  assert cli.main(['predict', '--workdir', str(tmp_path),
                   '--input', str(texts)]) == 0
  labels = capfd.readouterr().out.split()
  assert len(labels) == 2 and set(labels) <= {'even', 'odd'}


@pytest.mark.slow
def test_regression_trains_and_predicts(tmp_path, capfd):
  losses, final = _train_losses('configs/regress_quick.py:runlocal', tmp_path)
  _assert_learns(losses)
  assert {'eval_mse', 'eval_pearson'} <= set(final)
  texts = tmp_path / 'texts.txt'
  texts.write_text('she bought forty-two red apples .\n')
  capfd.readouterr()
  assert cli.main(['predict', '--workdir', str(tmp_path),
                   '--input', str(texts)]) == 0
  values = [float(v) for v in capfd.readouterr().out.split()]
  assert len(values) == 1 and np.isfinite(values[0])


@pytest.mark.slow
def test_language_model_trains_and_generates(tmp_path, capfd):
  losses, final = _train_losses('configs/lm_quick.py:runlocal', tmp_path)
  _assert_learns(losses)
  assert 'eval_perplexity' in final
  capfd.readouterr()
  assert cli.main(['generate', '--workdir', str(tmp_path), '--prompt',
                   'yesterday she', '--num', '2', '--temperature', '0',
                   '--max-len', '16']) == 0
  samples = capfd.readouterr().out.strip().split('\n')
  assert len(samples) == 2 and samples[0] == samples[1]  # Greedy: the same.
  assert all(s.startswith('yesterday she') for s in samples)


def test_predict_on_a_language_model_names_the_right_command():
  with pytest.raises(ValueError, match='generate'):
    from jaxformer.inference import predict
    from jaxformer.config.settings import default_config
    config = default_config()
    config.task = 'language_model'
    predict.predict(None, None, config, None, ['text'])
