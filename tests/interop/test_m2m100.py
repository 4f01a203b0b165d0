"""`jaxformer import` of Hugging Face M2M100 and NLLB folders (config.json
model_type m2m_100): the imported model computes PyTorch's logits,
tokenises as M2M100Tokenizer / NllbTokenizer with src_lang set, and
translates as `generate(..., forced_bos_token_id=...)` does; bad folders
fail with one line and leave nothing.

The folders are random-weight `M2M100ForConditionalGeneration`s with
SentencePiece models trained here (no hub): see m2m100_folders.py.
"""
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip('torch')
pytest.importorskip('transformers')
pytest.importorskip('safetensors')

import m2m100_folders  # noqa: E402
import marian_folders  # noqa: E402
from marian_folders import up_to_eos  # noqa: E402

from jaxformer.cli import main as cli
from jaxformer.checkpoints import trained
from jaxformer.inference import beam_search, search, target_prefix

SHAPES = {
    'm2m100-2+1': dict(tokenizer='m2m100', encoder_layers=2, decoder_layers=1,
                       eos_boost=1.7, seed=1),
    'nllb-1+2-d24': dict(tokenizer='nllb', encoder_layers=1, decoder_layers=2,
                         d_model=24, heads=3, d_ff=40, spm_size=80,
                         eos_boost=3.3, seed=2),
    'm2m100-wmt21-unscaled-d32': dict(
        tokenizer='m2m100', encoder_layers=1, decoder_layers=1, d_model=32,
        heads=4, d_ff=64, spm_size=50, scale_embedding=False,
        language_codes='wmt21', extra_ids=0, eos_boost=0.3, seed=3),
}
# Language pairs of each tokenizer (source, target).
PAIRS = {'m2m100': [('en', 'de'), ('de', 'fr')],
         'nllb': [('eng_Latn', 'deu_Latn'), ('deu_Latn', 'fra_Latn')]}
DECODE_LEN = 16


class Imported:
  """An M2M100/NLLB folder, its import and both sides' models and
  tokenizers."""

  def __init__(self, root, name, shape):
    from transformers import M2M100ForConditionalGeneration
    self.folder = str(root / name)
    self.out = str(root / f'{name}-jaxformer')
    self.shape = shape
    m2m100_folders.write_folder(self.folder, **shape)
    assert cli.main(['import', '--from', self.folder, '--out', self.out]) == 0
    self.ours = trained.load(self.out)
    self.hf = M2M100ForConditionalGeneration.from_pretrained(
        self.folder).eval()
    self.hf_tok = m2m100_folders.hf_tokenizer(self.folder)
    self.pairs = PAIRS[shape['tokenizer']]
    if shape.get('language_codes') == 'wmt21':
      self.pairs = [('en', 'de'), ('de', 'ru')]

  def rows(self, texts, language):
    """HF's token rows [len(texts), width] of `texts` in `language`,
    padded with the pad id."""
    self.hf_tok.src_lang = language
    ids = [self.hf_tok(t)['input_ids'] for t in texts]
    rows = np.full((len(ids), max(map(len, ids))),
                   self.ours.model_config.pad_id, np.int32)
    for i, row in enumerate(ids):
      rows[i, :len(row)] = row
    return rows

  def generate(self, rows, target, max_new_tokens=DECODE_LEN, **settings):
    """HF `generate` forced to `target`'s token, without its start token."""
    pad = self.ours.model_config.pad_id
    with torch.no_grad():
      out = self.hf.generate(
          input_ids=torch.tensor(rows, dtype=torch.long),
          attention_mask=torch.tensor(rows != pad), do_sample=False,
          forced_bos_token_id=self.hf_tok.convert_tokens_to_ids(
              self.language_token(target)),
          max_new_tokens=max_new_tokens, **settings)
    return out.numpy()[:, 1:]

  def language_token(self, code):
    return (f'__{code}__' if self.shape['tokenizer'] == 'm2m100' else code)


@pytest.fixture(scope='module', params=sorted(SHAPES))
def imported(request, tmp_path_factory):
  """One import per shape, shared by the module's tests."""
  root = tmp_path_factory.mktemp('m2m100')
  return Imported(root, request.param, SHAPES[request.param])


def sentences(count=16, seed=5):
  """Sentences of known words, some with unseen characters."""
  return m2m100_folders.test_texts(count, seed)


def test_the_import_has_m2m100s_options(imported):
  config = imported.ours.model_config
  hf = imported.hf.config
  assert (config.pad_id, config.eos_id, config.decoder_start_id) == (
      hf.pad_token_id, hf.eos_token_id, hf.decoder_start_token_id)
  assert config.norm_position == 'pre' and config.activation == 'relu'
  assert config.sinusoid_layout == 'tensor2tensor'
  assert config.position_offset == hf.pad_token_id + 1
  assert config.scale_embedding == hf.scale_embedding
  assert config.share_embeddings == 'all' and not config.output_bias
  assert imported.ours.source_tok.vocab_size == hf.vocab_size


@pytest.mark.slow
def test_logits_equal_pytorchs(imported):
  (source, _), (target, _) = imported.pairs
  sources = imported.rows(sentences(), source)
  targets = imported.rows(sentences(seed=9)[::-1], target)
  assert marian_folders.logit_difference(imported.ours, imported.hf, sources,
                                         targets) < 1e-5


def test_tokenisation_equals_hugging_faces(imported):
  texts = m2m100_folders.test_texts(300, 7)
  tok, ours = imported.hf_tok, imported.ours.source_tok
  unknown = 0
  for language, _ in imported.pairs:
    tok.src_lang = language
    mine = ours.with_language(language).encode(texts)
    assert mine == [tok(t)['input_ids'] for t in texts]
    unknown += sum(ours.unk_id in row for row in mine)
  assert 0 < unknown < len(texts) * len(imported.pairs)
  # Decoding drops the language tokens (v5's M2M100Tokenizer keeps them in
  # the text; NllbTokenizer drops them as special tokens).
  languages = set(ours.languages.values())
  ids = np.random.default_rng(0).integers(0, ours.vocab_size, (50, 12))
  ids[:, 0] = ours.language_id(imported.pairs[0][1])
  for row in [*mine, *ids]:
    kept = [i for i in up_to_eos(row, ours.eos_id)
            if i not in languages and i < len(tok)]
    assert ours.decode(row) == tok.decode(kept, skip_special_tokens=True)


@pytest.mark.slow
def test_greedy_and_beam_outputs_equal_generate(imported):
  config, tok = imported.ours.model_config, imported.ours.source_tok
  eos, stops = config.eos_id, []
  for source, target in imported.pairs:
    rows = imported.rows(sentences(), source)
    forced = tok.language_id(target)
    greedy = np.asarray(search.greedy_decode(
        imported.ours.params, config, rows, max_decode_len=DECODE_LEN,
        forced_ids=forced))
    beams, _ = beam_search.beam_search(
        imported.ours.params, config, rows, beam_size=4, alpha=0.0,
        max_decode_len=DECODE_LEN, forced_ids=forced)
    # alpha 0 (no length penalty) is HF's length_penalty=0.
    theirs = {'greedy': imported.generate(rows, target, num_beams=1),
              'beam 4': imported.generate(rows, target, num_beams=4,
                                          length_penalty=0.0,
                                          early_stopping=False)}
    ours = {'greedy': greedy, 'beam 4': np.asarray(beams[:, 0])}
    for kind in ours:
      got = [up_to_eos(r, eos) for r in ours[kind]]
      want = [up_to_eos(r, eos) for r in theirs[kind]]
      print(f'{source}->{target} {kind}: '
            f'{sum(a == b for a, b in zip(got, want))}/{len(want)} equal, '
            f'{sum(eos in r for r in got)} end at EOS, the others at the '
            'length cap')
      assert got == want
      assert all(r[0] == forced for r in got)
    stops += [eos in r for r in (up_to_eos(r, eos) for r in greedy)]
  assert any(stops) and not all(stops)  # EOS and the length cap.


def hf_texts(imported, rows):
  """HF's decoded translations of generate's `rows`, language token left
  out (v5's M2M100Tokenizer keeps it in the text)."""
  languages = set(imported.ours.source_tok.languages.values())
  return [imported.hf_tok.decode([i for i in row if i not in languages],
                                 skip_special_tokens=True) for row in rows]


@pytest.mark.slow
@pytest.mark.parametrize('imported', ['nllb-1+2-d24'], indirect=True)
def test_translate_and_evaluate_commands_give_what_generate_decodes(
    imported, tmp_path, capsys):
  texts = sentences(4, 11)
  (source, target), _ = imported.pairs
  rows = imported.rows(texts, source)
  # What translate decodes with --max-extra-len 0: the longest source,
  # rounded up to a multiple of 16.
  length = search.decode_length(rows.shape[1], 0, multiple=16)
  expected = hf_texts(imported, imported.generate(
      rows, target, max_new_tokens=length, num_beams=1))
  assert any(expected)
  (tmp_path / 'in.txt').write_text('\n'.join(texts) + '\n')
  capsys.readouterr()
  assert cli.main(['translate', '--workdir', imported.out, '--input',
                   str(tmp_path / 'in.txt'), '--beam', '1',
                   '--max-extra-len', '0', '--source-lang', source,
                   '--target-lang', target]) == 0
  assert capsys.readouterr().out.splitlines() == expected
  # evaluate decodes the TSV through the data pipeline, the pair from
  # config, up to data.max_target_length tokens (the model's max_len).
  expected = hf_texts(imported, imported.generate(
      rows, target, num_beams=1,
      max_new_tokens=imported.ours.config.data.max_target_length))
  (tmp_path / 'test.tsv').write_text(''.join(f'{t}\tx\n' for t in texts))
  hypotheses = str(tmp_path / 'test_hypotheses.txt')
  assert cli.main(['evaluate', '--workdir', imported.out, '--beam', '1',
                   f'--config.data.tsv.test={tmp_path}/test.tsv',
                   f'--config.data.source_lang={source}',
                   f'--config.data.target_lang={target}',
                   '--config.decode.max_extra_len=0',
                   '--hypotheses', hypotheses]) == 0
  with open(hypotheses) as f:
    assert f.read().splitlines() == expected


def one_error_line(capsys, command) -> str:
  capsys.readouterr()
  assert cli.main(command) == 1
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1, lines
  return lines[0]


@pytest.mark.parametrize('imported', ['m2m100-2+1'], indirect=True)
def test_a_language_the_tokenizer_lacks_is_named_with_the_close_ones(
    imported, tmp_path, capsys):
  (tmp_path / 'in.txt').write_text('the house\n')
  translate = ['translate', '--workdir', imported.out, '--input',
               str(tmp_path / 'in.txt')]
  line = one_error_line(capsys, translate + ['--source-lang', 'en',
                                             '--target-lang', 'dee'])
  assert "'dee'" in line and 'close ones' in line and 'de' in line
  line = one_error_line(capsys, translate + ['--source-lang', 'en'])
  assert '--target-lang' in line


# ------------------------------------------------------------ bad inputs ---

@pytest.fixture(scope='module')
def good_folder(tmp_path_factory):
  folder = tmp_path_factory.mktemp('good') / 'm2m100'
  m2m100_folders.write_folder(str(folder), **SHAPES['m2m100-2+1'])
  return folder


def write_json(path, change):
  import json
  data = json.loads(path.read_text())
  change(data)
  path.write_text(json.dumps(data))


@pytest.mark.parametrize('damage, words', [
    (lambda f: (f / 'vocab.json').unlink(), ('vocab.json', 'missing')),
    (lambda f: (f / 'sentencepiece.bpe.model').unlink(),
     ('sentencepiece.bpe.model', 'missing')),
    (lambda f: write_json(f / 'tokenizer_config.json', lambda c: c.update(
        tokenizer_class='NllbTokenizer')), ('tokenizer.json', 'missing')),
    (lambda f: (f / 'model.safetensors').write_bytes(
        (f / 'model.safetensors').read_bytes()[:5000]),
     ('model.safetensors', 'truncated')),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(decoder_ffn_dim=48)),
     ('decoder_ffn_dim',)),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(activation_function='tanh')),
     ('activation_function',)),
    (lambda f: write_json(f / 'config.json',
                          lambda c: c.update(vocab_size=c['vocab_size'] + 1)),
     ('model.shared.weight', 'shape')),
], ids=['no-vocab', 'no-spm', 'nllb-without-tokenizer-json',
        'truncated-weights', 'ffn-dims-differ', 'activation', 'vocab-size'])
def test_bad_folders_fail_with_one_line_leaving_nothing(
    good_folder, tmp_path, capsys, damage, words):
  folder = tmp_path / 'broken'
  shutil.copytree(good_folder, folder)
  damage(folder)
  out = tmp_path / 'out'
  line = one_error_line(capsys, ['import', '--from', str(folder), '--out',
                                 str(out)])
  assert line.startswith('jaxformer import: error:')
  for word in words:
    assert word in line, line
  assert not out.exists()
  assert not [p for p in os.listdir(tmp_path) if 'partial' in p]


# ----------------------------------------------------------------- export ---

def test_import_export_hf_import_is_bitwise(imported, tmp_path, capsys):
  from transformers import M2M100ForConditionalGeneration
  hf_dir, again = str(tmp_path / 'hf'), str(tmp_path / 'again')
  assert cli.main(['export', '--format', 'hf', '--from', imported.out,
                   '--out', hf_dir]) == 0
  assert 'M2M100ForConditionalGeneration' in capsys.readouterr().out
  # transformers loads it, with its tokenizer, and computes the same.
  model = M2M100ForConditionalGeneration.from_pretrained(hf_dir).eval()
  tok = m2m100_folders.hf_tokenizer(hf_dir)
  texts = m2m100_folders.test_texts(100, 3)
  for language, _ in imported.pairs:
    tok.src_lang = imported.hf_tok.src_lang = language
    assert [tok(t)['input_ids'] for t in texts] == [
        imported.hf_tok(t)['input_ids'] for t in texts]
  # The logits differ from the original's only by its key biases, which
  # the softmax cancels and jaxformer drops (written as zeros).
  rows = imported.rows(sentences(), imported.pairs[0][0])
  inputs = dict(input_ids=torch.tensor(rows, dtype=torch.long),
                decoder_input_ids=torch.tensor(rows[:, :5], dtype=torch.long))
  with torch.no_grad():
    np.testing.assert_allclose(model(**inputs).logits.numpy(),
                               imported.hf(**inputs).logits.numpy(),
                               atol=1e-5, rtol=0)
  assert cli.main(['import', '--from', hf_dir, '--out', again]) == 0
  back = trained.load(again)
  for (path, a), (_, b) in zip(
      jax_leaves(imported.ours.params), jax_leaves(back.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), path
  assert back.model_config == imported.ours.model_config
  assert back.source_tok.serialized_model_proto() != b''
  for language, _ in imported.pairs:
    assert back.source_tok.with_language(language).encode(texts) == \
        imported.ours.source_tok.with_language(language).encode(texts)


def jax_leaves(params):
  import jax
  return jax.tree_util.tree_leaves_with_path(params)


@pytest.mark.parametrize('imported', ['m2m100-2+1', 'nllb-1+2-d24'],
                         indirect=True)
def test_ct2_export_translates_as_generate(imported, tmp_path, capsys):
  """Called as CTranslate2's documentation calls M2M100: source tokens
  from the tokenizer (language token and </s> included), target_prefix
  the target language token."""
  ctranslate2 = pytest.importorskip('ctranslate2')
  out = str(tmp_path / 'ct2')
  assert cli.main(['export', '--format', 'ct2', '--from', imported.out,
                   '--out', out]) == 0
  assert 'target_prefix' in capsys.readouterr().out
  tok = m2m100_folders.hf_tokenizer(out)  # The folder's own tokenizer.
  translator = ctranslate2.Translator(out)
  eos = imported.ours.model_config.eos_id
  texts = sentences()
  for source, target in imported.pairs:
    tok.src_lang = source
    pieces = [tok.convert_ids_to_tokens(tok.encode(t)) for t in texts]
    prefix = imported.language_token(target)
    results = translator.translate_batch(
        pieces, target_prefix=[[prefix]] * len(texts), beam_size=1,
        max_decoding_length=DECODE_LEN)
    got = [tok.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
    want = imported.generate(imported.rows(texts, source), target,
                             num_beams=1)
    want = [[i for i in up_to_eos(row, eos) if i != eos] for row in want]
    print(f'{source}->{target}: {sum(a == b for a, b in zip(got, want))}/'
          f'{len(want)} CTranslate2 outputs equal generate\'s')
    assert got == want
  int8 = str(tmp_path / 'int8')
  assert cli.main(['export', '--format', 'ct2', '--quantization', 'int8',
                   '--from', imported.out, '--out', int8]) == 0
  result = ctranslate2.Translator(int8, compute_type='int8').translate_batch(
      pieces[:2], target_prefix=[[prefix]] * 2, max_decoding_length=8)
  assert all(r.hypotheses[0][0] == prefix for r in result)


@pytest.mark.slow
@pytest.mark.parametrize('imported', ['m2m100-2+1'], indirect=True)
def test_constraints_follow_the_forced_language_token(imported, tmp_path,
                                                      capsys):
  # Without phrases the constrained search is plain beam search (its
  # language token forced alike); with them, each line holds its own.
  texts = sentences(6, 13)
  (source, target), _ = imported.pairs
  (tmp_path / 'in.txt').write_text('\n'.join(texts) + '\n')
  command = ['translate', '--workdir', imported.out, '--input',
             str(tmp_path / 'in.txt'), '--beam', '3', '--max-extra-len',
             '4', '--source-lang', source, '--target-lang', target]
  capsys.readouterr()
  assert cli.main(command) == 0
  plain = capsys.readouterr().out
  (tmp_path / 'none.tsv').write_text('\n' * len(texts))
  assert cli.main([*command, '--constraints',
                   str(tmp_path / 'none.tsv')]) == 0
  assert capsys.readouterr().out == plain
  words = [max((w for w in text.split() if w.isalpha()), key=len)
           for text in texts]
  (tmp_path / 'terms.tsv').write_text('\n'.join(words) + '\n')
  assert cli.main([*command, '--constraints',
                   str(tmp_path / 'terms.tsv')]) == 0
  # A word as the tiny vocabulary spells it (it lacks some letters).
  tok = imported.ours.target_tok
  inner = getattr(tok, 'inner', tok)
  for line, word in zip(capsys.readouterr().out.splitlines(), words):
    spelled = inner.decode(target_prefix.text_ids(tok, word)).strip()
    assert spelled and spelled in line, (line, spelled)
