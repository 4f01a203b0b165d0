"""`jaxformer export --format ct2`: CTranslate2 models of native configs
translate (greedy) as jaxformer does and score within 1e-5 per token; bad
input is refused in one line without leaving a folder behind."""
import os

import jax
import numpy as np
import pytest

import export_models
from jaxformer.cli import main as cli
from jaxformer.inference import search
from jaxformer.checkpoints import exports
from jaxformer.interop import ct2, folders
from jaxformer.model import EncoderDecoder

ctranslate2 = pytest.importorskip('ctranslate2')

# Options and a seed whose random model decodes varied sentences.
CONFIGS = {
    'post_relu_tied': (dict(), 2),
    'pre_gelu_target_tied_learned_scanned': (dict(
        norm_position='pre', activation='gelu', share_embeddings='target',
        position_embedding='learned', scan_layers=True), 1),
    # Biases on q/k/v only, LayerNorms without bias (written as zeros).
    'post_untied_learned_unbiased': (dict(
        share_embeddings='none', position_embedding='learned',
        use_bias=False, qkv_bias=True, norm_bias=False), 0),
}
MAX_DECODE = 24


@pytest.fixture(scope='module')
def tok(tmp_path_factory):
  return export_models.tokenizer(str(tmp_path_factory.mktemp('tok')))


def pieces(tok, sentences) -> list[list[str]]:
  return [[tok.id_to_piece(t) for t in sentence] for sentence in sentences]


def padded(sentences) -> np.ndarray:
  width = max(map(len, sentences))
  return np.array([s + [0] * (width - len(s)) for s in sentences], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize('name', CONFIGS)
def test_greedy_outputs_equal_and_scores_within_2e_5(name, tok, tmp_path):
  options, seed = CONFIGS[name]
  model = export_models.model(tok, seed=seed, scale=1.5, **options)
  translator = ctranslate2.Translator(ct2.export(model, str(tmp_path / 'ct2')),
                                      intra_threads=1)
  rows = export_models.source_rows(tok)
  sources = pieces(tok, [export_models.until_eos(row) for row in rows])
  ours = np.asarray(search.greedy_decode(model.params, model.model_config,
                                         rows, max_decode_len=MAX_DECODE))
  ours = [export_models.until_eos(row) for row in ours]
  assert len(set(map(tuple, ours))) > 4 and 0 not in sum(ours, [])
  results = translator.translate_batch(sources, beam_size=1,
                                       max_decoding_length=MAX_DECODE)
  ids = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
  assert [[ids[p] for p in r.hypotheses[0]] for r in results] == ours

  # Teacher-forced: the German references and the greedy outputs.
  targets = [ids[:-1] for ids in tok.encode(export_models.REFERENCES)] + ours
  log_probs = jax.nn.log_softmax(EncoderDecoder(model.model_config).apply(
      {'params': model.params}, np.concatenate([rows, rows]),
      padded([t + [1] for t in targets])))
  scores = translator.score_batch(sources * 2, pieces(tok, targets))
  differences = [
      np.abs(np.asarray(score.log_probs) - log_probs[
          i, np.arange(len(target) + 1), target + [1]])
      for i, (score, target) in enumerate(zip(scores, targets))]
  for score, target, difference in zip(scores, targets, differences):
    # 2e-5 per token, relative where |log p| > 1 (float32 rounding: 1.2e-5
    # seen with XLA's lowest optimisation level, tests/cpu_devices.py).
    assert np.all(difference <= 2e-5 * np.maximum(1, np.abs(score.log_probs)))


def test_write_folder_leaves_nothing_when_writing_fails(tmp_path):
  def fail(directory):
    open(os.path.join(directory, 'model.bin'), 'w').close()
    raise RuntimeError('disk full')
  with pytest.raises(RuntimeError):
    folders.write_folder(str(tmp_path / 'out'), fail)
  assert os.listdir(tmp_path) == []


@pytest.fixture(scope='module')
def export_dir(tok, tmp_path_factory):
  """A jaxformer export (parameters, config, tokenizer) of a native model."""
  model = export_models.model(tok)
  path = str(tmp_path_factory.mktemp('export') / 'model')
  extra = {'config': model.config.to_dict(), 'steps': [0],
           'tokenizers': [__import__('base64').b64encode(
               tok.serialized_model_proto()).decode()]}
  exports.export_params(path, model.params, extra)
  return path


@pytest.mark.slow
def test_cli_writes_an_int8_model_that_translates(export_dir, tmp_path,
                                                  capfd):
  out = str(tmp_path / 'int8')
  assert cli.main(['export', '--format', 'ct2', '--quantization', 'int8',
                   '--from', export_dir, '--out', out]) == 0
  assert 'ctranslate2.Translator' in capfd.readouterr().out
  assert {'model.bin', 'config.json', 'shared_vocabulary.json', 'source.spm',
          'target.spm'} <= set(os.listdir(out))
  translator = ctranslate2.Translator(out, compute_type='int8')
  result = translator.translate_batch([['▁three', '▁red']],
                                      max_decoding_length=4)
  assert 1 <= len(result[0].hypotheses[0]) <= 4


@pytest.mark.slow
@pytest.mark.parametrize('argv, message', [
    (['--format', 'onnx'], '--format onnx: choose one of jaxformer, ct2, hf'),
    (['--format', 'ct2', '--quantization', 'int4'],
     '--quantization int4: choose one of int8'),
    (['--format', 'hf', '--quantization', 'int8'],
     '--quantization applies to --format ct2'),
    (['--format', 'hf'], "model.sinusoid_layout='interleaved'"),
])
def test_bad_input_is_one_line_and_writes_nothing(argv, message, export_dir,
                                                  tmp_path, capfd):
  out = tmp_path / 'out'
  assert cli.main(['export', '--from', export_dir, '--out', str(out),
                   *argv]) == 1
  err = capfd.readouterr().err.strip()
  assert message in err and len(err.splitlines()) == 1, err
  assert os.listdir(tmp_path) == []
