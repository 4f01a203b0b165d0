"""BERT-family folders in and out: `jaxformer import` of Hugging Face BERT,
RoBERTa and XLM-R folders computes PyTorch's logits (within 1e-5 in
float32; a base model's first-token states), tokenises as AutoTokenizer
does (300 sentences, single and in pairs), and `jaxformer predict
--jsonl` prints Hugging Face's logits.

The folders (bert_folders.py) are random-weight models in several shapes:
with and without a pooler, 2 and 5 labels, a regressor, base models with a
fresh head, 1 to 3 layers, each tokenizer in the form the hub ships it.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
pytest.importorskip('safetensors')
pytest.importorskip('tokenizers')

import bert_folders  # noqa: E402
import hf_tokenizer_folders  # noqa: E402

from jaxformer.checkpoints import trained  # noqa: E402
from jaxformer.cli import main as cli  # noqa: E402
from jaxformer.model.transformer import PooledEncoder  # noqa: E402


class Imported:
  """A folder, its import, Hugging Face's model and tokenizer."""

  def __init__(self, root, name):
    self.name = name
    self.folder = str(root / name)
    self.out = str(root / f'{name}-jaxformer')
    self.hf_config = bert_folders.write_folder(self.folder, name)
    self.base = name in bert_folders.NUM_LABELS
    args = ['import', '--from', self.folder, '--out', self.out]
    if self.base:
      args += ['--num-labels', str(bert_folders.NUM_LABELS[name])]
    assert cli.main(args) == 0
    self.ours = trained.load(self.out)
    self.config = self.ours.model_config
    self.tokenizer = self.ours.source_tok
    self.hf = bert_folders.hf_model(self.folder, name)
    self.hf_tokenizer = transformers.AutoTokenizer.from_pretrained(self.folder)

  def pairs(self, count=7):
    texts = hf_tokenizer_folders.training_texts(2 * count, seed=5)
    return [(texts[2 * i], texts[2 * i + 1] if i % 2 else None)
            for i in range(count)]

  def rows(self, pairs):
    """(ids, token types) [b, s] of the pairs, padded."""
    encoded = [self.tokenizer.encode_pair(a, b) for a, b in pairs]
    pad = self.config.pad_id
    return (bert_folders.pad_rows([ids for ids, _ in encoded], pad),
            bert_folders.pad_rows([types for _, types in encoded], 0))


_IMPORTS = {}  # One import per shape for the module, whichever test asks.
# The shapes with their own head (a fresh head has no logits to compare).
HEADED = sorted(set(bert_folders.SHAPES) - set(bert_folders.NUM_LABELS))


@pytest.fixture(scope='module', params=sorted(bert_folders.SHAPES))
def imported(request, tmp_path_factory):
  if request.param not in _IMPORTS:
    _IMPORTS[request.param] = Imported(tmp_path_factory.mktemp('bert'),
                                       request.param)
  return _IMPORTS[request.param]


@functools.partial(jax.jit, static_argnames=('config', 'task', 'base'))
def _our_outputs(params, ids, types, config, task, base):
  segments = (ids != config.pad_id).astype(jnp.int32)
  if base:  # The encoder's first-token states, before the pooler.
    body = {k: v for k, v in params['body'].items() if k != 'pooler'}
    return PooledEncoder(config.replace(pooler=False)).apply(
        {'params': body}, ids, segments, inputs_token_types=types)
  return task.model(config).apply({'params': params}, ids, segments,
                                  inputs_token_types=types)


def our_outputs(imported, ids, types):
  return np.asarray(_our_outputs(
      imported.ours.params, jnp.asarray(ids, jnp.int32),
      jnp.asarray(types, jnp.int32), imported.config, imported.ours.task,
      imported.base))


def test_the_import_has_the_folders_options(imported):
  config, hf = imported.config, imported.hf_config
  assert (config.d_model, config.num_heads, config.d_ff,
          config.num_encoder_layers) == (
      hf.hidden_size, hf.num_attention_heads, hf.intermediate_size,
      hf.num_hidden_layers)
  assert config.max_len + config.position_offset == (
      hf.max_position_embeddings)
  assert config.position_offset == (0 if hf.model_type == 'bert' else 2)
  assert config.type_vocab_size == hf.type_vocab_size
  assert config.pad_id == hf.pad_token_id
  assert (config.embedding_norm, config.pooler, config.norm_position) == (
      True, True, 'post')
  task, labels = imported.ours.task.name, imported.ours.config.data.labels
  if imported.base:
    assert labels == [str(i) for i in range(
        bert_folders.NUM_LABELS[imported.name])]
  elif hf.problem_type == 'regression':
    assert task == 'regression' and config.regression_dim == 1
  else:
    assert task == 'classification'
    assert labels == [hf.id2label[i] for i in range(hf.num_labels)]


def test_outputs_equal_pytorchs_within_1e_5(imported):
  """Logits of the head (a base model: its first-token states), sentence
  pairs with their token types among the rows."""
  ids, types = imported.rows(imported.pairs())
  theirs = bert_folders.hf_outputs(imported.hf, ids, types,
                                   imported.config.pad_id)
  ours = our_outputs(imported, ids, types)
  difference = np.abs(ours - theirs).max()
  print(f'{imported.name}: max abs difference {difference:.3g} '
        f'(|outputs| up to {np.abs(theirs).max():.3g})')
  assert ours.shape == theirs.shape
  assert difference < 1e-5


def test_tokenisation_equals_autotokenizers_on_300_sentences(imported):
  """Single texts and pairs (accents, case, unknown characters, special
  tokens' text), with and without truncation to the model's positions."""
  texts = hf_tokenizer_folders.sentences(300)
  hf, ours = imported.hf_tokenizer, imported.tokenizer
  assert ours.encode(texts) == hf(texts)['input_ids']
  limit = imported.config.max_len
  for a, b in zip(texts, texts[::-1]):
    expected = hf(a, b, truncation=True, max_length=limit)
    ids, types = ours.encode_pair(a, b, max_length=limit)
    assert ids == expected['input_ids'], (a, b)
    assert types == expected.get('token_type_ids', [0] * len(ids))
  assert ours.encode_pair(texts[3], texts[4])[0] == hf(
      texts[3], texts[4])['input_ids']


@pytest.mark.slow
@pytest.mark.parametrize('imported', HEADED, indirect=True)
def test_predict_jsonl_prints_hugging_faces_logits(imported, tmp_path,
                                                   capsys):
  """`jaxformer predict --jsonl`: one JSON object per input line, pairs
  as tab-separated lines; the logits (values) equal PyTorch's."""
  pairs = imported.pairs()
  lines = [a if b is None else f'{a}\t{b}' for a, b in pairs]
  (tmp_path / 'in.txt').write_text('\n'.join(lines) + '\n')
  capsys.readouterr()
  assert cli.main(['predict', '--workdir', imported.out, '--input',
                   str(tmp_path / 'in.txt'), '--jsonl', '--batch-size',
                   '4']) == 0
  records = [json.loads(line) for line in
             capsys.readouterr().out.strip().splitlines()]
  ids, types = imported.rows(pairs)
  theirs = bert_folders.hf_outputs(imported.hf, ids, types,
                                   imported.config.pad_id)
  key = 'logits' if imported.ours.task.name == 'classification' else 'values'
  ours = np.array([record[key] for record in records])
  assert np.abs(ours - theirs).max() < 1e-5
  if key == 'logits':
    labels = imported.ours.config.data.labels
    assert [r['label'] for r in records] == [labels[i] for i in
                                             theirs.argmax(-1)]


def test_export_hf_loads_in_transformers_and_imports_back_bitwise(
    imported, tmp_path):
  """`export --format hf`: AutoModelForSequenceClassification gives our
  logits (1e-5), AutoTokenizer tokenises as the original folder's did
  (pairs too), and importing the folder again gives the same parameters,
  bitwise."""
  out = str(tmp_path / 'hf')
  assert cli.main(['export', '--format', 'hf', '--from', imported.out,
                   '--out', out]) == 0
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
      out).eval()
  ids, types = imported.rows(imported.pairs())
  theirs = bert_folders.hf_outputs(model, ids, types, imported.config.pad_id)
  ours = np.asarray(_our_outputs(
      imported.ours.params, jnp.asarray(ids, jnp.int32),
      jnp.asarray(types, jnp.int32), imported.config, imported.ours.task,
      False))
  assert np.abs(ours - theirs).max() < 1e-5
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  texts = hf_tokenizer_folders.sentences(100)
  original = imported.hf_tokenizer
  assert tokenizer(texts)['input_ids'] == original(texts)['input_ids']
  assert tokenizer(texts, texts[::-1])['input_ids'] == original(
      texts, texts[::-1])['input_ids']
  assert tokenizer.pad_token_id == imported.config.pad_id
  again = str(tmp_path / 'again')
  assert cli.main(['import', '--from', out, '--out', again]) == 0
  back = trained.load(again)
  assert back.model_config == imported.config
  assert back.task.name == imported.ours.task.name
  jax.tree.map(np.testing.assert_array_equal, back.params,
               imported.ours.params)


def test_export_ct2_encoder_gives_our_logits(imported, tmp_path):
  """`export --format ct2`: a CTranslate2 Encoder whose pooled output
  through head.safetensors gives our logits (float32: 1e-4), fed the ids
  and token types of the exported tokenizer.json; int8 runs."""
  ctranslate2 = pytest.importorskip('ctranslate2')
  import tokenizers
  from safetensors.numpy import load_file
  out = str(tmp_path / 'ct2')
  assert cli.main(['export', '--format', 'ct2', '--from', imported.out,
                   '--out', out]) == 0
  tokenizer = tokenizers.Tokenizer.from_file(f'{out}/tokenizer.json')
  pairs = imported.pairs()
  encodings = [tokenizer.encode(a, b) if b else tokenizer.encode(a)
               for a, b in pairs]
  ids, types = imported.rows(pairs)
  assert [e.ids for e in encodings] == [
      [t for t in row if t != imported.config.pad_id] for row in ids.tolist()]
  encoder = ctranslate2.Encoder(out)
  output = encoder.forward_batch([e.ids for e in encodings],
                                 token_type_ids=[e.type_ids for e in encodings])
  head = load_file(f'{out}/head.safetensors')
  theirs = np.array(output.pooler_output) @ head['weight'].T + head['bias']
  ours = np.asarray(_our_outputs(
      imported.ours.params, jnp.asarray(ids, jnp.int32),
      jnp.asarray(types, jnp.int32), imported.config, imported.ours.task,
      False))
  assert np.abs(ours - theirs).max() < 1e-4
  int8 = str(tmp_path / 'int8')
  assert cli.main(['export', '--format', 'ct2', '--quantization', 'int8',
                   '--from', imported.out, '--out', int8]) == 0
  assert np.isfinite(np.array(ctranslate2.Encoder(int8).forward_batch(
      [encodings[0].ids]).pooler_output)).all()


@pytest.mark.slow
@pytest.mark.parametrize('imported', ['bert-cls2-vocab-txt'], indirect=True)
def test_predict_cuts_long_pairs_as_hugging_face_with_a_warning(
    imported, tmp_path, capsys):
  """A pair longer than the model's positions: cut as truncation=True cuts
  it (longest first), said on stderr; the label as Hugging Face's."""
  a, b = (' '.join(hf_tokenizer_folders.training_texts(30, seed=s))
          for s in (7, 8))
  (tmp_path / 'in.txt').write_text(f'{a}\t{b}\nthe house\n')
  capsys.readouterr()
  assert cli.main(['predict', '--workdir', imported.out, '--input',
                   str(tmp_path / 'in.txt')]) == 0
  out, err = capsys.readouterr()
  assert 'warning: an input of' in err and 'truncation=True' in err
  expected = imported.hf_tokenizer(a, b, truncation=True,
                                   max_length=imported.config.max_len)
  ids = np.array([expected['input_ids']])
  logits = bert_folders.hf_outputs(imported.hf, ids,
                                   np.array([expected['token_type_ids']]),
                                   imported.config.pad_id)
  labels = imported.ours.config.data.labels
  assert out.splitlines()[0] == labels[int(logits.argmax())]


@pytest.mark.parametrize('lowercase, strip_accents', [
    (True, False), (False, True), (True, True)])
def test_vocab_txt_casing_and_accents_tokenise_as_autotokenizer(
    lowercase, strip_accents, tmp_path):
  """vocab.txt with do_lower_case and strip_accents set either way."""
  from jaxformer.interop import hf_folders
  bert_folders.write_wordpiece(str(tmp_path), lowercase, False,
                               strip_accents)
  hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ours = hf_folders.load_tokenizer(str(tmp_path))
  texts = hf_tokenizer_folders.sentences(300)
  assert ours.encode(texts) == hf(texts)['input_ids']
  assert [ours.encode_pair(a, b) for a, b in zip(texts, texts[::-1])] == [
      (e['input_ids'], e['token_type_ids'])
      for e in (hf(a, b) for a, b in zip(texts, texts[::-1]))]
