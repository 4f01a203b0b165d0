"""benchmarks/gettext_corpus.py on catalogs the test writes itself (the .mo
binary format, by hand)."""
import importlib.util
import os
import pathlib
import struct

import pytest

_PATH = pathlib.Path(__file__).parent.parent / 'benchmarks' / 'gettext_corpus.py'
_spec = importlib.util.spec_from_file_location('gettext_corpus', _PATH)
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)


def write_mo(path, entries):
  """A GNU .mo file of `entries` {msgid: msgstr}; a plural msgid is
  'singular\\0plural' and its msgstr 'form0\\0form1'."""
  entries = dict(entries)
  entries.setdefault('', 'Content-Type: text/plain; charset=UTF-8\n'
                     'Plural-Forms: nplurals=2; plural=(n > 1);\n')
  keys = sorted(entries)
  ids = [k.encode() for k in keys]
  strs = [entries[k].encode() for k in keys]
  header = 7 * 4
  table = header + 16 * len(keys)
  data = b''
  offsets = []
  for blob in ids + strs:
    offsets.append((len(blob), table + len(data)))
    data += blob + b'\0'
  out = struct.pack('<7I', 0x950412de, 0, len(keys), header,
                    header + 8 * len(keys), 0, 0)
  for length, offset in offsets:
    out += struct.pack('<2I', length, offset)
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(out + data)


@pytest.fixture
def locale_dir(tmp_path):
  root = tmp_path / 'locale'
  write_mo(root / 'fr' / 'LC_MESSAGES' / 'a.mo', {
      '_Open': '_Ouvrir',
      'Save _As': 'Enregistrer _sous',
      'Untranslated': '',
      'menu\x04Quit': 'Quitter',
      '%d file\x00%d files': '%d fichier\x00%d fichiers',
      'line one\nline two': 'ligne un\n\tligne deux',
      'file_name': 'file_name',
      '12345': '12345',
      'Hello': 'Bonjour',
  })
  write_mo(root / 'fr' / 'LC_MESSAGES' / 'b.mo', {
      'Hello': 'Salut', 'Open': 'Ouvrir',
      **{f'Message number {i}': f'Message numéro {i}' for i in range(40)}})
  write_mo(root / 'fr' / 'LC_MESSAGES' / 'c.mo', {'Hello': 'Salut'})
  write_mo(root / 'es' / 'LC_MESSAGES' / 'a.mo', {'Hello': 'Hola'})
  return root


def test_cleanup_dedup_and_majority(locale_dir):
  paths = sorted(str(p) for p in (locale_dir / 'fr').rglob('*.mo'))
  pairs = corpus.collect(paths, max_chars=200)
  assert pairs['Open'] == 'Ouvrir'  # '_Open' and 'Open' are one source.
  assert pairs['Save As'] == 'Enregistrer sous'
  assert pairs['Quit'] == 'Quitter'  # The context is not part of it.
  assert pairs['%d file'] == '%d fichier'  # Plural: singular, form 0.
  assert pairs['line one line two'] == 'ligne un ligne deux'
  assert pairs['Hello'] == 'Salut'  # 2 catalogs against 1.
  assert pairs['filename'] == 'filename'
  assert 'Untranslated' not in pairs and '12345' not in pairs
  assert '' not in pairs and '%d files' not in pairs
  assert len(pairs) == 7 + 40


def test_split_is_by_source_and_deterministic(locale_dir, tmp_path, capsys):
  args = ['--lang', 'fr', '--locale_dir', str(locale_dir), '--dev_size', '5',
          '--test_size', '7']
  assert corpus.main(args + ['--out', str(tmp_path / 'x')]) == 0
  assert 'copy-the-source baseline on test: BLEU' in capsys.readouterr().out
  assert corpus.main(args + ['--out', str(tmp_path / 'y')]) == 0
  splits = {}
  for name in ('train', 'dev', 'test'):
    text = (tmp_path / 'x' / f'{name}.tsv').read_text()
    assert text == (tmp_path / 'y' / f'{name}.tsv').read_text()
    splits[name] = [line.split('\t') for line in text.splitlines()]
    assert all(len(row) == 2 for row in splits[name])
  assert [len(splits[n]) for n in ('train', 'dev', 'test')] == [35, 5, 7]
  sources = [{s for s, _ in splits[n]} for n in ('train', 'dev', 'test')]
  assert not (sources[0] & sources[1] or sources[0] & sources[2]
              or sources[1] & sources[2])


def test_bad_language_and_too_small_corpus(locale_dir, tmp_path, capsys):
  assert corpus.main(['--lang', 'xx', '--locale_dir', str(locale_dir),
                      '--out', str(tmp_path / 'o')]) == 1
  assert 'choose a --lang' in capsys.readouterr().err
  assert corpus.main(['--lang', 'es', '--locale_dir', str(locale_dir),
                      '--out', str(tmp_path / 'o')]) == 1
  assert 'lower --dev_size/--test_size' in capsys.readouterr().err


def test_copy_baseline():
  scores = corpus.copy_baseline([('the same five words here', 'the same five words here')])
  assert scores['bleu'] == pytest.approx(100.0)
  assert corpus.copy_baseline([('abc', 'xyz')])['bleu'] == 0.0
