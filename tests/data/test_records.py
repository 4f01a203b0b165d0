"""JSONL and Parquet sources (data/records.py, source_pieces.py): every task
reads them, plain or .gz, by glob, with configurable field names; a bad
line, a missing field or a wrong type is one error line naming the file,
the line (or row group) and the field."""
import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxformer.data import labelled
from jaxformer.data import lm_rows
from jaxformer.data import sources
from jaxformer.data import row_layouts
from jaxformer.data import token_cache

from test_row_cache import PAIRS, TEXTS, all_rows, assert_same, run_config


def write_jsonl(path, records, compress=False):
  text = ''.join(json.dumps(record) + '\n' for record in records)
  if compress:
    with gzip.open(path, 'wt', encoding='utf-8') as f:
      f.write(text)
  else:
    path.write_text(text, encoding='utf-8')
  return path


def write_parquet(path, records, group_rows=50):
  pq.write_table(pa.Table.from_pylist(records), path,
                 row_group_size=group_rows)
  return path


def packed(tok, texts=TEXTS):
  return lm_rows.pack_documents(lm_rows.document_ids(tok, texts), 12)


@pytest.mark.parametrize('source', ['jsonl', 'parquet'])
def test_documents_in_shards_named_by_a_glob(tmp_path, tok, source):
  records = [{'text': text, 'id': i} for i, text in enumerate(TEXTS)]
  for part, start in enumerate((0, 70)):
    chunk = records[start:start + 70]
    if source == 'jsonl':
      write_jsonl(tmp_path / f'part-{part}.jsonl.gz', chunk, compress=True)
    else:
      write_parquet(tmp_path / f'part-{part}.parquet', chunk, group_rows=30)
  pattern = tmp_path / ('part-*.jsonl.gz' if source == 'jsonl' else
                        'part-*.parquet')
  config = run_config('language_model', source, pattern)
  assert_same(all_rows(config, tok, tmp_path / 'cache'), packed(tok))


def test_prompt_response_fields_under_other_keys(tmp_path, tok):
  path = write_jsonl(tmp_path / 'chat.jsonl', [
      {'q': {'text': s}, 'a': t} for s, t in PAIRS])
  config = run_config('language_model', 'jsonl', path,
                      lm_rows='prompt_response')
  config.data.jsonl.prompt, config.data.jsonl.response = 'q.text', 'a'
  expected = lm_rows.language_model_rows(
      config.data, TEXTS, [t for _, t in PAIRS], 'train', tok)
  assert_same(all_rows(config, tok, tmp_path / 'cache'), expected)


@pytest.mark.parametrize('source', ['jsonl', 'parquet'])
def test_classes_of_texts_and_of_sentence_pairs(tmp_path, tok, source):
  write = write_jsonl if source == 'jsonl' else write_parquet
  labels = [i % 3 for i in range(len(PAIRS))]  # Numbers are class names.
  single = write(tmp_path / f'single.{source}', [
      {'text': s, 'label': label} for (s, _), label in zip(PAIRS, labels)])
  pairs = write(tmp_path / f'pairs.{source}', [
      {'text_a': s, 'text_b': t, 'label': label}
      for (s, t), label in zip(PAIRS, labels)])
  for path, texts in ((single, TEXTS), (pairs, PAIRS)):
    config = run_config('classification', source, path)
    assert row_layouts.labels_of(config.data) == ['0', '1', '2']
    config.data.labels = ['0', '1', '2']
    ids, types = labelled.encode(tok, texts, 12)
    expected = labelled.pad_token_rows(ids, 12)
    expected['labels'] = np.array(labels, np.int32)
    assert_same(all_rows(config, tok, tmp_path / 'cache'), expected)


def test_regression_values_as_numbers_or_lists(tmp_path, tok):
  path = write_parquet(tmp_path / 'values.parquet', [
      {'text': s, 'label': [i / 4, -i]} for i, s in enumerate(TEXTS)])
  config = run_config('regression', 'parquet', path)
  config.model.regression_dim = 2
  rows = all_rows(config, tok, tmp_path / 'cache')
  np.testing.assert_allclose(rows['values'][5], [1.25, -5])


def test_hugging_face_translation_records_are_pairs(tmp_path):
  path = write_jsonl(tmp_path / 'wmt.jsonl', [
      {'translation': {'en': s, 'de': t}} for s, t in PAIRS[:5]])
  config = run_config('translation', 'jsonl', path)
  assert sources.read_split(config.data, 'train') == PAIRS[:5]
  config.data.jsonl.source_language = 'de'
  config.data.jsonl.target_language = 'en'
  assert sources.read_split(config.data, 'train')[0] == PAIRS[0][::-1]
  assert token_cache.cache_key(config.data, 'train', *[_Tok()] * 2)


class _Tok:
  def serialized_model_proto(self):
    return b'model'


@pytest.mark.parametrize('content, problem', [
    ('{"text": "one"}\n{"text": "two"\n', r'bad.jsonl:2: not valid JSON'),
    ('{"text": "one"}\n\n["two"]\n', r'bad.jsonl:3: a JSON list, not an '
     'object'),
    ('{"text": "one"}\n{"body": "two"}\n', r"bad.jsonl:2: no field 'text' "
     r"\(text\).*data.<source>.text"),
    ('{"text": "one"}\n{"text": 2}\n', r"bad.jsonl:2: field 'text' \(text\) "
     'is a int, not a string'),
])
def test_malformed_jsonl_is_one_line_naming_file_line_and_field(
    tmp_path, tok, content, problem):
  path = tmp_path / 'bad.jsonl'
  path.write_text(content * 1, encoding='utf-8')
  config = run_config('language_model', 'jsonl', path)
  with pytest.raises(sources.DataError, match=problem) as error:
    all_rows(config, tok, tmp_path / 'cache')
  assert '\n' not in str(error.value)


def test_a_line_number_counts_the_lines_of_earlier_pieces(tmp_path, tok):
  lines = [json.dumps({'text': text}) for text in TEXTS]
  lines[100] = lines[100].replace('"text"', '"words"')
  path = tmp_path / 'big.jsonl'
  path.write_text('\n'.join(lines) + '\n', encoding='utf-8')
  config = run_config('language_model', 'jsonl', path)
  with pytest.raises(sources.DataError, match=r"big.jsonl:101: no field"):
    all_rows(config, tok, tmp_path / 'cache')


def test_invalid_utf8_names_the_line(tmp_path, tok):
  path = tmp_path / 'latin.jsonl'
  path.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
  config = run_config('language_model', 'jsonl', path)
  with pytest.raises(sources.DataError, match=r'latin.jsonl:2: invalid UTF-8'):
    all_rows(config, tok, tmp_path / 'cache')


def test_a_parquet_column_of_the_wrong_type_names_the_row_group(tmp_path,
                                                                 tok):
  path = write_parquet(tmp_path / 'bad.parquet', [
      {'text': s, 'label': 'x'} for s in TEXTS], group_rows=50)
  config = run_config('regression', 'parquet', path)
  with pytest.raises(sources.DataError, match=r"bad.parquet, row group 0, "
                     r"row 1: label 'x' is not numbers"):
    all_rows(config, tok, tmp_path / 'cache')
  path = write_parquet(tmp_path / 'bad.parquet', [
      {'text': i, 'label': 1.0} for i in range(120)], group_rows=50)
  with pytest.raises(sources.DataError, match=r"bad.parquet, row group 0, "
                     r"row 1: field 'text' \(text\) is a int, not a string"):
    all_rows(config, tok, tmp_path / 'other')


@pytest.mark.slow
def test_a_language_model_trains_and_resumes_on_jsonl(tmp_path):
  import os
  from jaxformer.config.settings import load_config
  from jaxformer.data import builtin
  from jaxformer.run.trainer import train
  texts = [s for s, _ in builtin.generate(600, 3, 'train')]
  write_jsonl(tmp_path / 'train.jsonl.gz', [{'text': t} for t in texts[:500]],
              compress=True)
  write_jsonl(tmp_path / 'dev.jsonl', [{'text': t} for t in texts[500:]])

  def run(steps):
    config = load_config('configs/lm_quick.py:runlocal', [
        'data.source=jsonl', f'data.jsonl.train={tmp_path}/train.jsonl.gz',
        f'data.jsonl.dev={tmp_path}/dev.jsonl', f'train.num_steps={steps}',
        'checkpoint.every=3', 'train.peak_flops=1e9',
        'data.tokenizer.vocab_size=200'])
    return train(config, str(tmp_path / 'run'))

  run(3)
  cache = tmp_path / 'run' / 'tokenizer' / 'token_cache'
  folders = sorted(os.listdir(cache))
  assert [f.split('-')[0] for f in folders] == ['dev', 'train']
  final = run(6)
  assert np.isfinite(final['eval_loss'])
  assert sorted(os.listdir(cache)) == folders  # Read, not written again.
