"""What a cache lets others do (docs/security.md): a compilation cache that
others can write is refused, as JAX runs what it loads from it. The torch
floor of Marian's .bin weights is tested with the import
(interop/test_marian.py)."""
import os

import pytest

from jaxformer.cli import main as cli
from jaxformer.runtime import compilation_cache

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

