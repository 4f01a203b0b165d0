"""`jaxformer import` checks a folder before it builds anything from it
(jaxformer/interop/config_bounds.py): an oversized or zero size in
config.json is refused, naming the key, within 5 s and 300 MB (each run in
a process whose address space is capped 300 MB above what it holds once
jaxformer is imported); a file linking out of the folder is refused; an
index naming a path outside the folder and a pytorch_model.bin that is not
a state dict are each one clear line."""
import json
import os
import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')

import bert_folders  # noqa: E402
import llama_folders  # noqa: E402
import m2m100_folders  # noqa: E402
import marian_folders  # noqa: E402

from jaxformer.cli import main as cli  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
MEMORY = 300 << 20
SECONDS = 5.0

# In the child: jaxformer imported, then the address space capped at what
# it holds + 300 MB, then the import timed.
BOUNDED_IMPORT = '''
import resource, sys, time
from jaxformer.cli import main as cli
from jaxformer.interop import bert, llama, m2m100, marian  # noqa: F401
held = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (held + int(sys.argv[3]),) * 2)
start = time.monotonic()
try:
  code = cli.main(['import', '--from', sys.argv[1], '--out', sys.argv[2]])
except SystemExit as e:
  code = e.code
print(f'seconds={time.monotonic() - start:.2f} code={code}', flush=True)
'''


@pytest.fixture(scope='module')
def folders(tmp_path_factory):
  """One small folder of each family."""
  root = tmp_path_factory.mktemp('families')
  for name in ('llama3-gqa-untied-sharded', 'qwen2-mqa-tied-bf16'):
    llama_folders.write_folder(str(root / name), name)
  m2m100_folders.write_folder(str(root / 'm2m100'), tokenizer='m2m100',
                              encoder_layers=2, decoder_layers=1, seed=1)
  marian_folders.write_folder(str(root / 'marian'), separate=False,
                              activation='swish', scale_embedding=True,
                              encoder_layers=2, decoder_layers=1, seed=3)
  bert_folders.write_folder(str(root / 'bert'), 'bert-cls2-vocab-txt')
  return root


def changed(folders, tmp_path, family, **changes):
  folder = tmp_path / family
  shutil.copytree(folders / family, folder, symlinks=True)
  path = folder / 'config.json'
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
  return folder


OVERSIZED = [
    ('llama3-gqa-untied-sharded', dict(num_hidden_layers=10**6),
     'num_hidden_layers=1000000, but the weights hold 2 layers'),
    ('qwen2-mqa-tied-bf16', dict(num_hidden_layers=10**8),
     'num_hidden_layers=100000000, but the weights hold'),
    ('m2m100', dict(encoder_layers=10**6),
     'encoder_layers=1000000, but the weights hold 2 layers'),
    ('marian', dict(decoder_layers=10**6),
     'decoder_layers=1000000, but the weights hold 1 layers'),
    ('bert', dict(num_hidden_layers=10**6), 'num_hidden_layers=1000000'),
    ('llama3-gqa-untied-sharded', dict(vocab_size=10**9),
     'vocab_size=1000000000 is larger than any dimension'),
    ('llama3-gqa-untied-sharded', dict(intermediate_size=10**9),
     'intermediate_size=1000000000 is larger'),
    ('qwen2-mqa-tied-bf16', dict(max_position_embeddings=10**12),
     'max_position_embeddings=1000000000000 is over'),
    ('m2m100', dict(d_model=10**7), 'd_model=10000000 is larger'),
    ('llama3-gqa-untied-sharded', dict(num_attention_heads=0),
     'num_attention_heads=0: a size must be a whole number above 0'),
    ('bert', dict(hidden_size=-4), 'hidden_size=-4: a size must be'),
]


@pytest.mark.slow
@pytest.mark.parametrize('family, changes, words', OVERSIZED,
                         ids=[f'{f}-{next(iter(c))}' for f, c, _ in OVERSIZED])
def test_an_oversized_config_is_refused_before_it_allocates(
    folders, tmp_path, family, changes, words):
  folder = changed(folders, tmp_path, family, **changes)
  result = subprocess.run(
      [sys.executable, '-c', BOUNDED_IMPORT, str(folder),
       str(tmp_path / 'out'), str(MEMORY)], capture_output=True, text=True,
      timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
  report = result.stdout.strip().splitlines()[-1]
  seconds, code = (part.split('=')[1] for part in report.split())
  assert code == '1', result.stderr[-3000:]
  error = result.stderr.strip().splitlines()[-1]
  assert f'{folder}/config.json: ' in error and words in error, error
  assert float(seconds) < SECONDS
  assert not (tmp_path / 'out').exists()


def fails(capsys, folder, out, *words) -> str:
  capsys.readouterr()
  assert cli.main(['import', '--from', str(folder), '--out', str(out)]) == 1
  error = capsys.readouterr().err.strip()
  assert len(error.splitlines()) == 1 and all(w in error for w in words), error
  assert not os.path.exists(out)
  return error


def test_a_zero_head_count_is_refused_by_name(folders, tmp_path, capsys):
  folder = changed(folders, tmp_path, 'qwen2-mqa-tied-bf16',
                   num_attention_heads=0)
  fails(capsys, folder, tmp_path / 'out', 'num_attention_heads=0')


@pytest.mark.parametrize('family', ['llama3-gqa-untied-sharded', 'm2m100',
                                    'marian', 'bert'])
def test_a_link_out_of_the_folder_is_refused(folders, tmp_path, capsys,
                                             family):
  secret = tmp_path / 'secret.txt'
  secret.write_text('the password')
  folder = tmp_path / family
  shutil.copytree(folders / family, folder)
  (folder / 'chat_template.jinja').symlink_to(secret)
  fails(capsys, folder, tmp_path / 'out',
        f'{folder}/chat_template.jinja is a link to {secret}, outside')


def test_a_hugging_face_cache_snapshot_links_to_its_blobs(folders, tmp_path,
                                                          capsys):
  """The cache's snapshot files are links into the repository's blobs/:
  those import."""
  repository = tmp_path / 'models--org--tiny'
  snapshot = repository / 'snapshots' / '0123abcd'
  (repository / 'blobs').mkdir(parents=True)
  snapshot.mkdir(parents=True)
  for path in sorted((folders / 'qwen2-mqa-tied-bf16').iterdir()):
    blob = repository / 'blobs' / f'blob-{path.name}'
    shutil.copy(path, blob)
    (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
  capsys.readouterr()
  assert cli.main(['import', '--from', str(snapshot), '--out',
                   str(tmp_path / 'out')]) == 0, capsys.readouterr().err


def test_an_index_naming_a_path_outside_is_not_called_missing(
    folders, tmp_path, capsys):
  folder = tmp_path / 'folder'
  shutil.copytree(folders / 'llama3-gqa-untied-sharded', folder)
  index = folder / 'model.safetensors.index.json'
  contents = json.loads(index.read_text())
  contents['weight_map']['model.norm.weight'] = '/etc/passwd'
  index.write_text(json.dumps(contents))
  error = fails(capsys, folder, tmp_path / 'out', "names '/etc/passwd' (for "
                'model.norm.weight), which is not a file name in')
  assert 'missing' not in error


def test_a_pytorch_model_bin_holding_a_list_is_one_line(folders, tmp_path,
                                                        capsys):
  folder = tmp_path / 'folder'
  shutil.copytree(folders / 'marian', folder)
  for path in folder.glob('model*.safetensors'):
    path.unlink()
  torch.save([1, 2, 3], folder / 'pytorch_model.bin')
  fails(capsys, folder, tmp_path / 'out',
        f'{folder}/pytorch_model.bin holds a list, not a state dict')


def test_no_machine_path_in_any_file_of_an_import_or_export(folders, tmp_path,
                                                            capsys):
  """Every file of an import and of its Hugging Face export: no path of this machine (Orbax's commit markers included),
  and readable by others as a 022 umask allows; --keep-provenance keeps
  the folder's path."""
  folder = tmp_path / 'folder'
  shutil.copytree(folders / 'qwen2-mqa-tied-bf16', folder)
  imported, hf = tmp_path / 'imported', tmp_path / 'hf'
  previous = os.umask(0o022)
  try:
    for argv in (['import', '--from', str(folder), '--out', str(imported)],
                 ['export', '--workdir', str(imported), '--format', 'hf',
                  '--out', str(hf)]):
      capsys.readouterr()
      assert cli.main(argv) == 0, capsys.readouterr().err
  finally:
    os.umask(previous)
  machine = [str(tmp_path).encode(), os.path.realpath(tmp_path).encode()]
  files = [p for out in (imported, hf) for p in out.rglob('*')
           if p.is_file()]
  assert any(p.name == 'commit_success.txt' for p in files)
  for path in files:
    assert not any(m in path.read_bytes() for m in machine), path
    assert path.stat().st_mode & 0o644 == 0o644, path
  for out in (imported, hf):
    assert out.stat().st_mode & 0o755 == 0o755, out
  kept = tmp_path / 'kept'
  assert cli.main(['import', '--from', str(folder), '--out', str(kept),
                   '--keep-provenance']) == 0
  assert any(str(folder).encode() in p.read_bytes()
             for p in kept.rglob('*') if p.is_file())
