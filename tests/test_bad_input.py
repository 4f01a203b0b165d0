"""Bad data, files and config found at start-up, before any training, with
one clear line of error and nothing lost."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxformer.data import builtin
from trained_runs import NO_PEAK, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
# `data/test_sources.py::test_empty_file` (under tests/), `tests/test_gcs.py`.
TEST_REFERENCE = re.compile(r'`(?:tests/)?([\w/]+\.py)::(\w+)`')
TEST_FILE = re.compile(r'`(tests/[\w/]+\.py)`')
MODULE_FILE = re.compile(r'`(jaxformer/[\w/]+\.py)')


@pytest.fixture(scope='module')
def tsv_dir(tmp_path_factory):
  """train/dev/test TSV files of the built-in pairs, and a bad one."""
  directory = tmp_path_factory.mktemp('tsv')
  for split, count in (('train', 300), ('dev', 8), ('test', 8)):
    lines = [f'{s}\t{t}' for s, t in builtin.generate(count, 0, split)]
    (directory / f'{split}.tsv').write_text('\n'.join(lines) + '\n')
  (directory / 'no_tab.tsv').write_text('one\ttwo\nthree four\n')
  return directory


def tsv_flags(directory, **paths):
  files = {split: str(directory / f'{split}.tsv')
           for split in ('train', 'dev', 'test')}
  files.update(paths)
  return [f'--config.data.tsv.{split}={path}' for split, path in files.items()] + [
      '--config.data.source=tsv', '--config.data.tokenizer.vocab_size=64',
      '--config.data.tokenizer.sample_size=300', '--config.train.num_steps=2',
      NO_PEAK]


@pytest.mark.parametrize('split', ['dev', 'test'])
def test_a_missing_evaluation_split_is_reported_before_training(
    tsv_dir, tmp_path, capfd, split):
  missing = str(tmp_path / f'{split}_missing.tsv')
  assert train(tmp_path / 'run', *tsv_flags(tsv_dir, **{split: missing})) == 1
  out, err = capfd.readouterr()
  assert f'{missing}: no such file' in err
  assert 'Training steps' not in out
  assert not (tmp_path / 'run' / 'checkpoints').exists() or not os.listdir(
      tmp_path / 'run' / 'checkpoints')


def test_a_missing_tokenizer_model_is_reported_before_training(
    tsv_dir, tmp_path, capfd):
  missing = str(tmp_path / 'nope.model')
  flags = tsv_flags(tsv_dir) + [f'--config.data.tokenizer.model_path={missing}']
  assert train(tmp_path / 'run', *flags) == 1
  assert f'{missing}: no such file' in capfd.readouterr().err


@pytest.mark.slow
def test_a_data_error_is_one_line_without_orbax_noise(tsv_dir, tmp_path):
  """As the process exits, Orbax's clean-up thread used to fail loudly."""
  command = [sys.executable, '-m', 'jaxformer', 'train', '--config',
             'configs/quickstart.py:runlocal', '--workdir', str(tmp_path / 'run')]
  command += tsv_flags(tsv_dir, train=str(tsv_dir / 'no_tab.tsv'))
  result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
                          timeout=600)
  assert result.returncode == 1
  assert result.stderr.strip().splitlines() == [
      f'jaxformer train: error: {tsv_dir / "no_tab.tsv"}:2: no tab; each line '
      "must be 'source<TAB>target' with exactly one tab (remove tabs inside "
      'sentences, and blank lines)'], result.stderr


def test_a_negative_step_count_is_an_error_not_an_empty_run(tmp_path, capfd):
  assert train(tmp_path / 'run', '--config.train.num_steps=-5') == 1
  assert 'train.num_steps=-5 is out of range' in capfd.readouterr().err
  assert not (tmp_path / 'run').exists()


def doc_pages() -> dict[pathlib.Path, str]:
  """The text of README.md and every other page of documentation."""
  pages = [ROOT / 'README.md', ROOT / 'ARCHITECTURE.md',
           ROOT / 'launch' / 'README.md', *sorted((ROOT / 'docs').glob('*.md')),
           *sorted((ROOT / 'benchmarks').glob('*.md'))]
  return {page.relative_to(ROOT): page.read_text() for page in pages}


def test_every_test_named_in_the_readme_and_docs_exists():
  """The pages name tests as `file::test` (each row of the fault table has
  one or more) and test files as `tests/file.py`."""
  texts = doc_pages()
  faults = texts[pathlib.Path('docs/faults.md')]
  assert len(TEST_REFERENCE.findall(faults)) > 20
  for page, text in texts.items():
    for path, name in TEST_REFERENCE.findall(text):
      assert f'def {name}(' in (ROOT / 'tests' / path).read_text(), (
          f'{page}: {path}::{name}')
    for path in TEST_FILE.findall(text):
      assert (ROOT / path).is_file(), f'{page}: {path}'


def test_every_module_the_docs_name_exists():
  for page, text in doc_pages().items():
    for path in MODULE_FILE.findall(text):
      assert (ROOT / path).is_file(), f'{page}: {path}'
