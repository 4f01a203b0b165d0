"""TPU topologies for `jaxformer compile`: each chip's HBM and peak FLOP/s,
the accelerator types by name, and their devices on libtpu's compile-only
client (`jax.experimental.topologies`), all hosts of a slice on this
machine, each device carrying its chip's process index.
"""
import dataclasses
import math
import os

from jaxformer.runtime import library_logs
from jaxformer.train.flops import TPU_PEAK_FLOPS

# Another process holding libtpu (a training run on this TPU VM, a second
# test worker) must not stop a compile-only client, which uses no TPU.
os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')


@dataclasses.dataclass(frozen=True)
class Chip:
  kind: str  # As in libtpu's topology name ('v5e:2x4').
  hbm_gib: float
  peak_bf16_flops: float  # Per chip (both TensorCores of a megacore chip).


CHIPS = {kind: Chip(kind, hbm, TPU_PEAK_FLOPS[kind])
         for kind, hbm in (('v4', 32), ('v5e', 16), ('v5p', 95), ('v6e', 32))}


@dataclasses.dataclass(frozen=True)
class Topology:
  """A Google accelerator type: v4 and v5p names count TensorCores (2 per
  chip, one JAX device per chip), v5e and v6e names count chips."""
  name: str
  chip: Chip
  grid: str  # Chips along each axis of the slice.
  chips_per_host: tuple[int, int, int] | None = None  # None: libtpu's default.
  slices: int = 1  # Joined by the data-centre network (DCN).

  @property
  def chips(self) -> int:
    return math.prod(int(n) for n in self.grid.split('x'))


def _topologies():
  table = {}
  for cores, grid in ((8, '2x2x1'), (16, '2x2x2'), (32, '2x2x4'),
                      (64, '2x4x4')):
    table[f'v4-{cores}'] = Topology(f'v4-{cores}', CHIPS['v4'], grid)
  for cores, grid in ((8, '2x2x1'), (16, '2x2x2'), (32, '2x2x4'),
                      (64, '2x4x4'), (128, '4x4x4'), (256, '4x4x8'),
                      (512, '4x8x8')):
    table[f'v5p-{cores}'] = Topology(f'v5p-{cores}', CHIPS['v5p'], grid)
  for chip in ('v5e', 'v6e'):
    for chips, grid in ((4, '2x2'), (8, '2x4'), (16, '4x4'), (32, '4x8'),
                        (64, '8x8'), (128, '8x16'), (256, '16x16')):
      # A -8 slice is one host of 8 chips; larger ones have 4 per host.
      table[f'{chip}-{chips}'] = Topology(
          f'{chip}-{chips}', CHIPS[chip], grid,
          (2, 4, 1) if chips == 8 else None)
  return table


TOPOLOGIES = _topologies()


def topology(name: str, num_slices: int = 1) -> Topology:
  """The accelerator type `name`, or `num_slices` slices of it (named
  '2 x v5e-16')."""
  if name not in TOPOLOGIES:
    raise ValueError(f'Unknown topology {name!r}; known: '
                     f'{", ".join(TOPOLOGIES)}.')
  if num_slices < 1:
    raise ValueError(f'--num-slices {num_slices}: give at least 1.')
  if num_slices == 1:
    return TOPOLOGIES[name]
  return dataclasses.replace(TOPOLOGIES[name], name=f'{num_slices} x {name}',
                             slices=num_slices)


def topology_devices(topo: Topology) -> list:
  """The compile-only devices of `topo`, one per chip, all hosts of all
  its slices; each carries its `slice_index`, and the process indices go
  on from one slice to the next."""
  from jax.experimental import topologies
  try:
    import libtpu  # noqa: F401  (only whether it is installed)
  except ImportError:
    raise RuntimeError(
        'jaxformer compile needs libtpu: pip install -e ".[tpu]" (wheels '
        'exist for Linux x86_64 only).') from None
  kwargs = {'num_slices': topo.slices} if topo.slices > 1 else {}
  if topo.chip.kind in ('v4',):  # One device per chip, as on a v4 VM.
    kwargs['chip_config_name'] = 'megacore'
  if topo.chips_per_host:
    kwargs['chips_per_host_bounds'] = topo.chips_per_host
  with library_logs.without_libtpu_host_lines():  # Not a TPU VM: expected.
    description = topologies.get_topology_desc(
        f'{topo.chip.kind}:{topo.grid}', 'tpu', **kwargs)
  return list(description.devices)
