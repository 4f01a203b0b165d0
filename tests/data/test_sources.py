import gzip

import pytest
import tensorflow as tf

from jaxformer.data import builtin
from jaxformer.data.defaults import default_data_config
from jaxformer.data import sources
from jaxformer.data.sources import DataError
from jaxformer.data.input_errors import MissingFileError

PAIRS = [('a small house .', 'ein kleines Haus .'),
         ('two cats', 'zwei Katzen'),
         ('für Ü', 'für Ü')]


def write(path, text: str, compress: bool = False):
  data = text.encode('utf-8')
  path.write_bytes(gzip.compress(data) if compress else data)
  return str(path)


def tsv_config(**paths):
  config = default_data_config()
  config.source = 'tsv'
  config.tsv.update(paths)
  return config


def files_config(**paths):
  config = default_data_config()
  config.source = 'files'
  config.files.update(paths)
  return config


def test_builtin_split_sizes_come_from_the_config():
  config = default_data_config()
  config.builtin.update(num_train=30, num_dev=7, seed=3)
  assert sources.read_split(config, 'dev') == builtin.generate(7, 3, 'dev')
  assert len(sources.read_split(config, 'train')) == 30


@pytest.mark.parametrize('name, compress', [('train.tsv', False), ('train.tsv.gz', True)])
def test_tsv_plain_and_gzipped(tmp_path, name, compress):
  text = ''.join(f'{s}\t{t}\n' for s, t in PAIRS)
  config = tsv_config(train=write(tmp_path / name, text, compress))
  assert sources.read_split(config, 'train') == PAIRS
  assert sources.count_pairs(config, 'train') == len(PAIRS)


def test_tsv_tolerates_crlf_and_missing_final_newline(tmp_path):
  text = '\r\n'.join(f'{s}\t{t}' for s, t in PAIRS)
  config = tsv_config(dev=write(tmp_path / 'dev.tsv', text))
  assert sources.read_split(config, 'dev') == PAIRS
  assert sources.count_pairs(config, 'dev') == len(PAIRS)


@pytest.mark.parametrize('compress', [False, True])
def test_line_aligned_file_pair(tmp_path, compress):
  suffix = '.gz' if compress else ''
  config = files_config(
      test_source=write(tmp_path / f'test.en{suffix}', ''.join(s + '\n' for s, _ in PAIRS), compress),
      test_target=write(tmp_path / f'test.de{suffix}', ''.join(t + '\n' for _, t in PAIRS), compress))
  assert sources.read_split(config, 'test') == PAIRS
  assert sources.count_pairs(config, 'test') == len(PAIRS)


def test_lines_are_counted_across_blocks_without_decoding(tmp_path, monkeypatch):
  monkeypatch.setattr(sources, '_BLOCK_BYTES', 5)
  for text in ('a\tb\nlonger line\tc\r\n\xe4\tx', 'a\tb\n' * 7, ''):
    path = write(tmp_path / 'train.tsv', text)
    assert sources.count_lines(path) == len(list(sources.iter_lines(path))
                                            if text else [])
  config = default_data_config()
  config.source = 'text'  # Blank lines are no documents.
  config.text.train = write(tmp_path / 'lm.txt', 'one\n\n  \ntwo\n')
  assert sources.count_pairs(config, 'train') == 2


def test_missing_file_names_it(tmp_path):
  path = str(tmp_path / 'nowhere.tsv')
  with pytest.raises(MissingFileError, match='nowhere.tsv: no such file') as error:
    sources.read_split(tsv_config(train=path), 'train')
  assert isinstance(error.value, FileNotFoundError)
  assert isinstance(error.value, ValueError)


def test_unset_path_names_the_config_key():
  with pytest.raises(DataError, match=r'data\.tsv\.dev is not set'):
    sources.read_split(tsv_config(), 'dev')


def test_empty_file(tmp_path):
  with pytest.raises(DataError, match='empty.tsv: the file is empty'):
    sources.read_split(tsv_config(train=write(tmp_path / 'empty.tsv', '')), 'train')


def test_tsv_line_without_tab_names_the_line(tmp_path):
  path = write(tmp_path / 'bad.tsv', 'a\tb\nno tab here\nc\td\n')
  with pytest.raises(DataError, match=r'bad.tsv:2: no tab;.*source<TAB>target'):
    sources.read_split(tsv_config(train=path), 'train')


def test_tsv_blank_line_or_extra_tab_names_the_line(tmp_path):
  path = write(tmp_path / 'bad.tsv', 'a\tb\nc\td\n\ne\tf\tg\n')
  with pytest.raises(DataError, match=r'bad.tsv:3: no tab'):
    sources.read_split(tsv_config(train=path), 'train')
  path = write(tmp_path / 'tabs.tsv', 'a\tb\te\n')
  with pytest.raises(DataError, match=r'tabs.tsv:1: 2 tabs'):
    sources.read_split(tsv_config(train=path), 'train')


def test_invalid_utf8_names_the_line(tmp_path):
  path = tmp_path / 'latin1.de'
  path.write_bytes('eins\nzwei\nGrüße\n'.encode('latin-1'))
  config = files_config(train_source=write(tmp_path / 'ok.en', 'one\ntwo\ngreetings\n'),
                        train_target=str(path))
  with pytest.raises(DataError, match=r'latin1.de:3: invalid UTF-8.*iconv'):
    sources.read_split(config, 'train')


def test_corrupt_gzip(tmp_path):
  path = tmp_path / 'train.tsv.gz'
  path.write_bytes(b'not gzip at all')
  with pytest.raises(DataError, match='train.tsv.gz: not a valid gzip file'):
    sources.read_split(tsv_config(train=str(path)), 'train')


def test_line_counts_must_match(tmp_path):
  config = files_config(train_source=write(tmp_path / 'train.en', 'a\nb\nc\n'),
                        train_target=write(tmp_path / 'train.de', 'a\nb\n'))
  with pytest.raises(DataError, match=r'train.en has 3 lines but .*train.de has 2'):
    sources.read_split(config, 'train')


def test_unknown_source_kind_and_split():
  config = default_data_config()
  config.source = 'csv'
  with pytest.raises(DataError, match="unknown data.source 'csv'"):
    sources.read_split(config, 'train')
  with pytest.raises(DataError, match='split must be one of'):
    sources.read_split(default_data_config(), 'validation')


def tfds_config(**settings):
  config = default_data_config()
  config.source = 'tfds'
  config.tfds.update(settings)
  return config


def fake_wmt(self, split, **unused_kwargs):
  """Stands in for the prepared files of wmt14_translate/de-en."""
  return tf.data.Dataset.from_tensor_slices({
      'de': [f'hallo {split} {i}' for i in range(3)],
      'en': [f'hello {split} {i}' for i in range(3)],
  })


@pytest.mark.usefixtures('tfds_scratch_in_tmp_path')
def test_tfds_reads_the_configured_split_and_direction():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(as_dataset_fn=fake_wmt):
    english_to_german = sources.read_split(tfds_config(), 'dev')
    german_to_english = sources.read_split(
        tfds_config(source_language='de', target_language='en',
                    test_split='newstest2015'), 'test')
  assert english_to_german[0] == ('hello validation 0', 'hallo validation 0')
  assert len(english_to_german) == 3
  assert german_to_english[2] == ('hallo newstest2015 2', 'hello newstest2015 2')


@pytest.mark.usefixtures('tfds_scratch_in_tmp_path')
def test_tfds_errors_are_clear():
  tfds = pytest.importorskip('tensorflow_datasets')
  with tfds.testing.mock_data(as_dataset_fn=fake_wmt):
    with pytest.raises(DataError, match="unknown tfds dataset 'no_such_dataset'"):
      sources.read_split(tfds_config(name='no_such_dataset'), 'train')
    with pytest.raises(DataError, match=r"features \('de', 'en'\), not \('en', 'fr'\)"):
      sources.read_split(tfds_config(target_language='fr'), 'train')
