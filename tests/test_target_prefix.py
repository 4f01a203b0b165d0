"""Target prefixes (`translate --target-prefix`): the translations start
with the prefix and continue as a search forced through it would, greedy
and beam; the M2M100 language token is forced by the same mechanism."""
import numpy as np
import pytest

from jaxformer.cli import main as cli
from jaxformer.inference import beam_search, search
from jaxformer.model import EncoderDecoder

import random_run
from test_decode import (DECODE_LEN, full_forward, random_sources,
                         teacher_forced_logprob, translation_model)

# Row 0: three tokens; row 1: one; row 2: none; row 3: two.
PREFIXES = np.array([[7, 9, 4], [12, -1, -1], [-1, -1, -1], [5, 5, -1]],
                    np.int32)


def forced_greedy(config, params, inputs, forced, max_decode_len, eos_id):
  """Greedy decoding by the full forward pass, each row's tokens forced
  where `forced` [batch, p] is not -1."""
  forward = full_forward(EncoderDecoder(config))
  tokens = np.zeros((inputs.shape[0], max_decode_len), np.int32)
  finished = np.zeros(inputs.shape[0], bool)
  for t in range(max_decode_len):
    chosen = np.argmax(forward(params, inputs, tokens)[:, t], axis=-1)
    if t < forced.shape[1]:
      chosen = np.where(forced[:, t] >= 0, forced[:, t], chosen)
    tokens[:, t] = np.where(finished, 0, chosen)
    finished |= tokens[:, t] == eos_id
  return tokens


def starts_with_prefixes(tokens, forced):
  """tokens [batch, ..., length] each start with their row's prefix."""
  for row, prefix in zip(np.asarray(tokens), forced):
    prefix = prefix[prefix >= 0]
    assert np.all(row[..., :len(prefix)] == prefix), (row, prefix)


@pytest.mark.slow
def test_greedy_starts_with_the_prefix_and_equals_forced_decoding():
  config, params = translation_model(eos_bias=1.0)
  inputs = random_sources(4, 7, seed=3)
  tokens = np.asarray(search.greedy_decode(
      params, config, inputs, max_decode_len=DECODE_LEN, forced_ids=PREFIXES))
  starts_with_prefixes(tokens, PREFIXES)
  np.testing.assert_array_equal(tokens, forced_greedy(
      config, params, inputs, PREFIXES, DECODE_LEN, search.EOS_ID))
  unforced = np.asarray(search.greedy_decode(
      params, config, inputs, max_decode_len=DECODE_LEN))
  np.testing.assert_array_equal(tokens[2], unforced[2])
  assert not np.array_equal(tokens[0], unforced[0])


@pytest.mark.slow
@pytest.mark.parametrize('alpha', [0.0, 0.6])
def test_beam_hypotheses_start_with_the_prefix_scored_after_it(alpha):
  # Every hypothesis starts with its prefix; its score is the log-probability
  # of the tokens after the prefix (the forced ones count 0, as the forced
  # language token of a many-to-many model does) over its length penalty.
  config, params = translation_model(eos_bias=2.0)
  inputs = random_sources(4, 7, seed=4)
  beam = 3
  tokens, scores = beam_search.beam_search(
      params, config, inputs, beam_size=beam, alpha=alpha,
      max_decode_len=DECODE_LEN, forced_ids=PREFIXES)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  starts_with_prefixes(tokens, PREFIXES)
  rows = tokens.reshape(-1, DECODE_LEN)
  logprob, lengths = teacher_forced_logprob(
      config, params, np.repeat(inputs, beam, axis=0), rows, search.EOS_ID)
  within_prefix = np.arange(DECODE_LEN) < (
      np.repeat(PREFIXES, beam, 0) >= 0).sum(1)[:, None]
  prefix_logprob = _picked_logprob(config, params,
                                   np.repeat(inputs, beam, axis=0), rows,
                                   within_prefix)
  rescored = ((logprob - prefix_logprob)
              / beam_search.length_penalty(lengths, alpha)).reshape(
                  scores.shape)
  np.testing.assert_allclose(scores, rescored, rtol=2e-5, atol=2e-5)
  single, _ = beam_search.beam_search(
      params, config, inputs, beam_size=1, alpha=0.0,
      max_decode_len=DECODE_LEN, forced_ids=PREFIXES)
  np.testing.assert_array_equal(np.asarray(single)[:, 0], search.greedy_decode(
      params, config, inputs, max_decode_len=DECODE_LEN, forced_ids=PREFIXES))


def _picked_logprob(config, params, inputs, tokens, where):
  """The summed log-probabilities of `tokens` at the positions `where`."""
  import jax
  logits = full_forward(EncoderDecoder(config))(params, inputs, tokens)
  log_probs = np.asarray(jax.nn.log_softmax(logits.astype(np.float32)))
  picked = np.take_along_axis(log_probs, tokens[..., None], -1)[..., 0]
  return np.where(where, picked, 0.0).sum(-1)


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  return random_run.one_step_run(tmp_path_factory)[0]


SOURCES = ['she bought forty-two red apples .', 'he sold three books .', '',
           'they found nine green cups .']


@pytest.mark.slow
@pytest.mark.parametrize('beam', ['1', '3'])
def test_translate_starts_each_line_with_its_prefix(workdir, tmp_path, beam,
                                                    capsys):
  source = tmp_path / 'source.txt'
  source.write_text('\n'.join(SOURCES) + '\n')
  prefixes = tmp_path / 'prefixes.txt'
  prefixes.write_text('sie kaufte\n\n\nwir\n')
  common = ['translate', '--workdir', workdir, '--input', str(source),
            '--beam', beam, '--max-extra-len', '4']
  assert cli.main(common) == 0
  plain = capsys.readouterr().out.splitlines()
  assert cli.main([*common, '--target-prefix', 'das ist']) == 0
  same = capsys.readouterr().out.splitlines()
  assert [line.startswith('das ist') for line in same] == [True, True, False,
                                                           True]
  assert cli.main([*common, '--target-prefix-file', str(prefixes)]) == 0
  each = capsys.readouterr().out.splitlines()
  assert each[0].startswith('sie kaufte') and each[3].startswith('wir')
  assert each[1:3] == plain[1:3]  # No prefix: as without the flag.
  assert len(each) == len(plain) == 4 and each[2] == ''


@pytest.mark.slow
def test_a_prefix_file_of_another_line_count_is_refused(workdir, tmp_path,
                                                        capsys):
  source = tmp_path / 'source.txt'
  source.write_text('\n'.join(SOURCES) + '\n')
  prefixes = tmp_path / 'prefixes.txt'
  prefixes.write_text('a\nb\n')
  assert cli.main(['translate', '--workdir', workdir, '--input', str(source),
                   '--target-prefix-file', str(prefixes)]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and 'has 2 lines, fewer than the input' in err[0]
