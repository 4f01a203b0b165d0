"""What a batch of source lines becomes: their translations, by one model or
an ensemble (`ensemble.py`), each starting with its target prefix
(`target_prefix.py`) and containing its terminology (`constrained.py`).

One `Translation` serves `jaxformer translate` (stdout: `translate_lines`),
`translate --output` (`bulk.decode_corpus`, every process) and `evaluate
--ensemble` (`decode_split`). A batch decodes as its lines alone decide:
as far as its longest source or prefix allows (`search.decode_length`),
so the output is the same whatever the batching and the layout.

The per-line prefixes and constraints are indexed by a line's 0-based
number in the input (all input files one after the other).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np

from jaxformer.data import sources
from jaxformer.inference import constrained, ensemble, evaluate, search
from jaxformer.inference import target_prefix
from jaxformer.inference.bulk import Chunking, warn


@dataclasses.dataclass(frozen=True, kw_only=True)
class TranslateSettings(Chunking):
  beam_size: int
  alpha: float
  max_extra_len: int
  max_source_length: int
  on_too_long: str = 'truncate'  # or 'error'
  target_prefix: str = ''  # Every translation starts with it.


@dataclasses.dataclass(frozen=True)
class PerLine:
  """A file's lines, one for each input line: `flag` names the file in
  errors (e.g. '--constraints')."""
  flag: str
  lines: Sequence[str]

  def of(self, numbers: Sequence[int]) -> list[str]:
    """The lines for the input lines at `numbers` (0-based)."""
    if numbers and max(numbers) >= len(self.lines):
      raise ValueError(
          f'{self.flag} has {len(self.lines)} lines, fewer than the input '
          f'(line {len(self.lines) + 1} has none); give one line per input '
          'line (an empty line: none).')
    return [self.lines[n].rstrip('\n') for n in numbers]

  def check_count(self, count: int) -> None:
    """Raises unless there is a line for each of `count` input lines."""
    if count != len(self.lines):
      self.of([count - 1] if count > len(self.lines) else [])
      raise ValueError(f'{self.flag} has more lines ({len(self.lines)}) '
                       f'than the {count} of the input; give one line per '
                       'input line.')

  def digest(self) -> str:
    """What a bulk output's fingerprint says of these lines."""
    return hashlib.sha256('\n'.join(self.lines).encode()).hexdigest()


class Translation:
  """Translations of a batch of source lines; an empty line's is empty.

  members: one or more models (each with params, model_config, source_tok
  and target_tok: a `checkpoints.trained.Trained`) of one target
  vocabulary (`ensemble.check_same_target`); prefixes, constraints:
  `PerLine` (prefixes replace settings.target_prefix).
  """
  command = 'translate'

  def __init__(self, members: Sequence, settings: TranslateSettings, *,
               prefixes: PerLine | None = None,
               constraints: PerLine | None = None):
    self.members, self.settings = list(members), settings
    self.prefixes, self.constraints = prefixes, constraints
    self.target_tok = self.members[0].target_tok
    self.configs = tuple(m.model_config for m in self.members)
    self.params = tuple(m.params for m in self.members)

  def inputs(self, lines: list[str], numbers: list[int]):
    """(each member's source rows [batch_size, s_m], the forced first ids
    (`target_prefix.forced_ids`), the phrases [batch_size, c, l] or None)."""
    s = self.settings
    rows = [evaluate.source_batch(
        m.source_tok, lines, [n + 1 for n in numbers],
        batch_size=s.batch_size,
        max_source_length=min(s.max_source_length, m.model_config.max_len),
        on_too_long=s.on_too_long, warn=warn if i == 0 else lambda _: None)
            for i, m in enumerate(self.members)]
    prefixes = (self.prefixes.of(numbers) if self.prefixes
                else [s.target_prefix] * len(lines))
    forced = target_prefix.forced_ids(self.target_tok, prefixes,
                                      s.batch_size)
    phrases = (constrained.phrases_of(
        self.target_tok, self.constraints.of(numbers), s.batch_size)
               if self.constraints else None)
    return rows, forced, phrases

  def decode(self, params, inputs, device: jax.Device | None
             ) -> np.ndarray:
    """Best tokens [batch_size, length] of a batch's inputs, on `device`
    (where `params`, one tree per member, are) or the default devices."""
    s = self.settings
    rows, forced, phrases = inputs
    if device is not None:
      rows = [jax.device_put(r, device) for r in rows]
    if phrases is not None:
      return constrained.decode_rows(
          params, self.configs, rows, phrases, beam_size=s.beam_size,
          alpha=s.alpha, max_extra_len=s.max_extra_len, forced=forced)
    if len(self.members) == 1:
      return evaluate.decode_rows(
          params[0], self.configs[0], rows[0], beam_size=s.beam_size,
          alpha=s.alpha, max_extra_len=s.max_extra_len,
          batch_parts=1 if device is not None else None, forced=forced)
    longest = max([int((np.asarray(r) != c.pad_id).sum(1).max(initial=0))
                   for r, c in zip(rows, self.configs)]
                  + [target_prefix.width(forced)])
    length = search.decode_length(
        longest, s.max_extra_len,
        min(c.max_len for c in self.configs), multiple=16)
    return np.asarray(ensemble.decode_tokens(
        params, self.configs, rows, beam_size=s.beam_size, alpha=s.alpha,
        max_decode_len=length, forced=forced))

  def outputs(self, inputs, tokens: np.ndarray, lines: list[str]
              ) -> tuple[list[str], int]:
    """(the translations of `lines`, their new tokens)."""
    del inputs
    real = [bool(line.strip()) for line in lines]
    new = (tokens[:len(real)][real] != self.configs[0].pad_id).sum()
    return evaluate.texts_of(self.target_tok, tokens, lines), int(new)

  def check_count(self, count: int) -> None:
    """Raises unless the per-line files have a line for each of `count`
    input lines."""
    for per_line in (self.prefixes, self.constraints):
      if per_line:
        per_line.check_count(count)

  def identity(self) -> dict:
    """What a bulk output's fingerprint says beyond the first member's
    `provenance.model_identity`: the other members, the per-line files."""
    from jaxformer.inference import provenance
    out = {}
    if len(self.members) > 1:
      out['ensemble'] = [provenance.model_identity(m)
                         for m in self.members[1:]]
    for name, per_line in (('target_prefixes', self.prefixes),
                           ('constraints', self.constraints)):
      if per_line:
        out[name] = per_line.digest()
    return out


def translate_lines(translation: Translation, sentences: Iterable[str]
                    ) -> Iterator[str]:
  """The translations of `sentences`, in order, decoded in batches as they
  come; at the end, the per-line files' line count is checked."""
  batch: list[str] = []
  count = 0

  def flush():
    inputs = translation.inputs(batch, list(range(count - len(batch),
                                                  count)))
    tokens = translation.decode(translation.params, inputs, None)
    return translation.outputs(inputs, tokens, batch)[0]

  for sentence in sentences:
    batch.append(sentence.rstrip('\n'))
    count += 1
    if len(batch) == translation.settings.batch_size:
      yield from flush()
      batch = []
  if batch:
    yield from flush()
  translation.check_count(count)


def decode_split(translation: Translation, data_config, split: str):
  """(scores, hypotheses in split order) of `split` of `data_config`."""
  pairs = list(sources.read_split(data_config, split))
  hypotheses = list(translate_lines(translation,
                                    [source for source, _ in pairs]))
  return evaluate.corpus_scores(
      hypotheses, [target for _, target in pairs]), hypotheses
