"""Starting JAX's distributed runtime: which cluster a process is in
(Open MPI, SLURM, Cloud TPU, Kubernetes) and the coordinator, process count
and id `jax.distributed.initialize` gets, from the environment or the
config's `distributed` settings."""

import importlib.util
import ipaddress
import os
import socket
import sys
from collections.abc import Mapping

import jax


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
  arguments['coordinator_bind_address'] = listen_address(
      settings, arguments, os.environ)
  # Collectives between CPU devices of different processes (GPUs and TPUs
  # have their own).
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # If joining fails, XLA aborts the process with its own message; this
  # line says what was attempted.
  listening = ''
  if arguments['process_id'] == 0:
    listening = (f' (listening on {arguments["coordinator_bind_address"]})'
                 if arguments['coordinator_bind_address'] else
                 ' (listening on every interface: set '
                 'distributed.coordinator_bind_address to the one the other '
                 'hosts reach)')
  print(f'jaxformer: joining the distributed runtime as process '
        f'{_or_detected(arguments["process_id"])} of '
        f'{_or_detected(arguments["num_processes"])}, coordinator '
        f'{_or_detected(arguments["coordinator_address"])}{listening}; '
        f'waiting up to {arguments["initialization_timeout"]}s for all '
        'processes.', file=sys.stderr, flush=True)
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


def listen_address(settings, arguments: dict,
                   environ: Mapping[str, str]) -> str | None:
  """Where process 0's coordinator listens (JAX's coordinator_bind_address):
  distributed.coordinator_bind_address, else JAX_COORDINATOR_BIND_ADDRESS,
  else for process 0 the interface its coordinator address names
  (`coordinator_bind_address`); None leaves JAX's default, every interface.
  """
  explicit = (settings.get('coordinator_bind_address')
              or environ.get('JAX_COORDINATOR_BIND_ADDRESS'))
  if explicit:
    return explicit
  address = arguments['coordinator_address']
  if address and arguments['process_id'] == 0:
    return coordinator_bind_address(address)
  return None


def coordinator_bind_address(address: str) -> str | None:
  """Where a coordinator that the others reach at `address` (host:port)
  listens: a loopback address as given (all processes on this machine, as
  under launch/local.sh); else the address of this machine's interface that
  the host resolves to; None when it resolves to none here but loopback (a
  host name that /etc/hosts maps to 127.0.1.1) or not at all."""
  host, _, port = address.rpartition(':')
  host = host.strip('[]')
  if host == 'localhost' or _is_loopback(host):
    return address
  try:
    found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
  except OSError:
    return None
  for family, _, _, _, sockaddr in found:
    ip = sockaddr[0]
    if not _is_loopback(ip) and _is_local(family, ip):
      return f'[{ip}]:{port}' if family == socket.AF_INET6 else f'{ip}:{port}'
  return None


def _is_loopback(host: str) -> bool:
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:  # A host name.
    return False


def _is_local(family, ip: str) -> bool:
  """Whether `ip` is an address of one of this machine's interfaces."""
  with socket.socket(family, socket.SOCK_STREAM) as probe:
    try:
      probe.bind((ip, 0))
    except OSError:
      return False
  return True


def _or_detected(value) -> str:
  return 'auto-detected' if value is None else str(value)


def runtime_started() -> bool:
  """Whether JAX's distributed runtime is up (with any process count)."""
  if hasattr(jax.distributed, 'is_initialized'):
    return jax.distributed.is_initialized()
  from jax._src import distributed as jax_distributed  # Older jax.
  return jax_distributed.global_state.client is not None

