"""Which rows of every global batch one process reads.

The mesh's batch axes (data x fsdp) cut each global batch of R rows into S
equal row shards: shard s is rows [s * R / S, (s + 1) * R / S). A process
reads exactly the shards its devices hold, wherever they sit: on a TPU pod
`jax.make_mesh` orders chips by the interconnect, so one host's shards are
often not neighbours (v4-16 with data=8: host 0 holds shards 0, 2, 4, 6).
A process's local batch is its shards' rows in increasing order, which is
how `jax.make_array_from_process_local_data` places them. So global row r
gets the same example whatever the layout, one process or many.

`parallel.row_shares` computes the shares from a mesh; the data pipeline
reads by them. Numpy only, so the data layer can import it.
"""
import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class RowShare:
  """Row shards `shards` (sorted, distinct) of `num_shards`."""
  shards: tuple[int, ...] = (0,)
  num_shards: int = 1

  def __post_init__(self):
    if (not self.shards or list(self.shards) != sorted(set(self.shards))
        or self.shards[0] < 0 or self.shards[-1] >= self.num_shards):
      raise ValueError(f'row shards {self.shards} are not distinct sorted '
                       f'indices in [0, {self.num_shards}).')

  @classmethod
  def of_process(cls, process_index: int, process_count: int) -> 'RowShare':
    """The process_index-th of process_count contiguous blocks (a mesh whose
    processes own neighbouring devices, as CPU processes do)."""
    if not 0 <= process_index < process_count:
      raise ValueError(f'process_index {process_index} is not in '
                       f'[0, {process_count}).')
    return cls((process_index,), process_count)

  @property
  def fraction(self) -> float:
    return len(self.shards) / self.num_shards

  def local_rows(self, global_rows: int) -> int:
    """How many rows of a `global_rows` batch this process reads."""
    self.check_divides(global_rows)
    return global_rows // self.num_shards * len(self.shards)

  def check_divides(self, global_rows: int) -> None:
    if global_rows % self.num_shards:
      raise ValueError(f'a batch of {global_rows} rows does not split into '
                       f'{self.num_shards} equal row shards.')

  def blocks(self) -> list[tuple[int, int]]:
    """Runs of neighbouring shards as [(first shard, shard count)]."""
    runs = []
    for shard in self.shards:
      if runs and runs[-1][0] + runs[-1][1] == shard:
        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
      else:
        runs.append((shard, 1))
    return runs

  def row_ranges(self, global_rows: int) -> list[tuple[int, int]]:
    """[(first row, row count)] of this share in a `global_rows` batch."""
    per_shard = global_rows // self.num_shards
    self.check_divides(global_rows)
    return [(first * per_shard, count * per_shard)
            for first, count in self.blocks()]

  def rows(self, global_rows: int) -> np.ndarray:
    """[local_rows] int: the global rows this process reads, in order."""
    return np.concatenate([np.arange(first, first + count)
                           for first, count in self.row_ranges(global_rows)])


def round_up_rows(rows: int, share: RowShare) -> int:
  """`rows` rounded up to a multiple of the row shards (an evaluation
  batch: the extra rows pad)."""
  return -(-rows // share.num_shards) * share.num_shards
