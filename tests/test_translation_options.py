"""Target prefixes, terminology constraints and ensembles together: the
constrained search after a forced prefix, over an ensemble's mean
log-probabilities; the same flags to stdout and with `--output` give the
same lines; a per-line file of another line count is refused with
`--output` too."""
import numpy as np
import pytest

from jaxformer.cli import main as cli
from jaxformer.data import builtin
from jaxformer.inference import beam_search, constrained

import random_run
from test_constraints import contains, random_phrases
from test_decode import random_sources, translation_model
from test_target_prefix import starts_with_prefixes

# Row 0: two tokens; row 1: none; row 2: one; row 3: three.
PREFIXES = np.array([[7, 9, -1], [-1, -1, -1], [12, -1, -1], [5, 5, 3]],
                    np.int32)
DECODE_LEN = 20


def search(models, inputs, phrases, forced=PREFIXES, beam=4):
  """The constrained search of `models` [(config, params)], one or more."""
  configs, params = zip(*models)
  tokens, scores = constrained.constrained_beam_search(
      params, configs, [inputs] * len(models), phrases, beam_size=beam,
      alpha=0.6, max_decode_len=DECODE_LEN, forced=forced)
  return np.asarray(tokens), np.asarray(scores)


@pytest.mark.slow
def test_constraints_after_a_prefix_hold_both():
  config, params = translation_model(eos_bias=1.0)
  inputs = random_sources(4, 7, seed=5)
  phrases = random_phrases(4, seed=3)
  tokens, scores = search([(config, params)], inputs, phrases)
  starts_with_prefixes(tokens[:, 0], PREFIXES)
  for row, row_phrases in zip(tokens[:, 0], phrases):
    for phrase in row_phrases:
      if (phrase >= 0).any():
        assert contains(row, phrase), (row, row_phrases)
  assert np.all(np.isfinite(scores[:, 0]))


@pytest.mark.slow
def test_rows_without_phrases_decode_as_forced_beam_search():
  config, params = translation_model(eos_bias=2.0)
  inputs = random_sources(4, 7, seed=6)
  none = np.full((4, 2, 2), -1, np.int32)
  tokens, scores = search([(config, params)], inputs, none)
  plain, plain_scores = beam_search.beam_search(
      params, config, inputs, beam_size=4, alpha=0.6,
      max_decode_len=DECODE_LEN, forced_ids=PREFIXES)
  np.testing.assert_array_equal(tokens, np.asarray(plain))
  np.testing.assert_array_equal(scores, np.asarray(plain_scores))


@pytest.mark.slow
def test_a_model_ensembled_with_itself_under_constraints_decodes_alone():
  model = translation_model(eos_bias=1.0)
  inputs = random_sources(4, 7, seed=7)
  phrases = random_phrases(4, seed=4)
  alone = search([model], inputs, phrases)
  together = search([model, model], inputs, phrases)
  np.testing.assert_array_equal(together[0], alone[0])
  np.testing.assert_array_equal(together[1], alone[1])


@pytest.mark.slow
def test_two_models_under_constraints_contain_every_phrase():
  models = [translation_model(eos_bias=1.0),
            translation_model(eos_bias=1.0, seed=1)]
  inputs = random_sources(8, 7, seed=8)
  phrases = random_phrases(8, seed=5)
  tokens, _ = search(models, inputs, phrases, forced=None)
  alone, _ = search(models[:1], inputs, phrases, forced=None)
  for row, row_phrases in zip(tokens[:, 0], phrases):
    for phrase in row_phrases:
      if (phrase >= 0).any():
        assert contains(row, phrase), (row, row_phrases)
  assert not np.array_equal(tokens, alone)  # The second model counts.


# ------------------------------------------------------ the command's flags


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """Two workdirs of one vocabulary and different parameters."""
  tok = random_run.tokenizer(tmp_path_factory.mktemp('tokenizer'))
  config = random_run.config_for(tok)
  return [random_run.save_steps(tmp_path_factory.mktemp('run'), config, tok,
                                {1: random_run.random_state(config, seed)})
          for seed in (0, 1)]


@pytest.fixture(scope='module')
def files(tmp_path_factory):
  """(sources, prefixes, constraints) of 12 lines, some with neither."""
  folder = tmp_path_factory.mktemp('files')
  pairs = builtin.generate(12, 5, 'test')
  rng = np.random.default_rng(2)
  prefixes, terms = [], []
  for i, (_, target) in enumerate(pairs):
    words = target.split()
    prefixes.append(' '.join(words[:2]) if i % 3 else '')
    terms.append('' if i % 4 == 1 else '\t'.join(
        rng.choice(words[2:], rng.integers(1, 3), replace=False)))
  written = []
  for name, lines in (('source.txt', [s for s, _ in pairs]),
                      ('prefixes.txt', prefixes), ('terms.tsv', terms)):
    (folder / name).write_text(''.join(f'{line}\n' for line in lines))
    written.append(str(folder / name))
  return written, prefixes, terms


@pytest.mark.slow
def test_all_flags_together_to_stdout_and_to_a_file(runs, files, tmp_path,
                                                    capsys):
  (source, prefixes, terms), prefix_lines, term_lines = files
  command = ['translate', '--workdir', runs[0], '--ensemble', runs[1],
             '--input', source, '--beam', '3', '--max-extra-len', '6',
             '--batch-size', '5', '--target-prefix-file', prefixes,
             '--constraints', terms]
  assert cli.main(command) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 12
  for line, prefix, phrases in zip(lines, prefix_lines, term_lines):
    assert line.startswith(prefix), (line, prefix)
    for phrase in filter(None, phrases.split('\t')):
      assert phrase in line, (line, phrases)
  out = tmp_path / 'out.txt'
  assert cli.main([*command, '--output', str(out), '--chunk-batches',
                   '1']) == 0
  assert out.read_text().splitlines() == lines


@pytest.mark.slow
def test_an_ensemble_to_a_file_writes_what_it_prints(runs, files, tmp_path,
                                                     capsys):
  (source, _, _), _, _ = files
  command = ['translate', '--workdir', runs[0], '--ensemble', runs[1],
             '--input', source, '--beam', '1', '--max-extra-len', '6']
  assert cli.main(command) == 0
  printed = capsys.readouterr().out
  out = tmp_path / 'out.txt'
  assert cli.main([*command, '--output', str(out)]) == 0
  assert out.read_text() == printed
  alone = tmp_path / 'alone.txt'
  assert cli.main([*command[:3], *command[5:], '--output', str(alone)]) == 0
  assert alone.read_text() != printed


@pytest.mark.slow
@pytest.mark.parametrize('flag', ['--target-prefix-file', '--constraints'])
def test_a_per_line_file_of_another_line_count_is_refused_with_output(
    runs, files, tmp_path, capsys, flag):
  (source, _, _), _, _ = files
  short = tmp_path / 'short.txt'
  short.write_text('a\nb\n')
  out = tmp_path / 'out.txt'
  assert cli.main(['translate', '--workdir', runs[0], '--input', source,
                   '--output', str(out), flag, str(short)]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and f'{flag} has 2 lines, fewer than the input' in (
      err[0])
  assert not out.exists()
