"""Token ids of a split's examples as ragged arrays over shards (in memory
or memory-mapped from the token cache): one side (`RaggedTokens`), or the
source and target sides of translation (`TokenizedSplit`)."""

from __future__ import annotations

import dataclasses

import numpy as np

SIDES = ('source', 'target')


@dataclasses.dataclass(frozen=True)
class RaggedTokens:
  """One side's token ids of a split's examples, stored in shards.

  Example i is tokens [starts[i], starts[i] + lengths[i]) of the shards laid
  end to end, and ends with its vocabulary's EOS.
  """
  shards: tuple  # [shard tokens] arrays or memory maps
  shard_starts: np.ndarray  # [shards + 1] int64: first token of each shard
  starts: np.ndarray  # [examples] int64
  lengths: np.ndarray  # [examples] int32

  @classmethod
  def from_shards(cls, shards, shard_lengths) -> RaggedTokens:
    """From each shard's tokens and [shard examples] lengths."""
    lengths = np.concatenate(shard_lengths).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]])
    sizes = np.array([len(shard) for shard in shards], np.int64)
    return cls(tuple(shards), np.concatenate([[0], np.cumsum(sizes)]),
               starts, lengths)

  def subset(self, rows: np.ndarray) -> RaggedTokens:
    return dataclasses.replace(self, starts=self.starts[rows],
                               lengths=self.lengths[rows])

  @classmethod
  def concatenate(cls, parts) -> RaggedTokens:
    """The examples of `parts` one after another (no token is copied)."""
    bases = np.cumsum([0] + [part.shard_starts[-1] for part in parts[:-1]])
    return cls(
        sum((part.shards for part in parts), ()),
        np.concatenate([[0]] + [part.shard_starts[1:] + base
                                for part, base in zip(parts, bases)]),
        np.concatenate([part.starts + base for part, base in zip(parts, bases)]),
        np.concatenate([part.lengths for part in parts]))

  def gather(self, rows: np.ndarray, max_length: int | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """Examples `rows` [k], each cut to `max_length` still ending in its
    last token (EOS).

    Returns:
      tokens [total] int32 and row splits [k + 1] int64.
    """
    full_lengths = self.lengths[rows].astype(np.int64)
    lengths = full_lengths
    if max_length is not None:
      lengths = np.minimum(lengths, max_length)
    splits = np.concatenate([[0], np.cumsum(lengths)])
    offsets = np.arange(splits[-1]) - np.repeat(splits[:-1], lengths)
    tokens = self._read(np.repeat(self.starts[rows], lengths) + offsets)
    cut = (lengths < full_lengths) & (lengths > 0)
    if cut.any():
      tokens[splits[1:][cut] - 1] = self._read(
          self.starts[rows][cut] + full_lengths[cut] - 1)
    return tokens, splits

  def _read(self, index: np.ndarray) -> np.ndarray:
    """The tokens [n] int32 at positions `index` [n] of the shards laid end
    to end."""
    shard_of = np.searchsorted(self.shard_starts, index, side='right') - 1
    tokens = np.empty(len(index), np.int32)
    for shard in np.unique(shard_of):
      mine = shard_of == shard
      tokens[mine] = self.shards[shard][index[mine] - self.shard_starts[shard]]
    return tokens


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
  """Token ids of a split's examples (source and target side)."""
  source: RaggedTokens
  target: RaggedTokens
  folder: str | None = None  # its token cache folder; None: in memory

  @property
  def num_examples(self) -> int:
    return len(self.source.lengths)

  @property
  def source_lengths(self) -> np.ndarray:
    return self.source.lengths

  @property
  def target_lengths(self) -> np.ndarray:
    return self.target.lengths

  def subset(self, rows: np.ndarray) -> TokenizedSplit:
    """Examples `rows` [k] (no token is read or copied)."""
    return dataclasses.replace(self, source=self.source.subset(rows),
                               target=self.target.subset(rows))

  def gather(self, rows: np.ndarray, max_source_length: int | None = None,
             max_target_length: int | None = None) -> tuple[np.ndarray, ...]:
    """(source tokens, source splits, target tokens, target splits) of
    examples `rows` [k] (see RaggedTokens.gather); reads only their tokens."""
    return (*self.source.gather(rows, max_source_length),
            *self.target.gather(rows, max_target_length))


def concatenate(splits: list[TokenizedSplit]) -> TokenizedSplit:
  """The examples of `splits` one after another, in memory order: example
  i of splits[j] is example len(splits[0]) + ... + len(splits[j - 1]) + i."""
  return TokenizedSplit(*(RaggedTokens.concatenate([getattr(split, side)
                                                    for split in splits])
                          for side in SIDES))
