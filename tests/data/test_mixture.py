"""`data.mixture`: several training sources drawn by weight, in stages,
the same whatever the layout and the step a stream starts at."""
import itertools

import numpy as np
import pytest

from jaxformer.checkpoints.exports import without_machine_paths
from jaxformer.config import settings
from jaxformer.data import builtin, mixture, pipeline, row_layouts, task_batches
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.input_errors import DataError, MissingFileError
from jaxformer.parallel.row_share import RowShare
from jaxformer.run import goodput
from test_pipeline import assert_equal_batches
from tsv_corpus import PAIRS, tsv_config, write_tsv


def b_pairs():
  """Pairs of two built-in sentences each (longer than PAIRS', so fewer
  to a row), none of them in PAIRS."""
  known = {source for source, _ in PAIRS}
  singles = [pair for pair in builtin.generate(80, 11, 'train')
             if pair[0] not in known]
  return [(s1 + ' ' + s2, t1 + ' ' + t2)
          for (s1, t1), (s2, t2) in zip(singles[::2], singles[1::2])]


@pytest.fixture
def files(tmp_path):
  return (write_tsv(tmp_path / 'a.tsv'),
          write_tsv(tmp_path / 'b.tsv', b_pairs()[:20]))


def source(name, path, **keys):
  return dict(name=name, source='tsv', tsv=dict(train=str(path)), **keys)


def mixed_config(files, stages=(), weights=(1, 1), **overrides):
  config = tsv_config(files[0], batch_size=8, **overrides)
  config.mixture.sources = [
      source(name, path, **({} if stages else dict(weight=weight)))
      for name, path, weight in zip('ab', files, weights)]
  config.mixture.stages = list(stages)
  return config


def take(config, tok, count, **kwargs):
  return list(itertools.islice(pipeline.translation_train_batches(
      config, tok, tok, **kwargs), count))


STAGES = [dict(until_step=3, weights=dict(a=1)),
          dict(until_step=7, weights=dict(a=1, b=3)),
          dict(weights=dict(b=1))]


# ------------------------------------------------------------------ sampling


@pytest.mark.slow
def test_weights_3_to_1_draw_examples_3_to_1_within_2_percent(files, tok):
  # Rows of one example each (classification, regression): exact.
  rows = [{'inputs': np.full((n, 2), n)} for n in (50, 7)]
  config = mixed_config(files, weights=(3, 1))
  drawn = sum(batch['source_counts'] for batch in itertools.islice(
      task_batches.mixed_row_batches(rows, mixture.parse(config), 32, 0),
      10_000 // 32))
  assert abs(drawn[0] / drawn[1] - 3) <= 0.06
  # Packed rows: b's pairs are twice as long, so a row holds half as many.
  config.batch_size = 32
  drawn = np.zeros(2)
  for batch in pipeline.translation_train_batches(config, tok, tok):
    drawn += batch['source_counts']
    if drawn.sum() >= 10_000:
      break
  assert abs(drawn[0] / drawn[1] - 3) <= 0.06, drawn


def test_each_batch_draws_the_floor_or_ceiling_of_its_share():
  config = mixed_config(('a', 'b'), weights=(2, 1), batching='pack')
  counts = mixture.batch_counts(mixture.parse(config), 0, np.arange(1000), 10)
  assert set(counts[:, 0]) == {6, 7} and (counts.sum(axis=1) == 10).all()
  assert abs(counts[:, 0].mean() - 20 / 3) < 0.05
  assert (mixture.counts_before(mixture.parse(config), 0, 1000, 10)
          == counts.sum(axis=0)).all()


def test_a_stage_switch_happens_at_its_step(files, tok):
  batches = take(mixed_config(files, STAGES), tok, 9)
  counts = np.array([batch['source_counts'] for batch in batches])
  assert (counts[:3, 1] == 0).all() and (counts[:3, 0] > 0).all()
  assert (counts[3:7] > 0).all()
  assert (counts[7:, 0] == 0).all()
  rows = [{'inputs': np.zeros((10, 1))}] * 2
  draws = task_batches.mixed_row_batches(
      rows, mixture.parse(mixed_config(files, STAGES)), 4, 0)
  drawn = [int(batch['source_counts'][0])
           for batch in itertools.islice(draws, 9)]
  assert [drawn[0], drawn[3], drawn[7]] == [4, 1, 0]


@pytest.mark.slow
def test_resume_across_stage_boundaries_is_bitwise(files, tok, tmp_path):
  config = mixed_config(files, STAGES)
  cache = str(tmp_path / 'cache')
  uninterrupted = take(config, tok, 12, token_cache=cache)
  for start in (2, 3, 8):  # Before, at and after a boundary.
    assert_equal_batches(take(config, tok, 12 - start, start_step=start,
                              token_cache=cache), uninterrupted[start:])
  # Without a cache (no stored epoch counts: the epochs are planned).
  assert_equal_batches(take(config, tok, 4, start_step=8),
                       uninterrupted[8:])


@pytest.mark.parametrize('shares', [
    [RowShare.of_process(0, 2), RowShare.of_process(1, 2)],
    [RowShare((0, 2), 4), RowShare((1, 3), 4)]])
def test_the_mixture_is_the_same_for_one_and_two_row_shares(files, tok,
                                                            shares):
  config = mixed_config(files, STAGES)
  whole = take(config, tok, 9)
  parts = [take(config, tok, 9, share=share, process_index=index)
           for index, share in enumerate(shares)]
  for step, batch in enumerate(whole):
    rebuilt = {}
    for share, part in zip(shares, parts):
      assert (part[step]['source_counts'] == batch['source_counts']).all()
      for key, value in part[step].items():
        if key != 'source_counts':
          rebuilt.setdefault(key, np.zeros_like(batch[key]))[
              share.rows(8)] = value
    assert rebuilt.keys() == batch.keys() - {'source_counts'}
    for key in rebuilt:
      np.testing.assert_array_equal(rebuilt[key], batch[key], err_msg=key)


def test_source_counts_are_the_examples_each_source_gave(files, tok):
  encoded = {name: {tuple(ids) for ids in tok.encode(
      [s for s, _ in pairs])} for name, pairs in
      (('a', PAIRS), ('b', b_pairs()[:20]))}
  assert not encoded['a'] & encoded['b']
  for batch in take(mixed_config(files, weights=(1, 2)), tok, 6):
    found = {'a': 0, 'b': 0}
    for tokens, segments in zip(batch['inputs'], batch['inputs_segment_ids']):
      for segment in set(segments[segments > 0].tolist()):
        example = tuple(tokens[segments == segment].tolist())
        found[next(n for n in found if example in encoded[n])] += 1
    assert [found['a'], found['b']] == batch['source_counts'].tolist()
  tally = mixture.Tally(mixed_config(files))
  for counts in ([3, 1], [2, 5]):
    batch = {'inputs': 0, 'source_counts': np.array(counts)}
    tally.add(batch)
    assert 'source_counts' not in batch
  assert tally.take() == {'examples/a': 5.0, 'examples/b': 6.0}
  assert tally.take() == {'examples/a': 0.0, 'examples/b': 0.0}
  assert mixture.Tally(tsv_config('x')).take() == {}


def test_each_source_has_its_own_token_cache(files, tok, tmp_path):
  cache = tmp_path / 'cache'
  take(mixed_config(files), tok, 2, token_cache=str(cache))
  folders = sorted(path.name for path in cache.iterdir())
  assert len(folders) == 2 and all(f.startswith('train-') for f in folders)
  assert all(list((cache / f).glob('epochs-*.json')) for f in folders)
  write_tsv(files[1], b_pairs()[:30])  # Only b's cache is made again.
  take(mixed_config(files), tok, 2, token_cache=str(cache))
  assert len(set(p.name for p in cache.iterdir()) - set(folders)) == 1


def test_each_source_trains_its_own_language_pair(files, tok):
  """A many-to-many model's mixture: 'a' en->de (the run's pair), 'b'
  en->fr; every example starts with its source's language tokens."""
  from jaxformer.data.language_tokenizer import LanguageTokenizer
  codes = {'en': tok.vocab_size, 'de': tok.vocab_size + 1,
           'fr': tok.vocab_size + 2}
  many = LanguageTokenizer(tok, codes, vocab_size=tok.vocab_size + 3,
                           language='en')
  config = mixed_config(files, weights=(1, 2), source_lang='en',
                        target_lang='de')
  config.mixture.sources[1].update(target_lang='fr')
  batches = list(itertools.islice(pipeline.translation_train_batches(
      config, many, many.with_language('de')), 4))
  for batch in batches:
    firsts = {'inputs': [], 'targets': []}
    for key in firsts:
      for tokens, segments in zip(batch[key], batch[f'{key}_segment_ids']):
        for segment in sorted(set(segments[segments > 0].tolist())):
          firsts[key].append(int(tokens[segments == segment][0]))
    assert set(firsts['inputs']) == {codes['en']}
    assert [firsts['targets'].count(codes[c]) for c in ('de', 'fr')] == (
        batch['source_counts'].tolist())
  # A model without language tokens refuses a source's pair, naming it.
  with pytest.raises(DataError, match="source 'b': data.target_lang='fr': "
                     'this model has no language tokens'):
    take(_plain_b_fr(files), tok, 1)


def _plain_b_fr(files):
  config = mixed_config(files)
  config.mixture.sources[1].update(target_lang='fr')
  return config


def test_the_tokenizer_and_labels_come_from_every_source(files, tmp_path):
  config = mixed_config(files)
  config.tsv.train = ''  # data.source gives only evaluation splits.
  config.tokenizer.sample_size = 10_000
  texts = tokenizer_lib._training_texts(config)[0]
  assert len(texts) == 2 * (len(PAIRS) + 20)
  labelled = [write_tsv(tmp_path / f'{n}.tsv', [('x', label), ('y', '10')])
              for n, label in (('c', '2'), ('d', '9'))]
  assert row_layouts.labels_of(mixed_config(labelled)) == ['2', '9', '10']


# --------------------------------------------------------------- validation


def test_a_mixture_naming_a_missing_file_fails_at_start_up_naming_it(
    files, tok, tmp_path):
  config = mixed_config((files[0], tmp_path / 'gone.tsv'))
  message = f"{tmp_path / 'gone.tsv'}: no such file (data.mixture source 'b'"
  with pytest.raises(MissingFileError, match=message.replace('(', r'\(')):
    take(config, tok, 1)
  with pytest.raises(MissingFileError, match='gone.tsv'):
    tokenizer_lib._training_texts(config)
  with pytest.raises(MissingFileError, match='gone.tsv'):
    task_batches.check_train_files(dict_config(config))


def dict_config(data):
  config = settings.default_config()
  config.data = data
  return config


def no_stages(config):
  config.mixture.stages = []
  return config.mixture


@pytest.mark.parametrize('change, message', [
    (lambda c: no_stages(c).sources[1].update(weight=0),
     r"sources\[1\] \('b'\): weight: 0 is not a positive number"),
    (lambda c: no_stages(c).sources[0].update(weight=-2.5), 'not a positive'),
    (lambda c: no_stages(c).sources[0].update(weight='3'), 'not a positive'),
    (lambda c: c.mixture.sources[1].update(source='csv'),
     r"\('b'\): unknown source kind 'csv'"),
    (lambda c: c.mixture.sources[1].update(name='a'), "'a' is used twice"),
    (lambda c: c.mixture.sources[1].update(name='b c'), "'name' 'b c'"),
    (lambda c: c.mixture.sources[1].update(tsv=dict(trian='x')),
     "tsv has no key 'trian'"),
    (lambda c: c.mixture.sources[1].update(files={}), "unknown key 'files'"),
    (lambda c: c.mixture.sources[1].update(target_lang=''),
     "target_lang '' is not a language code"),
    (lambda c: c.update(batching='bucket'), "set data.batching='pack'"),
    (lambda c: c.mixture.update(sources=[]), 'stages needs data.mixture'),
    (lambda c: c.mixture.sources[0].update(weight=2), 'move it into the'),
    (lambda c: c.mixture.stages[1].update(until_step=3),
     r"stages\[1\]: until_step=3 is not above the previous stage's 3; "
     'stages must have increasing until_step'),
    (lambda c: c.mixture.stages[0].pop('until_step'), 'must be a positive'),
    (lambda c: c.mixture.stages[2].update(until_step=9), 'remove its'),
    (lambda c: c.mixture.stages[2].update(weights=dict(c=1)),
     "weights name 'c', not a source"),
    (lambda c: c.mixture.stages[1]['weights'].update(b=0), 'not a positive'),
])
def test_a_bad_mixture_is_refused_naming_the_key(change, message):
  config = mixed_config(('a.tsv', 'b.tsv'), [
      dict(stage, weights=dict(stage['weights'])) for stage in STAGES])
  mixture.parse(config)
  change(config)
  with pytest.raises(DataError, match=message):
    mixture.parse(config)


def test_a_mixture_loads_from_a_config_file_with_paths_made_absolute(
    tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  path = settings.__file__.replace('jaxformer/config/settings.py',
                                   'configs/quickstart.py')
  sources = [dict(name='a', source='tsv', tsv=dict(train='a.tsv'), weight=3),
             dict(name='b', source='files', files=dict(
                 train_source='b.en', train_target='~/b.de'))]
  config = settings.load_config(path, [f'data.mixture.sources={sources}'])
  loaded = config.data.mixture.sources
  assert loaded[0]['tsv']['train'] == str(tmp_path / 'a.tsv')
  assert loaded[1]['files']['train_target'].endswith('/b.de')
  assert not loaded[1]['files']['train_target'].startswith('~')
  kept = without_machine_paths(config.to_dict())['data']['mixture']['sources']
  assert kept[1] == dict(name='b', source='files', files=dict(
      train_source='', train_target=''))
  with pytest.raises(settings.ConfigError, match="unknown source kind 'x'"):
    settings.load_config(path, [
        "data.mixture.sources=[{'name': 'a', 'source': 'x'}]"])


# --------------------------------------------------------------- end to end


@pytest.mark.slow
def test_training_on_a_mixture_resumes_bitwise_after_a_stop(files, tmp_path):
  from jaxformer.run.metrics import read_metrics
  from jaxformer.run.trainer import StopRequested, Trainer
  quickstart = settings.__file__.replace('jaxformer/config/settings.py',
                                         'configs/quickstart.py')
  sources = [source(name, path) for name, path in zip('ab', files)]
  stages = [dict(until_step=3, weights=dict(a=1)),
            dict(until_step=7, weights=dict(a=1, b=1)), dict(weights=dict(b=1))]
  config = settings.load_config(f'{quickstart}:runlocal', [
      f'data.mixture.sources={sources}', f'data.mixture.stages={stages}',
      'data.source=tsv', f'data.tsv.dev={files[0]}',
      'data.tokenizer.vocab_size=150', 'train.num_steps=9', 'train.log_every=1',
      'train.peak_flops=1e9', 'checkpoint.every=4', 'eval.every=0',
      'eval.final_split=', 'eval.bleu_examples=0', 'eval.num_batches=1'])

  class StopAfter(StopRequested):
    """A stop requested at a step, as SIGTERM requests it."""

    def at(self, step, checkpoints):
      if step == 5:
        self.signal_name = 'SIGTERM'
      return super().at(step, checkpoints)

  def numbers(workdir, first):
    return [{k: v for k, v in record.items()
             if k not in ('tokens_per_second', 'step_time', 'mfu',
                          *goodput.FIELDS)}
            for record in read_metrics(str(workdir)) if record['step'] >= first]

  Trainer(config, str(tmp_path / 'whole')).run()
  with StopAfter() as stop:
    Trainer(config, str(tmp_path / 'stopped')).run(stop)
  assert [r['step'] for r in numbers(tmp_path / 'stopped', 1)] == [1, 2, 3, 4, 5]
  resumed = Trainer(config, str(tmp_path / 'stopped'))
  assert int(resumed.initial_state().step) == 5
  resumed.run()
  expected = numbers(tmp_path / 'whole', 1)
  assert numbers(tmp_path / 'stopped', 6) == expected[5:]
  drawn = [(r['examples/a'], r['examples/b']) for r in expected if 'loss' in r]
  assert all(b == 0 for _, b in drawn[:3]) and all(a == 0 for a, _ in drawn[7:])
  assert all(a and b for a, b in drawn[3:7])
