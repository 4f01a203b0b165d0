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

from jaxformer.row_share import RowShare

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


def logical_shardings(logical_tree, mesh: Mesh, rules):
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_tree, mesh, axis_rules(rules))


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


def _slurm_step_tasks(environ: Mapping[str, str]) -> int:
  """Tasks of the SLURM job step this process belongs to (0 outside srun;
  a batch script alone is not a step of several processes)."""
  if 'SLURM_STEP_NODELIST' not in environ:
    return 0
  return int(environ.get('SLURM_STEP_NUM_TASKS')
             or environ.get('SLURM_NTASKS') or 0)


# Open MPI (mpirun) sets these in every rank; Open MPI 4 (ORTE) also sets
# OMPI_MCA_orte_hnp_uri, from which JAX derives the coordinator.
OMPI_SIZE, OMPI_RANK = 'OMPI_COMM_WORLD_SIZE', 'OMPI_COMM_WORLD_RANK'
OMPI_URI = 'OMPI_MCA_orte_hnp_uri'
# JAX's port for a TPU slice's coordinator (jax/_src/clusters/
# cloud_tpu_cluster.py), unless JAX_COORDINATOR_PORT says otherwise.
TPU_COORDINATOR_PORT = '8482'


def cluster_detected_by_jax(environ: Mapping[str, str], on_cloud_tpu: bool,
                            k8s_client: bool = False) -> str | None:
  """The cluster whose coordinator, process count and id JAX's own
  detection (jax/_src/clusters) finds, when it has several processes:
  'ompi' (mpirun of Open MPI 4), 'slurm' (a job step), 'tpu' (a Cloud TPU
  VM, or a TPU pod of a GKE JobSet) or 'k8s' (an indexed Job or JobSet pod;
  JAX needs the `kubernetes` package, `k8s_client`, for it); else None."""
  if OMPI_URI in environ and int(environ.get(OMPI_SIZE) or 1) > 1:
    return 'ompi'
  if _slurm_step_tasks(environ) > 1:
    return 'slurm'
  if on_cloud_tpu:
    return 'tpu'
  if (k8s_client and 'KUBERNETES_SERVICE_HOST' in environ
      and 'JOB_COMPLETION_INDEX' in environ):
    return 'k8s'
  return None


def _cluster_values(environ: Mapping[str, str]):
  """(address, process count, process id, where) from a cluster's variables
  that JAX's detection leaves unread: Open MPI 5 ranks (no ORTE URI), a GKE
  TPU pod's TPU_WORKER_* seen without TPU runtime, a Kubernetes Indexed Job
  pod's JOB_COMPLETION_INDEX. '' / 0 / -1 where it says nothing."""
  if int(environ.get(OMPI_SIZE) or 1) > 1:
    rank = int(environ.get(OMPI_RANK) or 0)
    return ('', int(environ[OMPI_SIZE]), rank,
            f'rank {rank} of an Open MPI job (mpirun) without '
            f'{OMPI_URI} (Open MPI 5): pass the coordinator to every rank, '
            'e.g. mpirun -x JAX_COORDINATOR_ADDRESS=<first host>:<port>')
  hosts = environ.get('TPU_PROCESS_ADDRESSES') or environ.get(
      'TPU_WORKER_HOSTNAMES')
  if hosts and len(hosts.split(',')) > 1 and 'TPU_WORKER_ID' in environ:
    port = environ.get('JAX_COORDINATOR_PORT', TPU_COORDINATOR_PORT)
    return (f"{hosts.split(',')[0].split(':')[0]}:{port}",
            len(hosts.split(',')), int(environ['TPU_WORKER_ID']), 'a TPU pod')
  if 'JOB_COMPLETION_INDEX' in environ:
    index = int(environ['JOB_COMPLETION_INDEX'])
    return ('', 0, index,
            f'pod {index} of a Kubernetes Indexed Job: set JAX_NUM_PROCESSES '
            'and JAX_COORDINATOR_ADDRESS (pod 0 through the headless '
            'service, <job>-0.<subdomain>:<port>) in its spec, as '
            'launch/gke_jobset.py does, or distributed.num_processes=1 for '
            'independent runs')
  return '', 0, -1, ''


def _explicit_values(settings, environ: Mapping[str, str]):
  """(address, process count, process id) from the config, else the
  environment; '' / 0 / -1 where neither sets one."""
  address = (settings.coordinator_address
             or environ.get('JAX_COORDINATOR_ADDRESS', ''))
  num_processes = int(settings.num_processes
                      or environ.get('JAX_NUM_PROCESSES') or 0)
  process_id = int(settings.process_id if settings.process_id >= 0
                   else environ.get('JAX_PROCESS_ID') or -1)
  return address, num_processes, process_id


def distributed_arguments(settings, environ: Mapping[str, str] = os.environ,
                          on_cloud_tpu: bool = False,
                          k8s_client: bool = False) -> dict | None:
  """Keyword arguments for `jax.distributed.initialize`, or None when this
  process runs alone.

  Explicit values (config.distributed, else JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES and JAX_PROCESS_ID) win. Without them, a cluster that
  JAX detects itself (`cluster_detected_by_jax`: Open MPI 4, a SLURM job
  step of several tasks, a Cloud TPU VM, Kubernetes with its client) is
  left to that detection (on a single-host TPU VM that is a runtime of one
  process); the variables of clusters it does not detect (`_cluster_values`)
  fill in what they can, and the rest must be given. num_processes=1 means
  a single process without a runtime, unless a coordinator address is given
  too: then a runtime of one process starts, as on a single-host TPU VM
  (`launch/local.sh --processes 1` does that).
  """
  address, num_processes, process_id = _explicit_values(settings, environ)
  if num_processes == 1 and not address:
    return None
  timeouts = dict(
      initialization_timeout=int(settings.initialization_timeout),
      heartbeat_timeout_seconds=int(settings.heartbeat_timeout),
      # A process that fails waits this long at exit for the others; they
      # are stuck in a collective, so this bounds how long a failure takes.
      shutdown_timeout_seconds=int(
          settings.get('shutdown_timeout', settings.heartbeat_timeout)))
  cluster = cluster_detected_by_jax(environ, on_cloud_tpu, k8s_client)
  where = ''
  if not cluster:
    found_address, found_count, found_id, where = _cluster_values(environ)
    address = address or found_address
    num_processes = num_processes or found_count
    process_id = process_id if process_id >= 0 else found_id
  if num_processes == 1 and not address:
    return None
  explicit = bool(address) or num_processes > 1 or process_id >= 0
  if not (explicit or cluster):
    return None
  if not cluster:
    _check_complete(address, num_processes, process_id, where)
  return dict(coordinator_address=address or None,
              num_processes=num_processes or None,
              process_id=process_id if process_id >= 0 else None, **timeouts)


def _check_complete(address: str, num_processes: int, process_id: int,
                    where: str = ''):
  """Outside a cluster JAX detects, all three values must be known."""
  missing = [f'{name} (--config.distributed.{name} or {env})'
             for name, env, value in (
                 ('coordinator_address', 'JAX_COORDINATOR_ADDRESS', address),
                 ('num_processes', 'JAX_NUM_PROCESSES', num_processes > 0),
                 ('process_id', 'JAX_PROCESS_ID', process_id >= 0))
             if not value]
  if missing:
    raise ValueError(
        'A multi-process run needs a coordinator address, the process count '
        "and this process's id; missing: " + ', '.join(missing) + '. '
        + (f'This process is {where}.' if where else
           'Set all three on every process (launch/local.sh does), or none '
           'for a single-process run.'))
  if not 0 <= process_id < num_processes:
    raise ValueError(f'distributed.process_id={process_id} is not in [0, '
                     f'{num_processes}); give each of the {num_processes} '
                     'processes a different id from 0.')


def _on_cloud_tpu_vm() -> bool:
  from jax._src import cloud_tpu_init  # Set when jax is imported.
  return bool(getattr(cloud_tpu_init, 'running_in_cloud_tpu_vm', False))


def initialize_distributed(settings) -> None:
  """Starts JAX's multi-controller runtime when this is one of several
  processes (see `distributed_arguments`); a no-op for a single process or
  when it is already running. Must run before anything touches a device.

  Every process sends heartbeats to the coordinator (process 0): when one
  dies, the others are terminated with an error after at most
  distributed.heartbeat_timeout seconds instead of waiting forever in a
  collective.
  """
  if runtime_started():
    return
  on_cloud_tpu = _on_cloud_tpu_vm()
  k8s_client = importlib.util.find_spec('kubernetes') is not None
  arguments = distributed_arguments(settings, os.environ, on_cloud_tpu,
                                    k8s_client)
  if arguments is None:
    return
  # Collectives between CPU devices of different processes (GPUs and TPUs
  # have their own).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # If joining fails, XLA aborts the process with its own message; this
  # line says what was attempted.
  print(f'jaxformer: joining the distributed runtime as process '
        f'{_or_detected(arguments["process_id"])} of '
        f'{_or_detected(arguments["num_processes"])}, coordinator '
        f'{_or_detected(arguments["coordinator_address"])}; waiting up to '
        f'{arguments["initialization_timeout"]}s for all processes.',
        file=sys.stderr, flush=True)
  try:
    jax.distributed.initialize(**arguments)
  except ValueError as e:
    # On a TPU VM without slice metadata JAX finds no cluster and starts
    # nothing: this process runs alone.
    if (arguments['num_processes'] is not None or cluster_detected_by_jax(
        os.environ, on_cloud_tpu, k8s_client) != 'tpu'):
      raise
    print(f'jaxformer: no cluster detected ({e}); running as a single '
          'process.', file=sys.stderr, flush=True)


def _or_detected(value) -> str:
  return 'auto-detected' if value is None else str(value)


def runtime_started() -> bool:
  """Whether JAX's distributed runtime is up (with any process count)."""
  if hasattr(jax.distributed, 'is_initialized'):
    return jax.distributed.is_initialized()
  from jax._src import distributed as jax_distributed  # Older jax.
  return jax_distributed.global_state.client is not None

