"""The row tasks' token cache (data/token_shards.py, row_layouts.py,
row_tables.py): the same rows as the whole split made in memory, the same
bytes from 1 or 2 processes, resumed after a kill, keyed by the data and
the tokenizer, and refusing a cache it cannot trust in one line."""
import os

import ml_collections
import numpy as np
import pytest

from jaxformer.data import labelled
from jaxformer.data import lm_rows
from jaxformer.data import row_layouts
from jaxformer.data import sources
from jaxformer.data import task_batches
from jaxformer.data import token_shards
from jaxformer.data.defaults import default_data_config

from tsv_corpus import PAIRS

TEXTS = [source for source, _ in PAIRS]


def run_config(task, source, path, **data):
  config = ml_collections.ConfigDict(dict(
      task=task, model=dict(regression_dim=1, type_vocab_size=0),
      init=dict(pretrained=''), data=default_data_config()))
  config.data.source = source
  config.data[source].train = str(path)
  config.data.update(max_source_length=12, max_target_length=12,
                     token_cache_piece_bytes=1500, **data)
  return config


def write_lines(path, lines):
  path.write_text(''.join(line + '\n' for line in lines), encoding='utf-8')
  return path


def all_rows(config, tok, cache):
  table = task_batches.task_table(config, 'train', tok, str(cache))
  return table.take(np.arange(table.num_rows))


def assert_same(rows, expected):
  assert sorted(rows) == sorted(expected)
  for key in expected:
    np.testing.assert_array_equal(rows[key], expected[key], err_msg=key)


def cache_bytes(cache):
  """{file: bytes} of every file below `cache`."""
  found = {}
  for root, _, names in os.walk(cache):
    for name in names:
      path = os.path.join(root, name)
      found[os.path.relpath(path, cache)] = open(path, 'rb').read()
  return found


def test_packed_documents_over_many_pieces_are_the_rows_made_in_memory(
    tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  rows = all_rows(config, tok, tmp_path / 'cache')
  (folder,) = os.listdir(tmp_path / 'cache')
  records = [n for n in os.listdir(tmp_path / 'cache' / folder)
             if n.endswith('.done.json')]
  assert len(records) > 3  # Several pieces, read across their boundaries.
  assert_same(rows, lm_rows.pack_documents(lm_rows.document_ids(tok, TEXTS),
                                           12))


def test_prompt_response_rows_are_the_rows_made_in_memory(tmp_path, tok):
  config = run_config('language_model', 'tsv', write_lines(
      tmp_path / 'pairs.tsv', [f'{s}\t{t}' for s, t in PAIRS]),
                      lm_rows='prompt_response')
  expected = lm_rows.language_model_rows(
      config.data, TEXTS, [t for _, t in PAIRS], 'train', tok)
  assert_same(all_rows(config, tok, tmp_path / 'cache'), expected)


@pytest.mark.parametrize('with_types', [0, 2])
def test_sentence_pair_classes_are_the_rows_made_in_memory(tmp_path, tok,
                                                           with_types):
  labels = ['odd' if i % 3 else 'even' for i in range(len(PAIRS))]
  config = run_config('classification', 'tsv', write_lines(
      tmp_path / 'pairs.tsv',
      [f'{s}\t{t}\t{label}' for (s, t), label in zip(PAIRS, labels)]))
  config.model.type_vocab_size = with_types
  ids, types = labelled.encode(tok, PAIRS, 12)
  expected = labelled.pad_token_rows(ids, 12, types if with_types else None)
  expected['labels'] = np.array([label == 'odd' for label in labels], np.int32)
  assert_same(all_rows(config, tok, tmp_path / 'cache'), expected)


def test_regression_values_and_their_count_are_checked(tmp_path, tok):
  path = write_lines(tmp_path / 'values.tsv',
                     [f'{s}\t{i / 10}' for i, s in enumerate(TEXTS)])
  config = run_config('regression', 'tsv', path)
  rows = all_rows(config, tok, tmp_path / 'cache')
  np.testing.assert_allclose(rows['values'][:, 0],
                             np.arange(len(TEXTS)) / 10, rtol=1e-6)
  config.model.regression_dim = 2
  with pytest.raises(sources.DataError, match='train example 1: 1 label '):
    all_rows(config, tok, tmp_path / 'cache')
  write_lines(path, ['one\t0.5', 'two\thigh'])
  with pytest.raises(sources.DataError, match=r'values.tsv:2: label .high'):
    all_rows(config, tok, tmp_path / 'other')


def _tokenize(config, tok, folder, key, **processes):
  token_shards.tokenize(config.data, 'train',
                        row_layouts.ENCODINGS['lm_packed'], tok, str(folder),
                        key, piece_bytes=1500, **processes)


def test_one_or_two_processes_write_the_same_cache(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  encoding = row_layouts.ENCODINGS['lm_packed']
  for name, shares in (('one', [(0, 1)]), ('two', [(1, 2), (0, 2)])):
    for index, count in shares:
      _tokenize(config, tok, tmp_path / name, 'k' * 64,
                process_index=index, process_count=count)
    token_shards.commit(config.data, 'train', encoding, str(tmp_path / name),
                        'k' * 64, piece_bytes=1500)
  one, two = cache_bytes(tmp_path / 'one'), cache_bytes(tmp_path / 'two')
  assert len(one) > 10 and one == two


def test_a_killed_tokenization_goes_on_from_its_finished_pieces(
    tmp_path, tok, monkeypatch):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  _tokenize(config, tok, tmp_path / 'whole', 'k' * 64)
  written = []
  real = token_shards.encode_piece

  def killed_after_two(*args):
    if len(written) == 2:
      raise KeyboardInterrupt  # As a kill: nothing after it runs.
    written.append(args[1])
    return real(*args)

  monkeypatch.setattr(token_shards, 'encode_piece', killed_after_two)
  with pytest.raises(KeyboardInterrupt):
    _tokenize(config, tok, tmp_path / 'resumed', 'k' * 64)
  monkeypatch.setattr(token_shards, 'encode_piece', real)
  before = cache_bytes(tmp_path / 'resumed')
  assert len([n for n in before if n.endswith('.done.json')]) == 2
  done = {n: os.stat(tmp_path / 'resumed' / n).st_mtime_ns for n in before}
  _tokenize(config, tok, tmp_path / 'resumed', 'k' * 64)
  assert cache_bytes(tmp_path / 'resumed') == cache_bytes(tmp_path / 'whole')
  assert all(os.stat(tmp_path / 'resumed' / n).st_mtime_ns == t
             for n, t in done.items())  # Finished pieces were not redone.


def test_a_changed_file_or_another_tokenizer_gets_its_own_cache(
    tmp_path, tok, tmp_path_factory):
  path = write_lines(tmp_path / 'lm.txt', TEXTS)
  config = run_config('language_model', 'text', path)
  first = all_rows(config, tok, tmp_path / 'cache')
  write_lines(path, TEXTS[:10])
  changed = all_rows(config, tok, tmp_path / 'cache')
  assert len(os.listdir(tmp_path / 'cache')) == 2
  assert len(changed['targets']) < len(first['targets'])
  from jaxformer.data import tokenizer as tokenizer_lib
  settings = default_data_config().tokenizer
  settings.vocab_size = 120
  other = tokenizer_lib.train_tokenizer(
      TEXTS, str(tmp_path_factory.mktemp('other') / 'joint'), settings)
  all_rows(config, other, tmp_path / 'cache')
  assert len(os.listdir(tmp_path / 'cache')) == 3


def _one_folder(cache):
  (folder,) = os.listdir(cache)
  return os.path.join(cache, folder)


def test_a_cut_shard_or_out_of_vocabulary_ids_are_refused(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  cache = tmp_path / 'cache'
  all_rows(config, tok, cache)
  shard = os.path.join(_one_folder(cache), '00001.text.npy')
  data = open(shard, 'rb').read()
  with open(shard, 'wb') as f:
    f.write(data[:-10])
  with pytest.raises(sources.DataError) as error:
    all_rows(config, tok, cache)
  message = str(error.value)
  assert '\n' not in message and '00001.text.npy' in message
  assert 'damaged: delete' in message
  array = np.load(io_bytes(data))
  array[3] = 60000
  np.save(shard, array)  # The same size, an id past the vocabulary.
  with pytest.raises(sources.DataError, match='holds id 60000, not below the '
                     'vocabulary size 150'):
    all_rows(config, tok, cache)


def io_bytes(data):
  import io
  return io.BytesIO(data)


def test_a_cache_under_another_key_is_refused(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  cache = tmp_path / 'cache'
  all_rows(config, tok, cache)
  folder = _one_folder(cache)
  manifest = os.path.join(folder, token_shards.MANIFEST)
  text = open(manifest).read()
  key = os.path.basename(folder).split('-')[1]
  open(manifest, 'w').write(text.replace(key, 'f' * 24))
  with pytest.raises(sources.DataError, match='written for other data, '
                     'another tokenizer or another format.*delete'):
    all_rows(config, tok, cache)


def test_eval_and_resumed_batches_read_the_cache(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS), batch_size=4)
  config.data.text.dev = config.data.text.train
  cache = str(tmp_path / 'cache')
  batches = task_batches.train_batches(config, tok, tok, token_cache=cache)
  first = [next(batches) for _ in range(30)]  # Past an epoch's end.
  resumed = task_batches.train_batches(config, tok, tok, start_step=17,
                                       token_cache=cache)
  for expected in first[17:]:
    assert_same(next(resumed), expected)
  seen = [b['example_index'] for b in task_batches.eval_batches(
      config, tok, tok, 'dev', token_cache=cache)]
  seen = np.concatenate(seen)
  assert sorted(seen[seen >= 0].tolist()) == list(range(
      len(lm_rows.pack_documents(lm_rows.document_ids(tok, TEXTS),
                                 12)['targets'])))


def test_a_mixture_of_documents_resumes_bitwise_across_its_stages(tmp_path,
                                                                  tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'a.txt', TEXTS[:60]),
                      batch_size=4)
  write_lines(tmp_path / 'b.txt', TEXTS[60:])
  config.data.mixture.sources = [
      {'name': 'a', 'source': 'text', 'text': {'train': str(tmp_path / 'a.txt')}},
      {'name': 'b', 'source': 'text', 'text': {'train': str(tmp_path / 'b.txt')}}]
  config.data.mixture.stages = [{'until_step': 6, 'weights': {'a': 1}},
                                {'weights': {'a': 1, 'b': 3}}]
  cache = str(tmp_path / 'cache')
  batches = task_batches.train_batches(config, tok, tok, token_cache=cache)
  first = [next(batches) for _ in range(40)]
  assert first[0]['source_counts'].tolist() == [4, 0]
  assert sum(b['source_counts'][1] for b in first[6:]) > 40
  for start in (4, 6, 31):
    resumed = task_batches.train_batches(config, tok, tok, start_step=start,
                                         token_cache=cache)
    for expected in first[start:start + 6]:
      assert_same(next(resumed), expected)


@pytest.mark.slow
def test_a_pool_of_workers_writes_the_same_cache(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  encoding = row_layouts.ENCODINGS['lm_packed']
  for name, workers in (('one', 1), ('pool', 2)):
    _tokenize(config, tok, tmp_path / name, 'k' * 64, workers=workers)
    token_shards.commit(config.data, 'train', encoding, str(tmp_path / name),
                        'k' * 64, piece_bytes=1500)
  assert cache_bytes(tmp_path / 'one') == cache_bytes(tmp_path / 'pool')


def test_an_unknown_label_names_its_first_example_across_pieces(tmp_path,
                                                                 tok):
  labels = ['odd' if i % 3 else 'even' for i in range(len(TEXTS))]
  labels[70], labels[90] = 'maybe', 'perhaps'
  config = run_config('classification', 'tsv', write_lines(
      tmp_path / 'dev.tsv', [f'{t}\t{l}' for t, l in zip(TEXTS, labels)]))
  config.data.labels = ['even', 'odd']
  config.init.pretrained = '/models/parity'
  with pytest.raises(sources.DataError, match=r"the train split, example 71: "
                     r"label 'maybe' is not one of the labels \['even', "
                     r"'odd'\] of the pretrained model /models/parity; .*"
                     r"\(2 unknown label\(s\)\)"):
    all_rows(config, tok, tmp_path / 'cache')


def test_process_0_waits_for_the_pieces_of_the_others(tmp_path, tok):
  config = run_config('language_model', 'text',
                      write_lines(tmp_path / 'lm.txt', TEXTS))
  config.data.tokenizer.wait_seconds = 0.5
  with pytest.raises(TimeoutError, match='another process to tokenize its '
                     'piece of the token cache'):
    row_layouts.open_split(config.data, 'train',
                           row_layouts.ENCODINGS['lm_packed'], tok,
                           str(tmp_path / 'cache'), process_count=2)
  from jaxformer.data import token_cache
  key = token_cache.rows_key(config.data, 'train', 'lm_packed', tok, 1500)
  _tokenize(config, tok, _one_folder(tmp_path / 'cache'), key,
            process_index=1, process_count=2)  # Process 1's share, late.
  opened = row_layouts.open_split(config.data, 'train',
                                  row_layouts.ENCODINGS['lm_packed'], tok,
                                  str(tmp_path / 'cache'), process_count=2)
  assert opened.ragged('text').num_examples == len(TEXTS)
