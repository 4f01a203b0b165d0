"""`jaxformer export --format hf`: a Marian-shaped jaxformer model loads with
`MarianMTModel`/`MarianTokenizer.from_pretrained` and generates (greedy and
beam 4) what jaxformer decodes; an imported OPUS-MT-format model exports
back bitwise (import -> export hf -> import) and to CTranslate2 exactly."""
import dataclasses

import jax
import numpy as np
import pytest

import export_models
import marian_folders
from jaxformer.cli import main as cli
from jaxformer.inference import beam_search, search
from jaxformer.checkpoints import trained
from jaxformer.interop import ct2, hf_marian
from jaxformer.model import EncoderDecoder

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')
ctranslate2 = pytest.importorskip('ctranslate2')

MARIAN_SHAPED = dict(sinusoid_layout='halves', layer_norm_epsilon=1e-5,
                     activation='swish', output_bias=True)
MAX_DECODE = 20


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  return export_models.tokenizer(str(tmp_path_factory.mktemp('tok')))


def hf_outputs(model, tokenizer, texts, beams: int, eos: int) -> list[list]:
  """What `generate` decodes, without the start token, up to EOS."""
  batch = tokenizer(texts, return_tensors='pt', padding=True)
  with torch.inference_mode():
    tokens = model.generate(**batch, num_beams=beams, do_sample=False,
                            max_new_tokens=MAX_DECODE, length_penalty=0.0,
                            early_stopping=False)
  return [export_models.until_eos(row[1:].tolist(), eos) for row in tokens]


def jaxformer_outputs(model, rows, beams: int) -> list[list]:
  config = model.model_config
  if beams == 1:
    tokens = search.greedy_decode(model.params, config, rows,
                                  max_decode_len=MAX_DECODE)
  else:
    tokens = beam_search.beam_search(
        model.params, config, rows, beam_size=beams, alpha=0.0,
        max_decode_len=MAX_DECODE)[0][:, 0]
  return [export_models.until_eos(row, config.eos_id)
          for row in np.asarray(tokens)]


# The second: untied vocabularies and output layer, exact GELU, unscaled
# embeddings, biases on q/k/v only and LayerNorms without bias (the missing
# ones written as zero biases).
OPTIONS = {
    'tied_swish_output_bias': (MARIAN_SHAPED, 2),
    'untied_gelu_exact_unbiased': (dict(
        MARIAN_SHAPED, activation='gelu_exact', output_bias=False,
        share_embeddings='none', scale_embedding=False, use_bias=False,
        qkv_bias=True, norm_bias=False), 0),
}


@pytest.mark.slow
@pytest.mark.parametrize('name', OPTIONS)
def test_marian_shaped_model_generates_as_jaxformer(name, tok, tmp_path):
  options, seed = OPTIONS[name]
  model = export_models.model(tok, seed=seed, scale=1.5, **options)
  if model.model_config.output_bias:
    params = dict(model.params, decoder=dict(
        model.params['decoder'], output_bias=jax.random.normal(
            jax.random.PRNGKey(3), (export_models.VOCAB,))))
    model = dataclasses.replace(model, params=params)
  out = hf_marian.export(model, str(tmp_path / 'hf'))
  hf_model = transformers.MarianMTModel.from_pretrained(out).eval()
  hf_tok = transformers.MarianTokenizer.from_pretrained(out)
  rows = export_models.source_rows(tok)
  assert hf_tok(export_models.SENTENCES, padding=True)['input_ids'] == (
      rows.tolist())
  for beams in (1, 4):
    ours = jaxformer_outputs(model, rows, beams)
    assert len(set(map(tuple, ours))) > 2, ours  # Not one for all.
    assert hf_outputs(hf_model, hf_tok, export_models.SENTENCES, beams,
                      1) == ours, beams


@pytest.fixture(scope='module')
def imported(tmp_path_factory):
  """An OPUS-MT-format folder (separate vocabularies, GELU, output bias,
  pad id last, zero start vector) imported with `jaxformer import`."""
  root = tmp_path_factory.mktemp('marian')
  marian_folders.write_folder(
      str(root / 'opus'), separate=True, activation='gelu',
      scale_embedding=True, encoder_layers=2, decoder_layers=1, seed=0)
  assert cli.main(['import', '--from', str(root / 'opus'), '--out',
                   str(root / 'imported')]) == 0
  return root


@pytest.mark.slow
def test_import_export_hf_import_is_bitwise(imported, capfd):
  again = imported / 'again'
  assert cli.main(['export', '--format', 'hf', '--from',
                   str(imported / 'imported'), '--out',
                   str(imported / 'hf')]) == 0
  assert cli.main(['import', '--from', str(imported / 'hf'), '--out',
                   str(again)]) == 0
  first, second = (trained.load(str(imported / name))
                   for name in ('imported', 'again'))
  assert first.model_config == second.model_config
  leaves = jax.tree_util.tree_leaves_with_path
  assert [p for p, _ in leaves(first.params)] == [
      p for p, _ in leaves(second.params)]
  for (path, a), (_, b) in zip(leaves(first.params), leaves(second.params)):
    assert np.array_equal(np.asarray(a), np.asarray(b)), path
  for a, b in ((first.source_tok, second.source_tok),
               (first.target_tok, second.target_tok)):
    assert a.serialized_model_proto() == b.serialized_model_proto()
  assert 'not zero' not in capfd.readouterr().err


@pytest.mark.slow
def test_imported_marian_model_exports_to_ct2_exactly(imported, tmp_path):
  model = trained.load(str(imported / 'imported'))
  config = model.model_config
  translator = ctranslate2.Translator(ct2.export(model, str(tmp_path / 'ct2')),
                                      intra_threads=1)
  texts = marian_folders.test_texts(8, 0)
  ids = model.source_tok.encode(texts)
  rows = np.full((len(ids), max(map(len, ids))), config.pad_id, np.int32)
  for row, sentence in zip(rows, ids):
    row[:len(sentence)] = sentence
  sources = [[model.source_tok.id_to_piece(t) for t in sentence[:-1]]
             for sentence in ids]
  ours = jaxformer_outputs(model, rows, 1)
  assert len(set(map(tuple, ours))) > 4, ours
  results = translator.translate_batch(sources, beam_size=1,
                                       max_decoding_length=MAX_DECODE)
  target = {model.target_tok.id_to_piece(i): i
            for i in range(model.target_tok.vocab_size)}
  assert [[target[p] for p in r.hypotheses[0]] for r in results] == ours
  eos = config.eos_id
  width = max(map(len, ours)) + 1
  target_rows = np.array([t + [eos] + [config.pad_id] * (width - len(t) - 1)
                          for t in ours], np.int32)
  log_probs = jax.nn.log_softmax(EncoderDecoder(config).apply(
      {'params': model.params}, rows, target_rows))
  scores = translator.score_batch(
      sources, [[model.target_tok.id_to_piece(t) for t in s] for s in ours])
  for i, (score, sentence) in enumerate(zip(scores, ours)):
    expected = np.asarray(log_probs[i, np.arange(len(sentence) + 1),
                                    sentence + [eos]])
    assert np.all(np.abs(np.asarray(score.log_probs) - expected)
                  <= 1e-5 * np.maximum(1, np.abs(expected)))


def test_models_marian_cannot_express_are_refused_naming_the_option():
  assert hf_marian.blockers(export_models.ModelConfig(
      **MARIAN_SHAPED)) == []
  reasons = hf_marian.blockers(export_models.ModelConfig(
      norm_position='pre', position_embedding='learned'))
  assert [r.split('=')[0] for r in reasons] == [
      'model.norm_position', 'model.position_embedding',
      'model.layer_norm_epsilon']
