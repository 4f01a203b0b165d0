"""The README's commands as a user types them: from a working directory of
their own, with relative paths and `~`. train, export, translate and
compile run as processes of their own, whose stderr holds nothing but
jaxformer's lines (none, on a normal run); the other commands run in this
process, which is quicker. One tiny quick-start run serves them all;
`jaxformer import` is in tests/interop/test_import_command.py (it needs
transformers)."""
import json
import shutil

import pytest

from jaxformer.config import resume
from jaxformer.cli import arguments
from jaxformer.cli import main as cli
from jaxformer.config import settings
from user_commands import REPO, jaxformer, run

TINY = ['--config.train.num_steps=4', '--config.checkpoint.every=2',
        '--config.eval.every=0', '--config.data.builtin.num_dev=8',
        '--config.data.builtin.num_test=8', '--config.train.peak_flops=1e9']
SENTENCES = 'she bought forty-two red apples .\nhe sold three old cups .\n'


# ------------------------------------------------- resolution at the edges

def test_a_path_argument_is_made_absolute_once(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  assert arguments.path('runs/a') == str(tmp_path / 'runs/a')
  assert arguments.path('~/models/b') == str(tmp_path / 'home/models/b')
  assert arguments.path('gs://bucket/run') == 'gs://bucket/run'
  with pytest.raises(Exception, match='an empty path'):
    arguments.path(' ')


def test_config_paths_are_made_absolute_when_loaded(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv('HOME', str(tmp_path / 'home'))
  shutil.copytree(REPO / 'configs', tmp_path / 'configs')
  (tmp_path / 'home').mkdir()
  config = settings.load_config('configs/finetune.py', [
      'init.pretrained=models/opus', 'data.tsv.dev=~/dev.tsv',
      'data.tsv.test=gs://bucket/test.tsv', 'data.token_cache_dir=cache'])
  assert config.init.pretrained == str(tmp_path / 'models/opus')
  assert config.data.tsv.train == str(tmp_path / 'data/train.tsv')
  assert config.data.tsv.dev == str(tmp_path / 'home/dev.tsv')
  assert config.data.tsv.test == 'gs://bucket/test.tsv'
  assert config.data.token_cache_dir == str(tmp_path / 'cache')
  assert config.data.tokenizer.model_path == ''  # Unset stays unset.
  assert config.data.tfds.data_dir is None
  assert settings.load_config('~/../configs/quickstart.py:runlocal')


def test_a_run_saved_with_relative_paths_still_resumes(tmp_path, monkeypatch):
  """Configs saved before paths were made absolute hold them as typed."""
  monkeypatch.chdir(tmp_path)
  saved = {'data': {'text': {'train': 'train.txt'}}}
  now = {'data': {'text': {'train': str(tmp_path / 'train.txt')}}}
  assert resume.incompatible_keys(saved, now) == []
  moved = {'data': {'text': {'train': str(tmp_path / 'other.txt')}}}
  assert resume.incompatible_keys(saved, moved) == ['data.text.train']


# ------------------------------------------------ the commands, end to end

@pytest.fixture(scope='module')
def home(tmp_path_factory):
  """A user's working directory, with the configs they copied there."""
  directory = tmp_path_factory.mktemp('user')
  shutil.copytree(REPO / 'configs', directory / 'configs')
  (directory / 'sentences.txt').write_text(SENTENCES)
  return directory


@pytest.fixture(scope='module')
def trained(home):
  out = jaxformer(home, 'train', '--config', 'configs/quickstart.py:runlocal',
                  '--workdir', 'runs/quickstart', *TINY)
  assert (home / 'runs/quickstart/checkpoints').is_dir()
  assert f'--workdir {home}/runs/quickstart' in out
  return home


@pytest.fixture(scope='module')
def exported(trained):
  out = jaxformer(trained, 'export', '--workdir', 'runs/quickstart', '--out',
                  'qs-export')
  assert f'jaxformer translate --workdir {trained}/qs-export' in out
  return trained


@pytest.mark.slow
def test_an_export_to_a_relative_path_is_used_like_a_workdir(exported):
  out = jaxformer(exported, 'translate', '--workdir', 'qs-export', '--input',
                  'sentences.txt')
  assert len(out.splitlines()) == 2


# In this process from here (quicker): the paths are the same arguments.

@pytest.mark.slow
def test_evaluate_writes_its_hypotheses_where_a_relative_path_says(
    trained, monkeypatch, capsys):
  monkeypatch.chdir(trained)
  assert cli.main(['evaluate', '--workdir', 'runs/quickstart', '--split',
                   'test', '--beam', '1', '--hypotheses',
                   'runs/quickstart/test_hypotheses.txt']) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['hypotheses'] == (
      f'{trained}/runs/quickstart/test_hypotheses.txt')
  assert len(open(report['hypotheses']).read().splitlines()) == 8


@pytest.mark.slow
def test_average_to_a_relative_out_is_used_like_a_workdir(
    trained, monkeypatch, capsys):
  monkeypatch.chdir(trained)
  assert cli.main(['average', '--workdir', 'runs/quickstart', '--last', '2',
                   '--out', 'runs/quickstart-avg']) == 0
  capsys.readouterr()
  assert cli.main(['translate', '--workdir', 'runs/quickstart-avg',
                   '--input', 'sentences.txt', '--beam', '1']) == 0
  assert len(capsys.readouterr().out.splitlines()) == 2


@pytest.mark.slow
def test_attention_and_curves_write_relative_pictures(trained, monkeypatch):
  monkeypatch.chdir(trained)
  assert cli.main(['attention', '--workdir', 'runs/quickstart', '--src',
                   'he sold three hundred old cups .', '--out',
                   'attention.png']) == 0
  assert cli.main(['curves', '--workdir', 'runs/quickstart', '--out',
                   'curves.png']) == 0
  assert (trained / 'attention.png').stat().st_size > 0
  assert (trained / 'curves.png').stat().st_size > 0


@pytest.mark.slow
def test_an_out_under_home_is_expanded(trained, monkeypatch):
  """`--out=~/...`: one word, which no shell expands."""
  monkeypatch.chdir(trained)
  monkeypatch.setenv('HOME', str(trained / 'home'))
  assert cli.main(['export', '--workdir', 'runs/quickstart',
                   '--out=~/models/qs']) == 0
  assert (trained / 'home/models/qs').is_dir()


@pytest.mark.slow
def test_fine_tuning_reads_a_relative_export_and_data_files(
    exported, monkeypatch):
  monkeypatch.chdir(exported)
  pairs = '\n'.join(['she bought two red apples .\tsie kaufte zwei rote '
                     'Äpfel .'] * 32) + '\n'
  for split in ('train', 'dev', 'test'):
    (exported / f'{split}.tsv').write_text(pairs)
  assert cli.main([
      'train', '--config', 'configs/finetune.py', '--workdir', 'runs/ft',
      '--config.init.pretrained=qs-export',
      '--config.data.tsv.train=train.tsv', '--config.data.tsv.dev=dev.tsv',
      '--config.data.tsv.test=test.tsv', '--config.train.num_steps=2',
      '--config.train.warmup_steps=1', '--config.eval.every=0',
      '--config.eval.bleu_examples=4', '--config.checkpoint.every=2',
      '--config.decode.beam_size=1', '--config.train.peak_flops=1e9']) == 0
  saved = json.loads((exported / 'runs/ft/config.json').read_text())
  assert saved['init']['pretrained'] == f'{exported}/qs-export'
  assert saved['data']['tsv']['train'] == f'{exported}/train.tsv'


@pytest.mark.slow
def test_compile_of_no_programs_is_quiet(home):
  pytest.importorskip('libtpu', reason='jaxformer compile needs libtpu')
  out = jaxformer(home, 'compile', '--config', 'configs/quickstart.py:runlocal',
                  '--topology', 'v5e-8', '--programs', 'none', '--json',
                  'report.json')
  assert 'start-up of each host' in out and 'accepted' in out
  assert json.loads((home / 'report.json').read_text())['programs'] == []


@pytest.mark.slow
def test_a_real_error_is_one_line_of_jaxformer(home):
  result = run(home, 'translate', '--workdir', 'runs/none')
  assert result.returncode == 1
  assert result.stderr.splitlines() == [
      f'jaxformer translate: error: No checkpoints in {home}/runs/none: train '
      f'first with `jaxformer train --config ... --workdir {home}/runs/none`, '
      'or pass the --workdir of a run.']
