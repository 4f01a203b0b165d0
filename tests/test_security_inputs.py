"""What a model, a cache or an export lets others do (docs/security.md): a
compilation cache that others can write is refused, as JAX runs what it
loads from it; an export records no path of the machine that made it
unless asked (--keep-provenance). The torch floor of Marian's .bin weights
is tested with the import (interop/test_marian.py), the bounds on input in
test_input_limits.py."""
import json
import os

import pytest

from jaxformer.checkpoints import exports
from jaxformer.cli import main as cli
from jaxformer.runtime import compilation_cache
from test_checkpoint import CONFIG, new_state, save, seen_by_a_new_process

ENV = compilation_cache.ENV


# ------------------------------------------------ the compilation cache


def test_a_world_writable_cache_directory_is_refused(tmp_path):
  cache = tmp_path / 'xla'
  cache.mkdir()
  cache.chmod(0o777)
  with pytest.raises(compilation_cache.CacheError) as error:
    compilation_cache.enable({ENV: str(cache)})
  message = str(error.value)
  assert f'the compilation cache {cache} is writable by every user' in message
  assert f'chmod o-w {cache}' in message and f'{ENV}=off' in message
  cache.chmod(0o755)
  compilation_cache.check_private(str(cache))


def test_a_cache_under_a_world_writable_folder_is_refused_unless_sticky(
    tmp_path):
  shared = tmp_path / 'shared'
  (shared / 'xla').mkdir(parents=True)
  shared.chmod(0o777)  # Anyone could rename xla/ and put their own there.
  with pytest.raises(compilation_cache.CacheError,
                     match=f'is under {shared}, which is writable'):
    compilation_cache.check_private(str(shared / 'xla'))
  shared.chmod(0o1777)  # /tmp's sticky bit: only the owner renames xla/.
  compilation_cache.check_private(str(shared / 'xla'))


@pytest.mark.skipif(os.getuid() != 0, reason='giving a folder away needs root')
def test_a_cache_directory_of_another_user_is_refused(tmp_path):
  cache = tmp_path / 'theirs'
  cache.mkdir()
  os.chown(cache, 4242, -1)
  with pytest.raises(compilation_cache.CacheError, match='belongs to user 4242'):
    compilation_cache.check_private(str(cache))


def test_the_commands_refuse_such_a_cache_in_one_line(tmp_path, monkeypatch,
                                                      capfd):
  cache = tmp_path / 'xla'
  cache.mkdir()
  cache.chmod(0o757)
  monkeypatch.setenv(ENV, str(cache))
  assert cli.main(['translate', '--workdir', str(tmp_path / 'run')]) == 1
  lines = capfd.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      f'jaxformer translate: error: the compilation cache {cache} is '
      'writable by every user')


# ------------------------------------------------------------ exports

MACHINE = {'tsv': '/home/alice/corpus', 'cache': 'gs://alice-bucket/tokens',
           'tfds': '/home/alice/tfds', 'init': '/home/alice/models/base'}


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  """Two steps of the quickstart's tiny model, trained (as its config says)
  on this machine's files."""
  from jaxformer.config.settings import load_config
  from jaxformer.parallel import mesh as mesh_lib
  from jaxformer.data import builtin
  from jaxformer.data import tokenizer as tokenizer_lib
  from jaxformer.train.run_spec import with_vocabulary
  texts = [text for pair in builtin.generate(300, 0, 'train') for text in pair]
  root = tmp_path_factory.mktemp('provenance')
  tok_config = load_config(CONFIG).data.tokenizer
  tok_config.vocab_size = 128
  tok = tokenizer_lib.train_tokenizer(texts, str(root / 'joint'), tok_config)
  config = with_vocabulary(load_config(CONFIG), tok, tok)
  config.data.update(source='tsv', token_cache_dir=MACHINE['cache'])
  config.data.tsv.update(train=f'{MACHINE["tsv"]}/train.tsv',
                         dev=f'{MACHINE["tsv"]}/dev.tsv')
  config.data.tfds.data_dir = MACHINE['tfds']
  config.init.pretrained = MACHINE['init']
  state = new_state(config, mesh_lib.make_mesh({'data': -1}))
  save(root / 'run', [(1, state), (2, state)], config, tok, keep=2).close()
  return str(seen_by_a_new_process(root / 'run'))


def saved(export: str) -> tuple[dict, str]:
  extra, _ = exports.restore_export(export)
  return extra, json.dumps(extra)


@pytest.mark.slow
@pytest.mark.parametrize('command', ['export', 'average'])
def test_an_export_records_no_machine_path_unless_asked(workdir, tmp_path,
                                                        command):
  flags = ['--last', '2'] if command == 'average' else []
  out = str(tmp_path / 'plain')
  assert cli.main([command, '--workdir', workdir, '--out', out, *flags]) == 0
  extra, text = saved(out)
  for path in (workdir, *MACHINE.values()):
    assert path not in text
  assert extra['source'] == '' and extra['config']['data']['tfds'][
      'data_dir'] is None
  assert extra['config']['data']['tsv'] == {'train': '', 'dev': '',
                                            'test': ''}
  kept = str(tmp_path / 'kept')
  assert cli.main([command, '--workdir', workdir, '--out', kept, *flags,
                   '--keep-provenance']) == 0
  extra, text = saved(kept)
  assert workdir in extra['source']
  for path in MACHINE.values():
    assert path in text


def test_without_machine_paths_keeps_everything_else():
  config = {'data': {'tsv': {'train': '/a'}, 'files': {'dev_source': '/b'},
                     'tfds': {'data_dir': '/c', 'name': 'wmt14'},
                     'max_source_length': 64},
            'model': {'d_model': 32}, 'init': {'pretrained': 'gs://d'}}
  assert exports.without_machine_paths(config) == {
      'data': {'tsv': {'train': ''}, 'files': {'dev_source': ''},
               'tfds': {'data_dir': None, 'name': 'wmt14'},
               'max_source_length': 64},
      'model': {'d_model': 32}, 'init': {'pretrained': ''}}
  assert config['data']['tsv']['train'] == '/a'  # Not changed in place.


# ------------------------------------- what a loaded model makes commands do


@pytest.mark.slow
def test_a_loaded_model_reads_only_the_data_its_user_names(workdir, tmp_path,
                                                           capfd):
  """The saved config names /home/alice/corpus/dev.tsv: `evaluate` does not
  go there, but asks for the file, reads the one given, and writes nothing
  unless told where."""
  before = sorted(os.listdir(workdir))
  assert cli.main(['evaluate', '--workdir', workdir, '--split', 'dev',
                   '--beam', '1']) == 1
  error = capfd.readouterr().err
  assert 'data.tsv.dev' in error and MACHINE['tsv'] not in error
  dev = tmp_path / 'dev.tsv'
  dev.write_text('he sold three cups .\ter verkaufte drei Tassen .\n')
  assert cli.main(['evaluate', '--workdir', workdir, '--split', 'dev',
                   '--beam', '1', f'--config.data.tsv.dev={dev}']) == 0
  assert 0 <= json.loads(capfd.readouterr().out)['bleu'] <= 100
  assert sorted(os.listdir(workdir)) == before


def test_a_saved_config_is_checked_like_a_config_file():
  from jaxformer.config import settings
  saved = settings.default_config()
  saved.data.tsv.dev = '/home/alice/corpus/dev.tsv'
  config = settings.trained_model_config(saved)
  assert config.data.tsv.dev == '' and config.model == saved.model
  old = saved.to_dict()
  del old['train']['schedule_over_budget']  # Saved before the option was.
  assert settings.trained_model_config(old).train.schedule_over_budget is (
      saved.train.schedule_over_budget)
  with pytest.raises(settings.ConfigError, match='saved config.data.shell'):
    settings.trained_model_config({**saved.to_dict(), 'data': {
        **saved.data.to_dict(), 'shell': 'rm -rf ~'}})
  saved.data.batching = 'anything'
  with pytest.raises(settings.ConfigError, match='data.batching'):
    settings.trained_model_config(saved)
