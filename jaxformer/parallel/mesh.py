"""Device mesh, logical-axis rules and placing host data on the mesh.

The mesh has three axes: `data` (batch split, parameters replicated), `fsdp`
(batch split, parameters and optimizer state sharded) and `tensor` (heads, MLP
and vocabulary split). The model names its axes logically ('embed', 'mlp',
'heads', 'kv', 'vocab', 'layers', and 'batch'/'length' for activations); a
rules table maps those names to mesh axes, so the parallelism is chosen by
configuration alone.

What FSDP compiles to on TPU (`jaxformer compile`; `big` bf16, 128 x
(128+128), fsdp=16 on a v5p-32, unrolled): 159 all-gathers and 36 windowed
einsums gather the parameters, in the forward pass and again in the
backward; 97 windowed einsums reduce-scatter the gradients, one per weight
matrix. A windowed einsum is XLA's fusion of the collective with its matmul:
a loop that multiplies one shard while the next moves one step around a
ring, so the reduce-scatters appear as 665 collective-permutes and no
reduce-scatter instruction. The 4 all-to-alls are the embedding lookups and
their scatter-adds (encoder, decoder): the table is split over its features,
so each chip looks up every row's slice and trades slices for its own rows'
vectors, 2 MiB per lookup. Constraining the table to be gathered before the
lookup removes them, but then its 145 MiB float32 gradient is all-reduced
(with 1+1 layers: cost-model estimate 3.26 ms per step against 3.04). The 6
all-reduces are the loss and metric sums, the gradient norm and the small
bias and LayerNorm gradients (0.8 MiB in all). Nothing in it reshards
activations between layers.
"""
import contextlib
import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxformer.parallel.row_share import RowShare

MESH_AXES = ('data', 'fsdp', 'tensor')

# Data parallel over `data` and `fsdp`; FSDP shards 'embed' over `fsdp`;
# tensor parallelism splits heads, MLP and vocabulary. Axes of size 1 cost
# nothing, so this one table serves every layout. 'kv_heads' are the
# key/value heads of grouped-query attention (fewer than the query heads):
# split over `tensor` where that divides them, else replicated (see
# `UNLESS_UNDIVIDED`); each device then holds the key/value heads of its
# query heads.
DEFAULT_AXIS_RULES = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('embed', 'fsdp'),
    ('kv', None),
    ('length', None),
    ('layers', None),
)

BATCH_SPEC = PartitionSpec(('data', 'fsdp'))


def mesh_shape(sizes: Mapping[str, int], num_devices: int) -> tuple[int, ...]:
  """Resolves axis sizes (one may be -1: the rest of the devices)."""
  unknown = set(sizes) - set(MESH_AXES)
  if unknown:
    raise ValueError(f'Unknown mesh axes {sorted(unknown)}; use {MESH_AXES}.')
  shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
  if shape.count(-1) > 1:
    raise ValueError(f'At most one mesh axis may be -1, got {dict(sizes)}.')
  known = int(np.prod([s for s in shape if s != -1]))
  if -1 in shape:
    if num_devices % known:
      raise ValueError(f'mesh {dict(sizes)}: {num_devices} devices are not '
                       f'divisible by the fixed axes product {known}.')
    shape[shape.index(-1)] = num_devices // known
  if int(np.prod(shape)) != num_devices:
    raise ValueError(f'mesh {dict(zip(MESH_AXES, shape))} needs '
                     f'{int(np.prod(shape))} devices, but {num_devices} are '
                     'available; set one axis to -1 to take the rest.')
  return tuple(shape)


def make_mesh(sizes: Mapping[str, int],
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all).

  `jax.make_mesh` orders devices by the interconnect, which on a TPU pod
  interleaves hosts. That is fine for the batch axes (`row_shares` feeds
  each host's shards wherever they are), but a `tensor` group split over
  hosts would need one host's rows on another's devices. Where that happens
  and each host's devices divide into whole `tensor` groups, the devices
  are taken host by host instead (the interconnect order kept within each
  host), so every `tensor` group lies within one host.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  kwargs = {}
  if hasattr(jax.sharding, 'AxisType'):  # Newer jax defaults to Explicit.
    kwargs['axis_types'] = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  mesh = jax.make_mesh(shape, MESH_AXES, devices=devices, **kwargs)
  if _tensor_groups_span_processes(mesh.devices):
    host_major = sorted(mesh.devices.reshape(-1),
                        key=lambda device: device.process_index)
    by_host = np.array(host_major, dtype=object).reshape(shape)
    if not _tensor_groups_span_processes(by_host):
      mesh = Mesh(by_host, MESH_AXES, **kwargs)
  return mesh


def _tensor_groups_span_processes(devices: np.ndarray) -> bool:
  """Whether any [tensor] group of a [data, fsdp, tensor] device array has
  devices of more than one process."""
  groups = devices.reshape(-1, devices.shape[-1])
  return any(len({d.process_index for d in group}) > 1 for group in groups)


def axis_rules(rules) -> tuple[tuple[str, object], ...]:
  """Normalises a rules table from a config (lists) into tuples: the one
  place that does. `logical_shardings` and `activate` call it, so callers
  pass `config.mesh.axis_rules` as it is."""
  def as_axes(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value
  return tuple((str(name), as_axes(value)) for name, value in rules)


# Logical axes whose rule holds only for sizes that the rule's mesh axes
# divide: any other size is replicated. (Elsewhere an axis that the mesh
# does not divide is an error, which names it.)
UNLESS_UNDIVIDED = ('kv_heads',)


def _divided_only(spec: PartitionSpec, shape, mesh: Mesh, rules
                  ) -> PartitionSpec:
  """A logical `spec` of an array of `shape`, with each `UNLESS_UNDIVIDED`
  axis whose mesh axes do not divide its size replaced by None."""
  names = []
  for size, name in zip(shape, spec):
    if name in UNLESS_UNDIVIDED:
      axes = nn.logical_to_mesh_axes((name,), rules)[0]
      axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
      if size % int(np.prod([mesh.shape[axis] for axis in axes])):
        name = None
    names.append(name)
  return PartitionSpec(*names, *spec[len(names):])


def logical_shardings(logical_tree, mesh: Mesh, rules, shapes=None):
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`.

  Args:
    shapes: the arrays (or ShapeDtypeStructs) of `logical_tree`, to keep
      the `UNLESS_UNDIVIDED` axes whole where the mesh does not divide them.
  """
  rules = axis_rules(rules)
  if shapes is not None:
    logical_tree = jax.tree.map(
        lambda spec, x: _divided_only(spec, x.shape, mesh, rules),
        logical_tree, shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
  return nn.logical_to_mesh_sharding(logical_tree, mesh, rules)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH_SPEC)


def row_shards(mesh: Mesh) -> int:
  """How many parts the batch axes split a batch's rows into (data x fsdp)."""
  return int(np.prod([mesh.shape[axis] for axis in BATCH_SPEC[0]]))


def row_shares(mesh: Mesh, process_of=lambda device: device.process_index
               ) -> dict[int, RowShare]:
  """Each process's row shards: those its devices hold (see row_share.py).

  Args:
    process_of: device -> process index (a parameter so that the layouts of
      all hosts of a pod can be computed from one, as `jaxformer compile`
      does with the compile-only client's devices).

  Raises:
    ValueError naming the mesh and what to change, for the layouts that
    cannot be fed: a row shard held by devices of two processes (a
    `tensor` axis across hosts), or processes holding unequal numbers of
    shards.
  """
  shards = row_shards(mesh)
  held: dict[int, set[int]] = {}
  holders: dict[int, set[int]] = {}
  for device, index in batch_sharding(mesh).devices_indices_map(
      (shards,)).items():
    shard, process = index[0].start or 0, process_of(device)
    held.setdefault(process, set()).add(shard)
    holders.setdefault(shard, set()).add(process)
  sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
  shared = {s: sorted(p) for s, p in holders.items() if len(p) > 1}
  if shared:
    shard, processes = min(shared.items())
    raise ValueError(
        f'mesh {sizes} over {len(held)} processes: row shard {shard} is held '
        f'by devices of processes {processes}, so one host would need '
        "another's rows. Keep mesh.tensor within one host (it must divide "
        f'the {len(mesh.devices.flat) // len(held)} devices of a host), or '
        'make it 1 and use mesh.data / mesh.fsdp instead.')
  counts = {p: len(s) for p, s in held.items()}
  if len(set(counts.values())) > 1:
    raise ValueError(
        f'mesh {sizes}: processes hold unequal numbers of row shards '
        f'{dict(sorted(counts.items()))}; every process must feed as many '
        'rows as the others. Use all devices of every host (mesh axes whose '
        'product is the device count).')
  return {p: RowShare(tuple(sorted(s)), shards) for p, s in sorted(held.items())}


def row_share(mesh: Mesh) -> RowShare:
  """This process's row shards of `mesh` (see `row_shares`)."""
  return row_shares(mesh)[jax.process_index()]


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
  """`spec` with mesh axis `axis` dropped from every dimension."""
  def drop(entry):
    if isinstance(entry, tuple):
      kept = tuple(a for a in entry if a != axis)
      return kept if len(kept) > 1 else (kept[0] if kept else None)
    return None if entry == axis else entry
  return PartitionSpec(*(drop(entry) for entry in spec))


def gathered(tree, axis: str = 'fsdp'):
  """The arrays of `tree` resharded without `axis` (FSDP-sharded parameters
  gathered whole, tensor-parallel splits kept): a decoding loop given these
  gathers nothing at each token."""
  def gather(x):
    sharding = getattr(x, 'sharding', None)
    if not isinstance(sharding, NamedSharding):
      return x
    return jax.device_put(x, NamedSharding(
        sharding.mesh, without_axis(sharding.spec, axis)))
  return jax.tree.map(gather, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: Mapping[str, np.ndarray],
                 mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays split over the batch
  axes of `mesh`: a process's rows are those of its row shards in order
  (`row_share`), which is how JAX places process-local data."""
  sharding = batch_sharding(mesh)
  return {key: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for key, v in local_batch.items()}


# HBM per chip by `device_kind`, for TPUs that cannot report it themselves
# (libtpu's compile-only devices).
TPU_HBM_GIB = {'TPU v4': 32, 'TPU v5 lite': 16, 'TPU v5': 95, 'TPU v5p': 95,
               'TPU v6 lite': 32}


def device_memory_bytes(device) -> int | None:
  """An accelerator's memory: what a device of its kind on this host
  reports, else the kind's HBM; None for CPUs and for devices of unknown
  size. `device`: a `jax.Device` or an AbstractMesh's `abstract_device`."""
  if device.platform == 'cpu':
    return None
  for local in (device, *jax.local_devices()):
    if local.device_kind != device.device_kind or not hasattr(
        local, 'memory_stats'):
      continue
    try:
      stats = local.memory_stats()
    except jax.errors.JaxRuntimeError:  # Not addressable (compile-only).
      continue
    if stats and stats.get('bytes_limit'):
      return int(stats['bytes_limit'])
  gib = TPU_HBM_GIB.get(device.device_kind)
  return None if gib is None else gib * 1024 ** 3

@contextlib.contextmanager
def activate(mesh: Mesh, rules):
  """Makes `mesh` and the logical-axis `rules` current, so that the model's
  activation constraints take effect in functions traced inside."""
  if hasattr(jax, 'set_mesh'):
    mesh_context = jax.set_mesh(mesh)
  elif hasattr(jax.sharding, 'use_mesh'):
    mesh_context = jax.sharding.use_mesh(mesh)
  else:
    mesh_context = mesh
  with mesh_context, nn.logical_axis_rules(axis_rules(rules)):
    yield
