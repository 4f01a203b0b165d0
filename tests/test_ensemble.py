"""Ensembles (`translate|evaluate --ensemble`): a model ensembled with
itself decodes as it does alone, two models decode as the mean of their
log-probabilities computed in numpy says, and members of another target
vocabulary are refused."""
import json

import numpy as np
import pytest

from jaxformer.cli import main as cli
from jaxformer.inference import beam_search, ensemble, search
from jaxformer.model import EncoderDecoder

import random_run
from test_decode import (DECODE_LEN, full_forward, random_sources,
                         translation_model)

PREFIXES = np.array([[7, 9], [-1, -1], [12, -1], [-1, -1]], np.int32)


def numpy_log_probs(config, params, inputs, tokens):
  """log p(token t | tokens[:, :t]) of every position and vocabulary entry
  [batch, length, v], in numpy from the uncached forward pass's logits."""
  logits = np.asarray(full_forward(EncoderDecoder(config))(
      params, inputs, tokens), np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def mean_greedy(models, inputs, max_decode_len, eos_id):
  """Greedy decoding by the mean of the models' numpy log-probabilities."""
  tokens = np.zeros((inputs.shape[0], max_decode_len), np.int32)
  finished = np.zeros(inputs.shape[0], bool)
  for t in range(max_decode_len):
    mean = np.mean([numpy_log_probs(c, p, inputs, tokens)[:, t]
                    for c, p in models], axis=0)
    tokens[:, t] = np.where(finished, 0, np.argmax(mean, -1))
    finished |= tokens[:, t] == eos_id
  return tokens


# Greedy without a prefix stays in the fast tier; the others compile more.
SLOW = pytest.mark.slow


@pytest.mark.parametrize('beam, forced', [
    (1, None), pytest.param(1, PREFIXES, marks=SLOW),
    pytest.param(3, None, marks=SLOW), pytest.param(3, PREFIXES, marks=SLOW)])
def test_a_model_ensembled_with_itself_decodes_as_it_does_alone(beam, forced):
  config, params = translation_model(eos_bias=1.5)
  inputs = random_sources(4, 7, seed=2)
  alone = np.asarray(_decode_alone(config, params, inputs, beam, forced))
  together = ensemble.decode_tokens(
      [params, params], [config, config], [inputs, inputs], beam_size=beam,
      alpha=0.6, max_decode_len=DECODE_LEN, forced=forced)
  np.testing.assert_array_equal(np.asarray(together), alone)


def _decode_alone(config, params, inputs, beam, forced):
  forced = -1 if forced is None else forced
  if beam == 1:
    return search.greedy_decode(params, config, inputs,
                                max_decode_len=DECODE_LEN, forced_ids=forced)
  return beam_search.beam_search(params, config, inputs, beam_size=beam,
                                 alpha=0.6, max_decode_len=DECODE_LEN,
                                 forced_ids=forced)[0][:, 0]


@pytest.mark.slow
def test_two_models_greedy_is_the_numpy_mean_of_their_log_probabilities():
  models = [translation_model(eos_bias=1.0, seed=0),
            translation_model(eos_bias=1.0, seed=1)]
  inputs = random_sources(5, 7, seed=6)
  want = mean_greedy(models, inputs, DECODE_LEN, search.EOS_ID)
  got = ensemble.decode_tokens(
      [p for _, p in models], [c for c, _ in models], [inputs, inputs],
      beam_size=1, alpha=0.0, max_decode_len=DECODE_LEN)
  np.testing.assert_array_equal(np.asarray(got), want)
  alone = [np.asarray(search.greedy_decode(p, c, inputs,
                                           max_decode_len=DECODE_LEN))
           for c, p in models]
  assert not np.array_equal(want, alone[0]) or not np.array_equal(
      want, alone[1])


@pytest.mark.slow
def test_two_models_beam_scores_are_the_mean_log_probabilities():
  # The best hypothesis of the ensemble's beam search, rescored in numpy by
  # the mean of the two models' log-probabilities, beats every hypothesis
  # each model finds alone under the same mean.
  models = [translation_model(eos_bias=2.0, seed=0),
            translation_model(eos_bias=2.0, seed=1)]
  inputs = random_sources(3, 7, seed=4)
  best = np.asarray(ensemble.decode_tokens(
      [p for _, p in models], [c for c, _ in models], [inputs, inputs],
      beam_size=4, alpha=0.0, max_decode_len=DECODE_LEN))

  def mean_score(tokens):
    mean = np.mean([numpy_log_probs(c, p, inputs, tokens) for c, p in models],
                   axis=0)
    picked = np.take_along_axis(mean, tokens[..., None], -1)[..., 0]
    ends = tokens == search.EOS_ID
    length = np.where(ends.any(-1), ends.argmax(-1) + 1, tokens.shape[-1])
    return np.where(np.arange(tokens.shape[-1]) < length[:, None], picked,
                    0).sum(-1)

  for config, params in models:
    alone, _ = beam_search.beam_search(params, config, inputs, beam_size=4,
                                       alpha=0.0, max_decode_len=DECODE_LEN)
    for k in range(4):
      assert np.all(mean_score(best) >= mean_score(np.asarray(alone)[:, k])
                    - 1e-5)


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Two workdirs of one vocabulary (different parameters) and one of
  another vocabulary."""
  tok = random_run.tokenizer(tmp_path_factory.mktemp('tokenizer'))
  other = random_run.tokenizer(tmp_path_factory.mktemp('other'), 96)
  made = []
  for seed, vocabulary in ((0, tok), (1, tok), (0, other)):
    config = random_run.config_for(vocabulary)
    made.append(random_run.save_steps(
        tmp_path_factory.mktemp('run'), config, vocabulary,
        {1: random_run.random_state(config, seed)}))
  return made


@pytest.mark.slow
@pytest.mark.parametrize('beam', ['1', '3'])
def test_translate_with_itself_prints_what_the_model_alone_does(
    runs, tmp_path, beam, capsys):
  source = tmp_path / 'source.txt'
  source.write_text('she bought forty-two red apples .\n\nhe sold three '
                    'books .\n')
  command = ['translate', '--workdir', runs[0], '--input', str(source),
             '--beam', beam, '--max-extra-len', '6']
  assert cli.main(command) == 0
  alone = capsys.readouterr().out
  assert cli.main([*command, '--ensemble', runs[0]]) == 0
  assert capsys.readouterr().out == alone
  assert cli.main([*command, '--ensemble', runs[1]]) == 0
  assert len(capsys.readouterr().out.splitlines()) == 3


@pytest.mark.slow
def test_evaluate_an_ensemble(runs, capsys):
  assert cli.main(['evaluate', '--workdir', runs[0], '--ensemble', runs[1],
                   '--beam', '1']) == 0
  report = json.loads(capsys.readouterr().out)
  assert report['ensemble'] == runs[:2] and 'bleu' in report


@pytest.mark.slow
def test_members_of_another_target_vocabulary_are_refused(runs, capsys):
  assert cli.main(['translate', '--workdir', runs[0], '--ensemble',
                   runs[2]]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and 'is not that of --workdir' in err[0]

