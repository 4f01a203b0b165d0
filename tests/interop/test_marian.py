"""`jaxformer import` of Hugging Face Marian folders: the imported model
computes PyTorch's logits, decodes as `generate` does, and tokenises as
`MarianTokenizer`; bad folders fail with one line and leave nothing.

The folders are random-weight `MarianMTModel`s with SentencePiece models
trained here (no hub): see marian_folders.py.
"""
import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('safetensors')

import marian_folders  # noqa: E402
from marian_folders import up_to_eos  # noqa: E402

from jaxformer.cli import main as cli
from jaxformer.inference import beam_search, search
from jaxformer.interop import marian
from jaxformer.checkpoints import trained

SHAPES = {
    'shared-swish-scaled-2+1': dict(
        separate=False, activation='swish', scale_embedding=True,
        encoder_layers=2, decoder_layers=1, seed=1),
    'separate-gelu-unscaled-1+2': dict(
        separate=True, activation='gelu', scale_embedding=False,
        encoder_layers=1, decoder_layers=2, seed=2),
}
DECODE_LEN = 16


class Imported:
  """A Marian folder, its import and both sides' models and tokenizers."""

  def __init__(self, root, name, shape):
    from transformers import MarianMTModel
    self.folder = str(root / name)
    self.out = str(root / f'{name}-jaxformer')
    self.shape = shape
    marian_folders.write_folder(self.folder, **shape)
    assert cli.main(['import', '--from', self.folder, '--out', self.out]) == 0
    self.ours = trained.load(self.out)
    self.hf = MarianMTModel.from_pretrained(self.folder).eval()
    self.hf_tok = marian_folders.hf_tokenizer(self.folder, shape['separate'])

  def rows(self, texts, target=False):
    """Token rows [len(texts), width] padded with the pad id."""
    tok = self.ours.target_tok if target else self.ours.source_tok
    ids = tok.encode(texts)
    rows = np.full((len(ids), max(map(len, ids))),
                   self.ours.model_config.pad_id, np.int32)
    for i, row in enumerate(ids):
      rows[i, :len(row)] = row
    return rows

  def generate(self, rows, **settings):
    """HF `generate` without its start token, made comparable: no forced EOS
    at the maximum length, no sampling."""
    pad = self.ours.model_config.pad_id
    with torch.no_grad():
      out = self.hf.generate(
          input_ids=torch.tensor(rows, dtype=torch.long),
          attention_mask=torch.tensor(rows != pad), do_sample=False,
          max_new_tokens=DECODE_LEN, forced_eos_token_id=None, **settings)
    return out.numpy()[:, 1:]


@pytest.fixture(scope='module', params=sorted(SHAPES))
def imported(request, tmp_path_factory):
  return Imported(tmp_path_factory.mktemp('marian'), request.param,
                  SHAPES[request.param])


def sentences(count=16, seed=5):
  return marian_folders.test_texts(count, seed)


def test_the_import_has_marians_options(imported):
  config = imported.ours.model_config
  hf = imported.hf.config
  assert (config.pad_id, config.eos_id, config.decoder_start_id) == (
      hf.pad_token_id, hf.eos_token_id, hf.decoder_start_token_id)
  assert config.sinusoid_layout == 'halves' and config.output_bias
  assert config.zero_pad_embedding and config.norm_position == 'post'
  assert config.scale_embedding == imported.shape['scale_embedding']
  assert config.activation == {'swish': 'swish', 'gelu': 'gelu_exact'}[
      imported.shape['activation']]
  assert config.share_embeddings == (
      'target' if imported.shape['separate'] else 'all')
  bias = np.asarray(imported.ours.params['decoder']['output_bias'])
  np.testing.assert_array_equal(
      bias, imported.hf.final_logits_bias.numpy().reshape(-1))
  assert np.abs(bias).max() > 0.1  # final_logits_bias is not zero.


@pytest.mark.slow
def test_logits_equal_pytorchs(imported):
  sources = imported.rows(sentences())
  targets = imported.rows(sentences(seed=9)[::-1], target=True)
  assert marian_folders.logit_difference(imported.ours, imported.hf, sources,
                                         targets) < 1e-5


@pytest.mark.slow
def test_greedy_and_beam_outputs_equal_generate(imported):
  config = imported.ours.model_config
  rows = imported.rows(sentences())
  greedy = np.asarray(search.greedy_decode(
      imported.ours.params, config, rows, max_decode_len=DECODE_LEN))
  beams, _ = beam_search.beam_search(imported.ours.params, config, rows,
                                     beam_size=4, alpha=0.0,
                                     max_decode_len=DECODE_LEN)
  # alpha 0 (no length penalty) is HF's length_penalty=0.
  theirs = {'greedy': imported.generate(rows, num_beams=1),
            'beam 4': imported.generate(rows, num_beams=4, length_penalty=0.0,
                                        early_stopping=False)}
  ours = {'greedy': greedy, 'beam 4': np.asarray(beams[:, 0])}
  for kind in ours:
    got = [up_to_eos(r, config.eos_id) for r in ours[kind]]
    want = [up_to_eos(r, config.eos_id) for r in theirs[kind]]
    print(f'{kind}: {sum(a == b for a, b in zip(got, want))}/{len(want)} '
          'outputs equal')
    assert got == want
  distinct = {tuple(r) for r in (up_to_eos(r, config.eos_id) for r in greedy)}
  assert len(distinct) >= 3  # The outputs depend on the source.


def test_tokenisation_equals_marian_tokenizer(imported):
  texts = marian_folders.test_texts(300, 7)
  tok, ours = imported.hf_tok, imported.ours
  source = ours.source_tok.encode(texts)
  target = ours.target_tok.encode(texts)
  assert source == [tok(t)['input_ids'] for t in texts]
  assert target == [tok(text_target=t)['input_ids'] for t in texts]
  unknown = sum(ours.source_tok.unk_id in row for row in source)
  assert 0 < unknown < len(texts)  # Some with unknown pieces, some without.
  assert [ours.target_tok.decode(row) for row in target] == [
      tok.decode(row, skip_special_tokens=True) for row in target]
  ids = np.random.default_rng(0).integers(
      0, ours.target_tok.vocab_size, (50, 12))
  assert [ours.target_tok.decode(row) for row in ids] == [
      tok.decode(up_to_eos(row, ours.target_tok.eos_id),
                 skip_special_tokens=True) for row in ids]


@pytest.mark.slow
@pytest.mark.parametrize('imported', ['shared-swish-scaled-2+1'],
                         indirect=True)  # One shape is enough for commands.
def test_translate_and_evaluate_commands_give_what_generate_decodes(
    imported, tmp_path, capsys):
  texts = sentences(4, 11)
  hf = imported.generate(imported.rows(texts), num_beams=1)
  expected = [imported.hf_tok.decode(row, skip_special_tokens=True)
              for row in hf]
  (tmp_path / 'in.txt').write_text('\n'.join(texts) + '\n')
  capsys.readouterr()
  assert cli.main(['translate', '--workdir', imported.out, '--input',
                   str(tmp_path / 'in.txt'), '--beam', '1']) == 0
  assert capsys.readouterr().out.splitlines() == expected
  # evaluate decodes the TSV through the data pipeline (padded with 0).
  (tmp_path / 'test.tsv').write_text(''.join(f'{t}\tx\n' for t in texts))
  hypotheses = str(tmp_path / 'test_hypotheses.txt')
  assert cli.main(['evaluate', '--workdir', imported.out, '--beam', '1',
                   f'--config.data.tsv.test={tmp_path}/test.tsv',
                   '--hypotheses', hypotheses]) == 0
  with open(hypotheses) as f:
    assert f.read().splitlines() == expected


# ------------------------------------------------------------ bad inputs ---

@pytest.fixture(scope='module')
def good_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp('good') / 'marian'
  marian_folders.write_folder(str(folder), **SHAPES['shared-swish-scaled-2+1'])
  return folder


def broken_copy(good_folder, tmp_path, damage):
  folder = tmp_path / 'broken'
  shutil.copytree(good_folder, folder)
  damage(folder)
  return folder


def fails_with_one_line(folder, tmp_path, capsys, *words):
  out = tmp_path / 'out'
  capsys.readouterr()
  assert cli.main(['import', '--from', str(folder), '--out', str(out)]) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('jaxformer import: error:')
  for word in words:
    assert word in lines[0], lines[0]
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if 'partial' in p]


def write_json(path, change):
  import json
  data = json.loads(path.read_text())
  change(data)
  path.write_text(json.dumps(data))


@pytest.mark.parametrize('damage, words', [
    (lambda f: (f / 'config.json').unlink(), ('config.json',)),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(model_type='bart')),
     ('model_type', "'bart'")),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(normalize_before=True)),
     ('normalize_before',)),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(activation_function='tanh')),
     ('activation_function',)),
    (lambda f: (f / 'target.spm').unlink(), ('target.spm', 'missing')),
    (lambda f: write_json(f / 'vocab.json', lambda v: v.pop('<filler0>', None)
                          or v.pop(sorted(v, key=v.get)[5])),
     ('vocab.json',)),
    (lambda f: (f / 'model.safetensors').write_bytes(
        (f / 'model.safetensors').read_bytes()[:5000]),
     ('model.safetensors', 'truncated')),
    (lambda f: (f / 'model.safetensors').unlink(), ('model.safetensors',)),
], ids=['no-config', 'not-marian', 'pre-norm', 'activation',
        'missing-tokenizer', 'mismatched-vocab', 'truncated-weights',
        'no-weights'])
def test_bad_folders_fail_with_one_line_leaving_nothing(
    good_folder, tmp_path, capsys, damage, words):
  fails_with_one_line(broken_copy(good_folder, tmp_path, damage), tmp_path,
                      capsys, *words)


def test_an_existing_out_is_not_overwritten(good_folder, tmp_path, capsys):
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'mine').write_text('keep')
  capsys.readouterr()
  assert cli.main(['import', '--from', str(good_folder), '--out',
                   str(tmp_path / 'out')]) == 1
  assert 'already exists' in capsys.readouterr().err
  assert (tmp_path / 'out' / 'mine').read_text() == 'keep'


def test_a_nonzero_pad_row_is_reported_and_imported_as_zeros(
    good_folder, tmp_path, capsys):
  from safetensors.numpy import load_file, save_file

  def damage(folder):
    weights = load_file(folder / 'model.safetensors')
    weights['model.shared.weight'][-1] = 0.25
    save_file(weights, folder / 'model.safetensors')
  folder = broken_copy(good_folder, tmp_path, damage)
  capsys.readouterr()
  assert cli.main(['import', '--from', str(folder), '--out',
                   str(tmp_path / 'out')]) == 0
  assert 'warning: the pad row' in capsys.readouterr().err
  model = trained.load(str(tmp_path / 'out'))
  table = np.asarray(model.params['source_embed']['embedding'])
  assert not table[model.model_config.pad_id].any()


# ----------------------------------------------- what the import trusts ---

def with_bin_weights(good_folder, tmp_path, keep_safetensors: bool):
  """A copy of the good folder with its weights as pytorch_model.bin too
  (or only)."""
  from safetensors.torch import load_file

  def convert(folder):
    torch.save(load_file(folder / 'model.safetensors'),
               folder / 'pytorch_model.bin')
    if not keep_safetensors:
      (folder / 'model.safetensors').unlink()
  return broken_copy(good_folder, tmp_path, convert)


def test_bin_weights_need_a_torch_whose_weights_only_load_is_safe(
    good_folder, tmp_path, capsys, monkeypatch):
  """Below torch 2.10 torch.load(weights_only=True) can be made to run
  code (CVE-2025-32434, CVE-2026-24747): such a torch never unpickles."""
  folder = with_bin_weights(good_folder, tmp_path, keep_safetensors=False)
  assert marian.read_weights(str(folder))  # This torch: pyproject's floor.
  monkeypatch.setattr(torch, '__version__', '2.5.1+cpu')
  monkeypatch.setattr(torch, 'load', None)  # Never reached.
  fails_with_one_line(folder, tmp_path, capsys, 'pytorch_model.bin',
                      'torch 2.5.1+cpu is installed', 'torch>=2.10',
                      'model.safetensors')


def test_safetensors_are_read_whenever_the_folder_has_them(
    good_folder, tmp_path, monkeypatch):
  folder = with_bin_weights(good_folder, tmp_path, keep_safetensors=True)
  (folder / 'pytorch_model.bin').write_bytes(b'not read')
  monkeypatch.setattr(torch, '__version__', '2.5.1')
  assert marian.read_weights(str(folder))


def test_the_import_records_its_folder_only_when_asked(good_folder, tmp_path):
  from jaxformer.checkpoints import exports
  for flags, source in (([], ''), (['--keep-provenance'], str(good_folder))):
    out = tmp_path / f'out{len(flags)}'
    assert cli.main(['import', '--from', str(good_folder), '--out', str(out),
                     *flags]) == 0
    extra, _ = exports.restore_export(str(out))
    assert extra['source'] == source
    assert (str(good_folder) in json.dumps(extra)) == bool(flags)
