"""Training on several sources at once: `data.mixture` (numpy only).

    data.mixture.sources = [
        {'name': 'news', 'source': 'tsv', 'tsv': {'train': 'news.tsv'},
         'weight': 3},
        {'name': 'web', 'source': 'files',
         'files': {'train_source': 'web.en', 'train_target': 'web.de'}}]
    data.mixture.stages = [  # optional; [] is one stage of the weights above
        {'until_step': 10000, 'weights': {'news': 1, 'web': 1}},
        {'weights': {'news': 3, 'web': 1}}]

A source is a kind of `data.source` with its own group of that kind's keys
(defaults as in `data.<kind>`), read for its train split only; evaluation
reads `data.source`'s dev and test splits. For a many-to-many translator
(M2M100, NLLB) a source may name its own language pair, so that one run
trains several pairs:

        {'name': 'en-de', 'source': 'tsv', 'tsv': {'train': 'en-de.tsv'},
         'source_lang': 'en', 'target_lang': 'de'}

(default: data.source_lang and data.target_lang, the pair evaluated).
Stage i covers the batches before its `until_step` (and from the one
before's); the last lasts to the end of training; a source a stage does
not name is not drawn in it.

Draws: global batch k of B rows takes from the sources of k's stage,
with shares P (cumulative: 0 = P_0 <= ... <= P_S = 1), rows

    floor(B * P_s + u_k) - floor(B * P_(s-1) + u_k)   of source s,

u_k a uniform hashed from (data.seed, k): systematic sampling, so source s
gives B * share_s rows per batch on average, always the floor or the
ceiling. The rows go to places of the batch in an order hashed from
(data.seed, k, row). Each source is its own endless stream of rows, epoch
after epoch; the n-th row drawn from it is row n of its stream, and the
rows it gave before batch k are counted in closed form from the draws of
batches 0..k-1 (vectorised: under a second per million batches), so a
resume replays nothing, and global row r of batch k holds the same example
whatever the layout.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Iterator

import ml_collections
import numpy as np

from jaxformer.storage import paths
from jaxformer.data import input_errors
from jaxformer.data import sources
from jaxformer.data.defaults import default_data_config

KINDS = ('builtin', 'tsv', 'files', 'tfds', 'text', 'jsonl', 'parquet')
# A source's own language pair (many-to-many models).
LANGUAGES = ('source_lang', 'target_lang')
# The keys naming each kind's train files (none: 'builtin' and 'tfds').
TRAIN_FILES = {'tsv': ('train',), 'text': ('train',), 'jsonl': ('train',),
               'parquet': ('train',),
               'files': ('train_source', 'train_target')}
_NAME = re.compile(r'[A-Za-z0-9_-]{1,64}')
_COUNT_CHUNK = 1 << 20  # batches counted at once
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass(frozen=True, eq=False)
class Mixture:
  """Parsed `data.mixture`: each source's name and data config (a copy of
  `data` reading that source), the stages' ends and [stages, sources]
  weights (0: not drawn in that stage)."""
  names: tuple[str, ...]
  configs: tuple[ml_collections.ConfigDict, ...]
  stage_ends: tuple[int, ...]  # until_step of every stage but the last
  weights: np.ndarray

  def stage_of(self, steps: np.ndarray) -> np.ndarray:
    """[n] stage index of global batches `steps` [n]."""
    return np.searchsorted(np.asarray(self.stage_ends, np.int64), steps,
                           side='right')

  def per_row(self, examples_per_row) -> Mixture:
    """The mixture drawn in rows that hold `examples_per_row` [sources]
    examples each, so that the examples drawn follow the weights."""
    scaled = self.weights / np.asarray(examples_per_row, np.float64)
    return dataclasses.replace(self, weights=scaled)

  def shares(self) -> np.ndarray:
    """[stages, sources + 1] cumulative shares, from exactly 0 to exactly 1."""
    total = np.cumsum(self.weights, axis=1)
    return np.concatenate([np.zeros((len(total), 1)),
                           total / total[:, -1:]], axis=1)


def _error(where: str, problem: str) -> sources.DataError:
  return sources.DataError(f'{where}: {problem}')


def _positive(value, where: str) -> float:
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not math.isfinite(value) or value <= 0):
    raise _error(where, f'{value!r} is not a positive number; weights must '
                 'be > 0 (leave a source out of a stage to not draw it)')
  return float(value)


def _source_config(data_config, entry, where: str) -> ml_collections.ConfigDict:
  """`data_config` reading the source `entry` (its group over the kind's
  defaults), without a mixture."""
  kind = entry['source']
  group = default_data_config()[kind]
  given = entry.get(kind, {})
  if not isinstance(given, dict):
    raise _error(where, f'{kind} is {given!r}, not a group of keys such as '
                 f'{sorted(group.keys())}')
  unknown = sorted(set(given) - set(group.keys()))
  if unknown:
    raise _error(where, f'{kind} has no key {unknown[0]!r}; it takes '
                 f'{sorted(group.keys())}')
  try:
    group.update(given)
  except TypeError as e:
    raise _error(where, f'{kind}: {e}') from None
  config = ml_collections.ConfigDict(data_config.to_dict())
  config.mixture = dict(sources=[], stages=[])
  config.source = kind
  config[kind] = group
  for key in LANGUAGES:
    if key in entry:
      config[key] = entry[key]
  return config


def _entry_name(entry, index: int) -> tuple[str, str]:
  where = f'data.mixture.sources[{index}]'
  if not isinstance(entry, dict):
    raise _error(where, f'{entry!r} is not a dict of a source (name, source, '
                 'its group of keys, weight)')
  name = entry.get('name')
  if not isinstance(name, str) or not _NAME.fullmatch(name):
    raise _error(where, f"'name' {name!r} must be 1-64 letters, digits, _ "
                 'or - (it names the source in the metrics)')
  where = f"{where} ('{name}')"
  if entry.get('source') not in KINDS:
    raise _error(where, f"unknown source kind {entry.get('source')!r} (its "
                 f"'source'); use one of {KINDS}")
  unknown = sorted(set(entry) - {'name', 'source', 'weight', *LANGUAGES,
                                 entry.get('source')})
  if unknown:
    raise _error(where, f'unknown key {unknown[0]!r}; a source has name, '
                 "source (its kind), that kind's group, weight and, for a "
                 'many-to-many model, source_lang and target_lang')
  for key in LANGUAGES:
    if key in entry and not (isinstance(entry[key], str) and entry[key]):
      raise _error(where, f'{key} {entry[key]!r} is not a language code '
                   "such as 'de' or 'deu_Latn'")
  return name, where


def _stage_weights(entries, stages, names, wheres) -> tuple[tuple, np.ndarray]:
  if not stages:
    return (), np.array([[_positive(entry.get('weight', 1.0), f'{where}: weight')
                          for entry, where in zip(entries, wheres)]])
  given = [where for entry, where in zip(entries, wheres) if 'weight' in entry]
  if given:
    raise _error(given[0], 'has a weight, but data.mixture.stages give the '
                 "weights; move it into the stages' weights")
  ends, weights = [], np.zeros((len(stages), len(names)))
  for number, stage in enumerate(stages):
    where = f'data.mixture.stages[{number}]'
    last = number == len(stages) - 1
    if not isinstance(stage, dict) or set(stage) - {'until_step', 'weights'}:
      raise _error(where, f"{stage!r}: a stage is {{'until_step': STEP, "
                   "'weights': {NAME: WEIGHT, ...}} (the last without "
                   'until_step)')
    stage_weights = stage.get('weights')
    if not isinstance(stage_weights, dict) or not stage_weights:
      raise _error(where, "needs 'weights': {NAME: WEIGHT, ...} naming at "
                   f'least one of {list(names)}')
    for name, weight in stage_weights.items():
      if name not in names:
        raise _error(where, f'weights name {name!r}, not a source; the '
                     f'sources are {list(names)}')
      weights[number, names.index(name)] = _positive(
          weight, f"{where}: weights['{name}']")
    if last:
      if 'until_step' in stage:
        raise _error(where, 'the last stage lasts to the end of training; '
                     'remove its until_step')
      continue
    end = stage.get('until_step')
    if isinstance(end, bool) or not isinstance(end, int) or end <= 0:
      raise _error(where, f'until_step {end!r} must be a positive step '
                   '(every stage but the last has one)')
    if ends and end <= ends[-1]:
      raise _error(where, f'until_step={end} is not above the previous '
                   f"stage's {ends[-1]}; stages must have increasing until_step")
    ends.append(end)
  return tuple(ends), weights


def parse(data_config: ml_collections.ConfigDict) -> Mixture | None:
  """`data.mixture` checked (not its files: `check_files`), or None when it
  names no source. Raises DataError naming the key and the fix."""
  settings = data_config.get('mixture')
  entries = list(settings.get('sources') or []) if settings else []
  stages = list(settings.get('stages') or []) if settings else []
  if not entries:
    if stages:
      raise sources.DataError('data.mixture.stages needs data.mixture.sources;'
                              ' name the sources the stages weigh')
    return None
  if data_config.get('batching') == 'bucket':
    raise sources.DataError(
        "data.mixture takes data.batching='pack' (its rows each hold one "
        "source); 'bucket' batches do not mix sources: set "
        "data.batching='pack'")
  names, wheres = zip(*(_entry_name(entry, index)
                        for index, entry in enumerate(entries)))
  twice = sorted({name for name in names if names.count(name) > 1})
  if twice:
    raise sources.DataError(f'data.mixture.sources: the name {twice[0]!r} is '
                            'used twice; give each source its own name')
  configs = tuple(_source_config(data_config, entry, where)
                  for entry, where in zip(entries, wheres))
  ends, weights = _stage_weights(entries, stages, list(names), wheres)
  return Mixture(tuple(names), configs, ends, weights)


def train_configs(data_config: ml_collections.ConfigDict,
                  checked: bool = False) -> list[ml_collections.ConfigDict]:
  """The data configs whose train splits together are the training data:
  each mixture source's (their files checked first if `checked`), or
  `data_config` alone."""
  mixture = parse(data_config)
  if mixture is None:
    return [data_config]
  if checked:
    check_files(mixture)
  return list(mixture.configs)


def check_files(mixture: Mixture) -> None:
  """Raises DataError (MissingFileError) for a train file of a source that
  is not set or does not exist, naming the source, the key and the path."""
  for name, config in zip(mixture.names, mixture.configs):
    for key in TRAIN_FILES.get(config.source, ()):
      where = f"data.mixture source '{name}' ({config.source}.{key})"
      path = config[config.source][key]
      if not path:
        raise sources.DataError(f'{where} is not set; give the path of its '
                                'train file')
      if not paths.exists(path) and not (
          any(c in path for c in paths.WILDCARDS) and
          paths.matching_files(path)):
        raise input_errors.MissingFileError(
            f'{path}: no such file ({where}); check the path')



# ------------------------------------------------------------------- draws


def _mix(words: np.ndarray) -> np.ndarray:
  """splitmix64's finaliser of uint64 `words`."""
  words = (words ^ (words >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  words = (words ^ (words >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return words ^ (words >> np.uint64(31))


def hashed(*words) -> np.ndarray:
  """uint64 hash of integer `words` (arrays broadcast), the same on every
  machine."""
  value = np.zeros((), np.uint64)
  with np.errstate(over='ignore'):
    for word in words:
      value = _mix(value + _GOLDEN + np.asarray(word).astype(np.uint64))
  return value


def batch_counts(mixture: Mixture, seed: int, steps: np.ndarray,
                 batch_size: int) -> np.ndarray:
  """[n, sources] int64 rows of each source in global batches `steps` [n]
  (module docstring), each row summing to batch_size."""
  steps = np.asarray(steps, np.int64)
  uniform = (hashed(seed, 0, steps) >> np.uint64(11)) * 2.0 ** -53
  bounds = np.floor(batch_size * mixture.shares()[mixture.stage_of(steps)]
                    + uniform[:, None])
  return np.diff(bounds, axis=1).astype(np.int64)


def counts_before(mixture: Mixture, seed: int, step: int, batch_size: int
                  ) -> np.ndarray:
  """[sources] int64 rows each source gave to global batches 0..step-1."""
  total = np.zeros(len(mixture.names), np.int64)
  for first in range(0, step, _COUNT_CHUNK):
    steps = np.arange(first, min(step, first + _COUNT_CHUNK))
    total += batch_counts(mixture, seed, steps, batch_size).sum(axis=0)
  return total


@dataclasses.dataclass(frozen=True)
class Draw:
  """The rows of one global batch: source [rows] (index into the sources),
  index [rows] (the row of that source's stream), counts [sources]."""
  source: np.ndarray
  index: np.ndarray
  counts: np.ndarray


def draw(mixture: Mixture, seed: int, step: int, batch_size: int,
         before: np.ndarray) -> Draw:
  """Global batch `step`, the sources having given `before` [sources] rows
  to the batches before it."""
  counts = batch_counts(mixture, seed, [step], batch_size)[0]
  places = np.argsort(hashed(seed, 1, step, np.arange(batch_size)),
                      kind='stable')
  source = np.empty(batch_size, np.int64)
  source[places] = np.repeat(np.arange(len(counts)), counts)
  by_source = np.argsort(source, kind='stable')
  rank = np.empty(batch_size, np.int64)
  rank[by_source] = np.arange(batch_size) - np.repeat(
      np.cumsum(counts) - counts, counts)
  return Draw(source, before[source] + rank, counts)


def draws(mixture: Mixture, seed: int, batch_size: int, start_step: int = 0
          ) -> Iterator[Draw]:
  """The draws of global batches start_step, start_step + 1, ..."""
  before = counts_before(mixture, seed, start_step, batch_size)
  step = start_step
  while True:
    batch = draw(mixture, seed, step, batch_size, before)
    before = before + batch.counts
    step += 1
    yield batch


class Tally:
  """The examples each source of `data.mixture` gave to the batches since
  the last `take`: `add(batch)` takes a batch's 'source_counts' out of it
  (before it is laid out on devices); a no-op without a mixture."""

  def __init__(self, data_config: ml_collections.ConfigDict):
    mixture = parse(data_config)
    self.names = mixture.names if mixture else ()
    self.counts = np.zeros(len(self.names), np.int64)

  def add(self, batch: dict) -> None:
    counts = batch.pop('source_counts', None)
    if counts is not None:
      self.counts += counts

  def take(self) -> dict[str, float]:
    """{'examples/<name>': examples} since the last take."""
    metrics = {f'examples/{name}': float(count)
               for name, count in zip(self.names, self.counts)}
    self.counts = np.zeros_like(self.counts)
    return metrics
