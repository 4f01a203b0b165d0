"""What one host of a run does at start-up: its mesh, the row shards it
feeds, its batch shapes, what it reads and its part of the checkpoint.

`jaxformer train` runs `plan_host` for its own process before the first
step; `jaxformer compile` runs the same function for every process of a
TPU topology (the compile-only client's devices carry each chip's
process index), so a layout that `train` would refuse on a pod is refused
by `compile`, with the same message, from any machine.
"""
import dataclasses

import jax
import ml_collections

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.data import task_batches
from jaxformer.parallel.row_share import RowShare


@dataclasses.dataclass(frozen=True)
class HostPlan:
  """One process's part of a run.

  train_shapes / local_train_shapes: (rows, source width, target width) of
    every global training batch and of this process's part of it.
  reads: for each training shape, the (first row, row count) ranges of the
    global batch that this process reads.
  data_order: what the order of training examples depends on besides the
    data (`task_batches.data_order`), saved with checkpoints and compared on
    resume.
  state_bytes: bytes of the train state on this process's devices (each
    distinct shard once), which it restores from a checkpoint.
  """
  process_index: int
  mesh: jax.sharding.Mesh
  share: RowShare
  train_shapes: tuple[tuple[int, int, int], ...]
  local_train_shapes: tuple[tuple[int, int, int], ...]
  eval_rows: int
  local_eval_rows: int
  reads: tuple[tuple[tuple[int, int], ...], ...]
  data_order: dict
  state_bytes: int | None = None

  def summary(self) -> dict:
    """The plan as JSON-able values (`jaxformer compile`'s report)."""
    return dict(
        process=self.process_index, row_shards=list(self.share.shards),
        of=self.share.num_shards,
        local_rows=[rows for rows, _, _ in self.local_train_shapes],
        local_eval_rows=self.local_eval_rows,
        state_bytes=self.state_bytes)


def plan_host(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
              process_index: int, state_shardings=None, state_shapes=None
              ) -> HostPlan:
  """Process `process_index`'s plan on `mesh` (see HostPlan).

  Args:
    state_shardings, state_shapes: trees of the train state's NamedShardings
      and shapes/dtypes (`RunSpec.state_layout`), for the checkpoint
      bytes; None leaves them out.

  Raises:
    ValueError naming what to change, for a mesh that cannot be fed
    (`mesh_lib.row_shares`) or batches that do not split over its row
    shards and microbatches (`data.tasks.check_batch_shapes`).
  """
  shares = mesh_lib.row_shares(mesh)
  if process_index not in shares:
    raise ValueError(f'process {process_index} has no device in the mesh '
                     f'(processes {sorted(shares)}).')
  share = shares[process_index]
  shapes = task_batches.check_batch_shapes(config, share.num_shards)
  eval_rows = task_batches.eval_batch_rows(config, share.num_shards)
  held = None
  if state_shardings is not None:
    held = state_bytes(state_shardings, state_shapes, process_index)
  return HostPlan(
      process_index=process_index, mesh=mesh, share=share,
      train_shapes=tuple(shapes),
      local_train_shapes=tuple((share.local_rows(rows), source, target)
                               for rows, source, target in shapes),
      eval_rows=eval_rows, local_eval_rows=share.local_rows(eval_rows),
      reads=tuple(tuple(share.row_ranges(rows)) for rows, _, _ in shapes),
      data_order=task_batches.data_order(config, share.num_shards),
      state_bytes=held)


def state_bytes(shardings, shapes, process_index: int) -> int:
  """Bytes of a state tree on process `process_index`'s devices, each
  distinct shard once: what the host restores from a checkpoint (Orbax
  reads each host's shards)."""
  held = 0
  for sharding, shape in zip(jax.tree.leaves(shardings),
                             jax.tree.leaves(shapes)):
    here = set()
    for device, index in sharding.devices_indices_map(shape.shape).items():
      key = tuple(s.indices(n) for s, n in zip(index, shape.shape))
      if device.process_index != process_index or key in here:
        continue
      here.add(key)
      size = shape.dtype.itemsize
      for start, stop, step in key:
        size *= len(range(start, stop, step))
      held += size
  return held
