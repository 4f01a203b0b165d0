"""Device mesh, logical-axis rules and placing host data on the mesh.

The mesh has three axes: `data` (batch split, parameters replicated), `fsdp`
(batch split, parameters and optimizer state sharded) and `tensor` (heads, MLP
and vocabulary split). The model names its axes logically ('embed', 'mlp',
'heads', 'kv', 'vocab', 'layers', and 'batch'/'length' for activations); a
rules table maps those names to mesh axes, so the parallelism is chosen by
configuration alone.
"""
import contextlib
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# Data parallel over `data` and `fsdp`; FSDP shards 'embed' over `fsdp`;
# tensor parallelism splits heads, MLP and vocabulary. Axes of size 1 cost
# nothing, so this one table serves every layout.
DEFAULT_AXIS_RULES = (
    ('batch', ('data', 'fsdp')),
    ('vocab', 'tensor'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
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
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(sizes, len(devices))
  kwargs = {}
  if hasattr(jax.sharding, 'AxisType'):  # Newer jax defaults to Explicit.
    kwargs['axis_types'] = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh(shape, MESH_AXES, devices=devices, **kwargs)


def axis_rules(rules) -> tuple[tuple[str, object], ...]:
  """Normalises a rules table from a config (lists) into tuples."""
  def as_axes(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value
  return tuple((str(name), as_axes(value)) for name, value in rules)


def logical_shardings(logical_tree, mesh: Mesh, rules):
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_tree, mesh, axis_rules(rules))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, BATCH_SPEC)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def global_batch(local_batch: Mapping[str, np.ndarray],
                 mesh: Mesh) -> dict[str, jax.Array]:
  """Assembles each process's rows into global arrays split over the batch
  axes of `mesh` (rows of process i follow those of process i-1)."""
  sharding = batch_sharding(mesh)
  return {key: jax.make_array_from_process_local_data(sharding, np.asarray(v))
          for key, v in local_batch.items()}


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


def _cluster_detected() -> bool:
  """Several processes launched by SLURM, or a multi-host Cloud TPU slice."""
  if int(os.environ.get('SLURM_NTASKS', '1')) > 1:
    return True
  hosts = os.environ.get('TPU_WORKER_HOSTNAMES', '')
  return len([h for h in hosts.split(',') if h]) > 1


def initialize_distributed(settings) -> None:
  """Starts JAX's multi-controller runtime when this is one of several
  processes; a no-op for a single process.

  Explicit settings (coordinator address, process count and id, from the
  config or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID)
  take precedence; otherwise SLURM and Cloud TPU VMs are auto-detected.
  """
  address = (settings.coordinator_address
             or os.environ.get('JAX_COORDINATOR_ADDRESS', ''))
  num_processes = int(settings.num_processes
                      or os.environ.get('JAX_NUM_PROCESSES', 0))
  process_id = int(settings.process_id if settings.process_id >= 0
                   else os.environ.get('JAX_PROCESS_ID', -1))
  if _distributed_initialized():
    return
  if address and num_processes > 1:
    # Only used by CPU devices; GPUs and TPUs keep their own collectives.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(
        coordinator_address=address, num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=int(settings.initialization_timeout),
        heartbeat_timeout_seconds=int(settings.heartbeat_timeout))
  elif _cluster_detected():
    jax.distributed.initialize(
        initialization_timeout=int(settings.initialization_timeout))


def _distributed_initialized() -> bool:
  from jax._src import distributed as jax_distributed
  return jax_distributed.global_state.client is not None
