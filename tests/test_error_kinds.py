"""jaxformer's kinds of error (`storage/errors.py`): each named for what
failed, one base the CLI reports in one line, and each still the built-in
error callers caught before."""
import pathlib

import pytest

from jaxformer.checkpoints import manager
from jaxformer.cli import main as cli
from jaxformer.config import settings
from jaxformer.data import input_errors
from jaxformer.data import sources
from jaxformer.interop import bert, hf_folders, llama, m2m100, marian
from jaxformer.storage import errors, paths

QUICKSTART = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
                 / 'quickstart.py')


@pytest.mark.parametrize('kind, builtin', [
    (errors.ConfigError, ValueError), (errors.DataError, ValueError),
    (errors.CheckpointError, RuntimeError), (errors.InteropError, ValueError),
    (errors.StorageError, OSError)])
def test_each_kind_is_a_jaxformer_error_and_its_builtin(kind, builtin):
  assert issubclass(kind, errors.JaxformerError) and issubclass(kind, builtin)


def test_the_layers_raise_their_own_kind():
  assert sources.DataError is errors.DataError
  assert issubclass(input_errors.MissingFileError, errors.DataError)
  assert settings.ConfigError is errors.ConfigError
  assert manager.CheckpointError is errors.CheckpointError
  assert paths.StorageError is errors.StorageError
  for family in (llama.LlamaImportError, bert.BertImportError,
                 marian.MarianImportError, m2m100.M2M100ImportError,
                 hf_folders.FolderError):
    assert issubclass(family, errors.InteropError), family


def test_a_config_error_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
  with pytest.raises(errors.ConfigError):
    settings.load_config(QUICKSTART, ['train.schedule=sideways'])
  status = cli.main(['train', '--config', QUICKSTART, '--workdir',
                     str(tmp_path / 'w'), '--config.train.schedule=sideways'])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 1
  assert err[-1] == ("jaxformer train: error: train.schedule='sideways' is "
                     "not one of ('rsqrt', 'warmup_rsqrt', 'warmup_cosine').")
