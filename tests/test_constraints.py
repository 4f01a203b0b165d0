"""Lexically constrained beam search (`translate --constraints`): every
phrase of a line is in its translation, a line without phrases decodes as
plain beam search does, and a constraints file of another line count is
refused."""
import numpy as np
import pytest

from jaxformer.cli import main as cli
from jaxformer.data import builtin
from jaxformer.inference import beam_search, constrained

import random_run
from test_decode import random_sources, translation_model


def contains(row, phrase) -> bool:
  phrase, row = list(phrase[phrase >= 0]), list(row)
  return any(row[i:i + len(phrase)] == phrase for i in range(len(row)))


def random_phrases(rows: int, seed: int = 0, vocab: int = 32):
  """[rows, 3, 3] phrases: 1-3 per row of 1-3 tokens in [2, vocab)."""
  rng = np.random.default_rng(seed)
  phrases = np.full((rows, 3, 3), -1, np.int32)
  for r in range(rows):
    for c in range(rng.integers(1, 4)):
      n = rng.integers(1, 4)
      phrases[r, c, :n] = rng.integers(2, vocab, n)
  return phrases


@pytest.mark.slow
def test_every_phrase_is_in_every_translation_of_100_lines():
  config, params = translation_model(eos_bias=1.0)
  inputs = random_sources(100, 7, seed=8)
  phrases = random_phrases(100)
  tokens, scores = constrained.constrained_beam_search(
      params, config, inputs, phrases, beam_size=4, alpha=0.6,
      max_decode_len=16)
  best = np.asarray(tokens)[:, 0]
  for row, row_phrases in zip(best, phrases):
    for phrase in row_phrases:
      if (phrase >= 0).any():
        assert contains(row, phrase), (row, row_phrases)
  assert np.all(np.isfinite(np.asarray(scores)[:, 0]))


def test_a_small_batch_holds_every_phrase():
  # The fast tier's look at the search: 3 rows, 2 beams.
  config, params = translation_model(eos_bias=2.0)
  inputs = random_sources(3, 5, seed=3)
  phrases = random_phrases(3, seed=1)[:, :2, :2]
  tokens, scores = constrained.constrained_beam_search(
      params, config, inputs, phrases, beam_size=2, alpha=0.6,
      max_decode_len=8)
  for row, row_phrases in zip(np.asarray(tokens)[:, 0], phrases):
    for phrase in row_phrases:
      if (phrase >= 0).any():
        assert contains(row, phrase), (row, row_phrases)
  assert np.all(np.isfinite(np.asarray(scores)[:, 0]))


@pytest.mark.slow
def test_rows_without_phrases_decode_as_plain_beam_search():
  config, params = translation_model(eos_bias=2.0)
  inputs = random_sources(6, 7, seed=4)
  none = np.full((6, 2, 2), -1, np.int32)
  tokens, scores = constrained.constrained_beam_search(
      params, config, inputs, none, beam_size=4, alpha=0.6, max_decode_len=10)
  plain_tokens, plain_scores = beam_search.beam_search(
      params, config, inputs, beam_size=4, alpha=0.6, max_decode_len=10)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(plain_tokens))
  np.testing.assert_array_equal(np.asarray(scores), np.asarray(plain_scores))


@pytest.fixture(scope='module')
def workdir(tmp_path_factory):
  return random_run.one_step_run(tmp_path_factory)[0]


@pytest.mark.slow
def test_translate_under_constraints_contains_each_phrase(workdir, tmp_path,
                                                          capsys):
  pairs = builtin.generate(100, 3, 'test')
  rng = np.random.default_rng(1)
  lines = []
  for _, target in pairs:
    words = target.split()
    lines.append('\t'.join(rng.choice(words, rng.integers(1, 4),
                                      replace=False)))
  source = tmp_path / 'source.txt'
  source.write_text(''.join(f'{s}\n' for s, _ in pairs))
  terms = tmp_path / 'terms.tsv'
  terms.write_text(''.join(f'{line}\n' for line in lines))
  common = ['translate', '--workdir', workdir, '--input', str(source),
            '--beam', '4', '--max-extra-len', '4', '--batch-size', '50']
  assert cli.main([*common, '--constraints', str(terms)]) == 0
  out = capsys.readouterr().out.splitlines()
  assert len(out) == 100
  for translation, line in zip(out, lines):
    for phrase in line.split('\t'):
      assert phrase in translation, (translation, line)
  empty = tmp_path / 'none.tsv'
  empty.write_text('\n' * 100)
  assert cli.main([*common, '--constraints', str(empty)]) == 0
  unconstrained = capsys.readouterr().out
  assert cli.main(common) == 0
  assert unconstrained == capsys.readouterr().out


@pytest.mark.slow
def test_a_constraints_file_of_another_line_count_is_refused(
    workdir, tmp_path, capsys):
  source = tmp_path / 'source.txt'
  source.write_text('she bought forty-two red apples .\nhe sold three .\n')
  terms = tmp_path / 'terms.tsv'
  terms.write_text('rote\n')
  assert cli.main(['translate', '--workdir', workdir, '--input', str(source),
                   '--constraints', str(terms)]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and '--constraints has 1 lines, fewer than' in err[0]
