"""Device mesh, logical-axis rules and placing host data on the mesh.

The mesh has three axes: `data` (batch split, parameters replicated), `fsdp`
(batch split, parameters and optimizer state sharded) and `tensor` (heads, MLP
and vocabulary split). Over several slices (`mesh.dcn_data` > 1) a fourth,
leading axis `dcn` splits the batch across slices over the data-centre
network: each slice holds a whole copy of the parameters (FSDP within it),
and the gradients cross the DCN once per step. The model names its axes logically ('embed', 'mlp',
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
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxformer.parallel.row_share import RowShare

MESH_AXES = ('data', 'fsdp', 'tensor')
DCN_AXIS = 'dcn'  # Leads MESH_AXES in a mesh of several slices.

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


def slice_of(device) -> int:
  """The slice of a device: a TPU's `slice_index`; 0 for CPUs and GPUs
  (whose nodes are not slices: their data axis crosses nodes as it is)."""
  if device.platform != 'tpu':
    return 0
  return getattr(device, 'slice_index', 0)


def make_mesh(sizes: Mapping[str, int],
              devices: Sequence[jax.Device] | None = None, dcn_data: int = 1,
              slice_of=slice_of) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all), or
  over several slices a ('dcn', 'data', 'fsdp', 'tensor') one.

  Args:
    sizes: the axis sizes within one slice.
    dcn_data: how many slices the data axis spans, over the data-centre
      network: the number of slices of `devices`. As
      `mesh_utils.create_hybrid_device_mesh` builds a hybrid mesh, the
      devices are grouped by slice (`slice_of`: device -> slice, a
      parameter so that tests can group CPU devices into slices) in slice
      order, each slice's mesh laid out alone, and the slices stacked
      along `dcn`.

  Raises:
    ValueError naming both numbers where `dcn_data` is not the number of
    slices.
  """
  devices = list(jax.devices() if devices is None else devices)
  groups = {}
  for device in devices:
    groups.setdefault(slice_of(device), []).append(device)
  if len(groups) != dcn_data:
    raise ValueError(
        f'mesh.dcn_data={dcn_data} does not match the {len(groups)} slices '
        f'of the {len(devices)} devices: each slice holds one part of the '
        f'data axis, so set mesh.dcn_data={len(groups)}.')
  if dcn_data == 1:
    return _slice_mesh(sizes, devices)
  if len({len(group) for group in groups.values()}) > 1:
    raise ValueError(f'slices of unequal device counts '
                     f'{sorted(len(g) for g in groups.values())}: a mesh '
                     'over several slices needs equal ones.')
  meshes = [_slice_mesh(sizes, groups[key]) for key in sorted(groups)]
  return Mesh(np.stack([mesh.devices for mesh in meshes]),
              (DCN_AXIS, *MESH_AXES), **_auto_axes(1 + len(MESH_AXES)))


def _auto_axes(count: int) -> dict:
  if hasattr(jax.sharding, 'AxisType'):  # Newer jax defaults to Explicit.
    return {'axis_types': (jax.sharding.AxisType.Auto,) * count}
  return {}


def _slice_mesh(sizes: Mapping[str, int], devices: list) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over the `devices` of one slice.

  `jax.make_mesh` orders devices by the interconnect, which on a TPU pod
  interleaves hosts. That is fine for the batch axes (`row_shares` feeds
  each host's shards wherever they are), but a `tensor` group split over
  hosts would need one host's rows on another's devices. Where that happens
  and each host's devices divide into whole `tensor` groups, the devices
  are taken host by host instead (the interconnect order kept within each
  host), so every `tensor` group lies within one host.
  """
  shape = mesh_shape(sizes, len(devices))
  kwargs = _auto_axes(len(MESH_AXES))
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


def axis_rules(rules, mesh=None) -> tuple[tuple[str, object], ...]:
  """Normalises a rules table from a config (lists) into tuples: the one
  place that does. `logical_shardings` and `activate` call it, so callers
  pass `config.mesh.axis_rules` as it is. On a `mesh` with a `dcn` axis,
  every rule that names `data` names `dcn` before it: the data axis spans
  the slices (so 'batch' is split over dcn x data x fsdp and the
  parameters are replicated across slices)."""
  spans_slices = mesh is not None and DCN_AXIS in mesh.axis_names

  def as_axes(value):
    value = tuple(value) if isinstance(value, (list, tuple)) else value
    if not spans_slices:
      return value
    axes = (value,) if isinstance(value, str) else tuple(value or ())
    if 'data' in axes and DCN_AXIS not in axes:
      at = axes.index('data')
      return (*axes[:at], DCN_AXIS, *axes[at:])
    return value
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
  rules = axis_rules(rules, mesh)
  if shapes is not None:
    logical_tree = jax.tree.map(
        lambda spec, x: _divided_only(spec, x.shape, mesh, rules),
        logical_tree, shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec))
  return nn.logical_to_mesh_sharding(logical_tree, mesh, rules)


def batch_spec(mesh) -> PartitionSpec:
  """How a batch's rows split over `mesh` (a Mesh or AbstractMesh):
  `BATCH_SPEC`, led by `dcn` on a mesh of several slices."""
  if DCN_AXIS in mesh.axis_names:
    return PartitionSpec((DCN_AXIS, *BATCH_SPEC[0]))
  return BATCH_SPEC


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, batch_spec(mesh))


def row_shards(mesh) -> int:
  """How many parts the batch axes split a batch's rows into ([dcn x]
  data x fsdp)."""
  return int(np.prod([mesh.shape[axis] for axis in batch_spec(mesh)[0]]))


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
  with mesh_context, nn.logical_axis_rules(axis_rules(rules, mesh)):
    yield
