"""README's `jaxformer import` of an OPUS-MT folder, as a user types it:
relative paths from a working directory of their own, in a process whose
stderr holds nothing but jaxformer's lines; then the import is used like a
workdir, with a relative data file. The folder is a random-weight Marian
model (marian_folders.py)."""
import json

import pytest

pytest.importorskip('torch')
pytest.importorskip('transformers')

import marian_folders  # noqa: E402

from jaxformer.cli import main as cli  # noqa: E402
from user_commands import jaxformer  # noqa: E402


@pytest.mark.slow
def test_import_to_a_relative_out_is_quiet_and_used_like_a_workdir(
    tmp_path, monkeypatch, capsys):
  marian_folders.write_folder(
      str(tmp_path / 'opus-mt-en-de'), separate=False, activation='swish',
      scale_embedding=True, encoder_layers=1, decoder_layers=1, seed=1)
  out = jaxformer(tmp_path, 'import', '--from', 'opus-mt-en-de', '--out',
                  'models/opus-en-de')
  assert f'jaxformer translate --workdir {tmp_path}/models/opus-en-de' in out
  monkeypatch.chdir(tmp_path)
  texts = marian_folders.test_texts(4, 11)
  (tmp_path / 'test.tsv').write_text(''.join(f'{t}\tx\n' for t in texts))
  capsys.readouterr()
  assert cli.main(['evaluate', '--workdir', 'models/opus-en-de', '--beam', '1',
                   '--config.data.tsv.test=test.tsv',
                   '--hypotheses', 'test_hypotheses.txt']) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['hypotheses'] == f'{tmp_path}/test_hypotheses.txt'
  assert len(open(report['hypotheses']).read().splitlines()) == len(texts)
