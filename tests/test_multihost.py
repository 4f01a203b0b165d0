"""Multi-process (multi-host) data-parallel training, on one machine.

Each process is a separate OS process with fake CPU devices, joined to the
others by JAX's distributed runtime on 127.0.0.1 (gloo collectives), as on a
pod slice or a SLURM job. launch/local.sh starts them.
"""
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import cpu_devices
import jax
import numpy as np
import pytest
import trained_runs

from jaxformer.config import settings as config_lib
from jaxformer.parallel import peers
from jaxformer.parallel import cluster
from jaxformer.run.metrics import read_metrics

REPO = pathlib.Path(__file__).resolve().parents[1]
LOCAL_SH = REPO / 'launch' / 'local.sh'
TRAIN = [sys.executable, '-m', 'jaxformer', 'train',
         '--config', f'{REPO}/configs/quickstart.py:runlocal']
# Every step logged; no BLEU, test-split decoding or FLOP/s measurement.
QUICK = ['--config.train.log_every=1', '--config.eval.every=0',
         '--config.eval.final_split=', '--config.eval.bleu_examples=0',
         '--config.train.peak_flops=1e9', '--config.checkpoint.every=10']
RUN_TIMEOUT = 1200  # seconds; generous for a loaded 2-core machine


@pytest.fixture(scope='module', autouse=True)
def process_settings(tmp_path_factory):
  """Every process these tests start (through launch/local.sh, which sets
  its own device count, or directly) compiles as tests/cpu_devices.py says
  and uses the test run's compilation cache: runs of the same layout load
  the programs the first one compiled."""
  with pytest.MonkeyPatch.context() as patch:
    for name, value in trained_runs.process_settings(
        tmp_path_factory).items():
      patch.setenv(name, value)
    yield


# -------------------------------------------- which processes join a runtime


def distributed_settings(**values):
  settings = config_lib.default_config().distributed
  settings.update(values)
  return settings


def test_a_lone_process_starts_no_runtime():
  assert cluster.distributed_arguments(distributed_settings(), {}) is None


def test_the_environment_names_coordinator_count_and_id():
  environ = {'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234',
             'JAX_NUM_PROCESSES': '4', 'JAX_PROCESS_ID': '3'}
  arguments = cluster.distributed_arguments(
      distributed_settings(heartbeat_timeout=15, shutdown_timeout=20), environ)
  assert arguments == dict(
      coordinator_address='10.0.0.1:1234', num_processes=4, process_id=3,
      initialization_timeout=300, heartbeat_timeout_seconds=15,
      shutdown_timeout_seconds=20)


def test_config_values_take_precedence_over_the_environment():
  environ = {'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234',
             'JAX_NUM_PROCESSES': '4', 'JAX_PROCESS_ID': '3'}
  arguments = cluster.distributed_arguments(
      distributed_settings(coordinator_address='host0:99', num_processes=2,
                           process_id=0), environ)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('host0:99', 2, 0)


def test_one_process_means_no_runtime_even_in_a_cluster():
  slurm_step = {'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_TASKS': '2'}
  assert cluster.distributed_arguments(
      distributed_settings(num_processes=1), slurm_step,
      on_cloud_tpu=True) is None


def test_one_process_with_a_coordinator_starts_a_runtime_of_one():
  """As on a single-host TPU VM, and as `launch/local.sh --processes 1`."""
  environ = {'JAX_COORDINATOR_ADDRESS': '127.0.0.1:1234',
             'JAX_NUM_PROCESSES': '1', 'JAX_PROCESS_ID': '0'}
  arguments = cluster.distributed_arguments(distributed_settings(), environ)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('127.0.0.1:1234', 1, 0)


def test_slurm_steps_and_tpu_vms_leave_the_values_to_jax_detection():
  slurm_step = {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '8',
                'SLURM_STEP_NODELIST': 'node[1-2]', 'SLURM_STEP_NUM_TASKS': '8',
                'SLURM_PROCID': '5', 'SLURM_LOCALID': '1'}
  for environ, on_cloud_tpu in ((slurm_step, False), ({}, True)):
    arguments = cluster.distributed_arguments(
        distributed_settings(), environ, on_cloud_tpu=on_cloud_tpu)
    assert arguments['coordinator_address'] is None
    assert arguments['num_processes'] is None
    assert arguments['process_id'] is None
    assert arguments['heartbeat_timeout_seconds'] == 60


def test_a_slurm_batch_script_outside_srun_is_one_process():
  batch_script = {'SLURM_JOB_ID': '7', 'SLURM_NTASKS': '8', 'SLURM_PROCID': '0'}
  assert cluster.distributed_arguments(distributed_settings(),
                                        batch_script) is None


def test_an_incomplete_explicit_setup_names_what_is_missing():
  environ = {'JAX_COORDINATOR_ADDRESS': '10.0.0.1:1234',
             'JAX_NUM_PROCESSES': '2'}
  with pytest.raises(ValueError, match='missing: process_id .*JAX_PROCESS_ID'):
    cluster.distributed_arguments(distributed_settings(), environ)


def test_a_process_id_outside_the_count_is_an_error():
  with pytest.raises(ValueError, match=r'process_id=2 is not in \[0, 2\)'):
    cluster.distributed_arguments(distributed_settings(
        coordinator_address='127.0.0.1:1', num_processes=2, process_id=2), {})


# Open MPI 4's mpirun: ranks of one job, coordinator from the ORTE URI.
MPIRUN = {'OMPI_MCA_orte_hnp_uri': '1531576320.0;tcp://10.96.0.1:34911',
          'OMPI_COMM_WORLD_SIZE': '4', 'OMPI_COMM_WORLD_RANK': '2',
          'OMPI_COMM_WORLD_LOCAL_RANK': '0'}


def jax_detection(monkeypatch, environ):
  """What JAX's own cluster detection (the installed jax) finds in
  `environ`: (coordinator, process count, process id, local devices)."""
  from jax._src import clusters
  for name in list(os.environ):
    if name.startswith(('OMPI_', 'SLURM_', 'TPU_', 'JOB_COMPLETION',
                        'KUBERNETES_', 'JAX_')):
      monkeypatch.delenv(name)
  for name, value in environ.items():
    monkeypatch.setenv(name, value)
  return clusters.ClusterEnv.auto_detect_unset_distributed_params(
      None, None, None, None, None, 10)


def test_mpirun_ranks_join_one_runtime_found_by_jax(monkeypatch):
  arguments = cluster.distributed_arguments(distributed_settings(), MPIRUN)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == (None, None, None)
  # JAX fills them in from the same variables: rank 2 of 4.
  address, count, rank, _ = jax_detection(monkeypatch, MPIRUN)
  assert (address.split(':')[0], count, rank) == ('10.96.0.1', 4, 2)


def test_open_mpi_5_ranks_take_count_and_rank_and_need_the_coordinator(
    monkeypatch):
  ranks = {k: v for k, v in MPIRUN.items() if k != 'OMPI_MCA_orte_hnp_uri'}
  assert jax_detection(monkeypatch, ranks)[:3] == (None, None, None)
  with pytest.raises(ValueError, match='missing: coordinator_address .*rank 2 '
                     'of an Open MPI job.*mpirun -x JAX_COORDINATOR_ADDRESS'):
    cluster.distributed_arguments(distributed_settings(), ranks)
  arguments = cluster.distributed_arguments(
      distributed_settings(), dict(ranks, JAX_COORDINATOR_ADDRESS='n1:1234'))
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('n1:1234', 4, 2)


def test_mpirun_of_one_rank_is_one_process():
  one = dict(MPIRUN, OMPI_COMM_WORLD_SIZE='1', OMPI_COMM_WORLD_RANK='0')
  assert cluster.distributed_arguments(distributed_settings(), one) is None


def test_kubernetes_indexed_job_pods_join_one_runtime():
  pod = {'KUBERNETES_SERVICE_HOST': '10.0.0.1', 'JOB_COMPLETION_INDEX': '3'}
  # With the kubernetes client JAX reads the Job (count, coordinator) itself.
  arguments = cluster.distributed_arguments(distributed_settings(), pod,
                                             k8s_client=True)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == (None, None, None)
  # Without it, the index is the process id; the spec gives the rest.
  spec = dict(pod, JAX_NUM_PROCESSES='4',
              JAX_COORDINATOR_ADDRESS='run-workers-0-0.run:1234')
  arguments = cluster.distributed_arguments(distributed_settings(), spec)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('run-workers-0-0.run:1234', 4, 3)
  # An Indexed Job pod that says nothing more is not a run of its own.
  with pytest.raises(ValueError, match='pod 3 of a Kubernetes Indexed Job.*'
                     'JAX_NUM_PROCESSES.*num_processes=1'):
    cluster.distributed_arguments(distributed_settings(), pod)


def test_gke_tpu_pods_are_left_to_jax_on_a_tpu_and_built_elsewhere():
  pod = {'TPU_WORKER_ID': '1',
         'TPU_WORKER_HOSTNAMES': 'h-0.s,h-1.s,h-2.s,h-3.s'}
  on_tpu = cluster.distributed_arguments(distributed_settings(), pod,
                                          on_cloud_tpu=True)
  assert on_tpu['num_processes'] is None and on_tpu['process_id'] is None
  arguments = cluster.distributed_arguments(distributed_settings(), pod)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('h-0.s:8482', 4, 1)


# A process of a 2-process run through launch/local.sh: process 0 reports
# the coordinator's listening sockets (from /proc/net/tcp*) and, as someone
# who reached its port could, writes a path as the token-cache key; process
# 1 must refuse that key.
COORDINATOR_PROBE = """
import ipaddress, sys
import jax
from jaxformer.config import settings
from jaxformer.parallel import cluster, peers

def listening(port):
  found = set()
  for table in ('/proc/net/tcp', '/proc/net/tcp6'):
    for line in open(table).read().splitlines()[1:]:
      local, state = line.split()[1], line.split()[3]
      ip, hex_port = local.split(':')
      if state == '0A' and int(hex_port, 16) == port:
        raw = bytes.fromhex(ip)
        # Each 32-bit word is in host (little-endian) order.
        raw = b''.join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
        ip = ipaddress.ip_address(raw)
        found.add(str(getattr(ip, 'ipv4_mapped', None) or ip))
  return sorted(found)

cluster.initialize_distributed(settings.default_config().distributed)
if jax.process_index() == 0:
  print('listening', *listening(int(sys.argv[1])), flush=True)
  peers._client().key_value_set('jaxformer/token_cache/train', '../../x')
else:
  try:
    peers.from_process_0('token_cache/train', lambda: 'unused', 60,
                         pattern='[0-9a-f]{64}')
  except peers.StoreValueError as e:
    print('refused:', e, flush=True)
"""


@pytest.mark.slow
def test_the_coordinator_listens_on_loopback_and_bad_store_values_are_refused(
    tmp_path):
  """A launch/local.sh run's coordinator (unauthenticated: whoever reaches
  its port can read and write the runtime's key-value store) listens on
  127.0.0.1 only, not on every interface; a value read from the store that
  is not of its form (a token-cache key that is a path) is refused."""
  script = tmp_path / 'probe.py'
  script.write_text(COORDINATOR_PROBE)
  port = free_port()
  result = subprocess.run(
      [str(LOCAL_SH), '--processes', '2', '--devices', '1', '--port',
       str(port), '--', sys.executable, str(script), str(port)],
      capture_output=True, text=True, timeout=RUN_TIMEOUT)
  assert result.returncode == 0, result.stdout + result.stderr
  assert 'listening 127.0.0.1\n' in result.stdout
  assert ("[p1] refused: jaxformer/token_cache/train from the distributed "
          "runtime's key-value store is not of the form [0-9a-f]{64}: "
          "'../../x'") in result.stdout


def test_the_coordinator_binds_the_interface_its_address_names():
  bind = cluster.coordinator_bind_address
  assert bind('127.0.0.1:1234') == '127.0.0.1:1234'
  assert bind('localhost:1234') == 'localhost:1234'
  assert bind('[::1]:1234') == '[::1]:1234'
  # An address of another machine (TEST-NET-1): JAX's default, every
  # interface (process 0 of a run resolves its own name to its interface).
  assert bind('192.0.2.1:1234') is None
  # An explicit bind address wins: the config's, else JAX's variable.
  explicit = cluster.listen_address(
      distributed_settings(coordinator_bind_address='10.1.2.3:9'),
      dict(coordinator_address='127.0.0.1:9', process_id=0),
      {'JAX_COORDINATOR_BIND_ADDRESS': '[::]:9'})
  assert explicit == '10.1.2.3:9'
  assert cluster.listen_address(
      distributed_settings(), dict(coordinator_address='127.0.0.1:9',
                                   process_id=0),
      {'JAX_COORDINATOR_BIND_ADDRESS': '[::]:9'}) == '[::]:9'


# ------------------------------------------------------ end-to-end training


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def process_env(port: int, index: int, count: int = 2,
                devices: int = 2) -> dict[str, str]:
  """The environment of process `index` of `count`, with `devices` CPU
  devices each, started directly (not through launch/local.sh)."""
  return dict(os.environ, JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
              JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(index),
              JAX_PLATFORMS='cpu',
              XLA_FLAGS=cpu_devices.xla_flags(devices))


def train(workdir, processes: int, devices: int, steps: int, *overrides,
          program=TRAIN):
  """`jaxformer train` as `processes` x `devices` through launch/local.sh;
  returns process 0's output."""
  command = [str(LOCAL_SH), '--processes', str(processes), '--devices',
             str(devices), '--port', str(free_port()), '--', *program,
             '--workdir', str(workdir), f'--config.train.num_steps={steps}',
             *QUICK, *overrides]
  result = subprocess.run(command, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
  assert result.returncode == 0, (
      f'{processes} x {devices} run failed:\n{result.stdout[-4000:]}\n'
      f'{result.stderr[-4000:]}')
  return result.stdout


def train_losses(workdir) -> dict[int, float]:
  return {r['step']: r['loss'] for r in read_metrics(workdir) if 'loss' in r}


def eval_records(workdir) -> list[dict]:
  return [r for r in read_metrics(workdir) if 'eval_loss' in r]


@pytest.mark.slow
def test_one_and_two_processes_read_the_same_global_batches(tmp_path):
  """1 x 4 and 2 x 2 devices: the same global batches from the input
  pipeline (each process reads its rows from its run's token cache, which
  process 0 writes), without training."""
  from jaxformer.data import builtin
  from jaxformer.data import tokenizer as tokenizer_lib
  tok_config = config_lib.default_config().data.tokenizer
  tok_config.vocab_size = 200
  tokenizer_lib.train_tokenizer(
      [text for pair in builtin.generate(600, 0, 'train') for text in pair],
      str(tmp_path / 'joint'), tok_config)
  script = [sys.executable, str(REPO / 'tests' / 'global_batches.py'),
            str(tmp_path / 'joint.model')]
  single = subprocess.run(
      [*script, str(tmp_path / 'cache1'), str(tmp_path / 'one.npz')],
      env=dict(os.environ, JAX_PLATFORMS='cpu',
               XLA_FLAGS=cpu_devices.xla_flags(4)),
      capture_output=True, text=True, timeout=RUN_TIMEOUT)
  assert single.returncode == 0, single.stderr[-4000:]
  one = np.load(tmp_path / 'one.npz')
  # Processes owning neighbouring devices, then taking them in turn (as on
  # a TPU pod): each feeds the rows of its own row shards.
  for order in ('', 'interleaved'):
    port = free_port()
    pair = [subprocess.Popen(
        [*script, str(tmp_path / f'cache2{order}'),
         str(tmp_path / f'two{order}.npz'), order],
        env=process_env(port, index), stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for index in range(2)]
    for index, process in enumerate(pair):
      _, errors = process.communicate(timeout=RUN_TIMEOUT)
      assert process.returncode == 0, f'process {index}:\n{errors[-4000:]}'
    two = np.load(tmp_path / f'two{order}.npz')
    assert sorted(one) == sorted(two) and len(one) == 3 * (6 + 2)
    for key in one:
      np.testing.assert_array_equal(one[key], two[key], err_msg=key)


@pytest.fixture(scope='module')
def one_process(tmp_path_factory):
  """1 process x 4 devices, 10 steps (it trains the tokenizer)."""
  workdir = tmp_path_factory.mktemp('one_process')
  train(workdir, 1, 4, 10)
  return workdir


@pytest.fixture(scope='module')
def two_processes(tmp_path_factory, one_process):
  """2 processes x 2 devices, 10 steps (saved at 5 and 10), with the first
  run's tokenizer."""
  workdir = tmp_path_factory.mktemp('two_processes')
  train(workdir, 2, 2, 10, *shared_tokenizer(one_process),
        '--config.checkpoint.every=5')
  return workdir


def shared_tokenizer(one_process) -> list[str]:
  model = one_process / 'tokenizer' / 'joint.model'
  return [f'--config.data.tokenizer.model_path={model}']


@pytest.mark.slow
def test_two_processes_train_exactly_like_one(one_process, two_processes):
  one, two = train_losses(one_process), train_losses(two_processes)
  # Process 0 alone writes metrics: one record per step, none doubled.
  assert sorted(two) == list(range(1, 11))
  assert [r['step'] for r in read_metrics(two_processes)] == list(range(1, 11)) + [10]
  for step in range(1, 11):
    assert two[step] == pytest.approx(one[step], abs=1e-5), step
  # Evaluation sees every dev example exactly once, however it is split.
  (eval_one,), (eval_two,) = eval_records(one_process), eval_records(two_processes)
  assert eval_two['eval_loss'] == pytest.approx(eval_one['eval_loss'], abs=1e-5)
  assert eval_two['eval_accuracy'] == pytest.approx(eval_one['eval_accuracy'],
                                                    abs=1e-6)
  # Process 0 alone wrote the token cache beside the tokenizer.
  assert sorted(os.listdir(two_processes / 'tokenizer')) == [
      'joint.model', 'token_cache']
  cached = sorted(os.listdir(two_processes / 'tokenizer' / 'token_cache'))
  assert [name.split('-')[0] for name in cached] == ['dev', 'train'], cached
  assert json.loads((two_processes / 'config.json').read_text())['train'][
      'num_steps'] == 10


@pytest.mark.slow
def test_two_interleaved_processes_train_exactly_like_one(one_process,
                                                          tmp_path):
  """As on a TPU pod, the mesh takes the processes' devices in turn, so
  each process feeds row shards that are not neighbours: the same losses
  and parameters as one process with the same global batch."""
  from jaxformer.checkpoints import trained
  workdir = tmp_path / 'interleaved'
  output = train(workdir, 2, 2, 10, *shared_tokenizer(one_process),
                 program=[sys.executable, str(REPO / 'tests' /
                                              'train_interleaved.py'),
                          *TRAIN[3:]])
  assert 'Training steps 1-10' in output
  one, two = train_losses(one_process), train_losses(workdir)
  for step in range(1, 11):
    assert two[step] == pytest.approx(one[step], abs=1e-5), step
  params_one = trained.load(str(one_process)).params
  params_two = trained.load(str(workdir)).params
  for a, b in zip(jax.tree.leaves(params_one), jax.tree.leaves(params_two)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.slow
def test_checkpoints_restore_across_process_counts(one_process, two_processes,
                                                   tmp_path):
  # Each run resumes a copy of the other layout's step-10 checkpoint.
  from_two = shutil.copytree(two_processes, tmp_path / 'from_two')
  from_one = shutil.copytree(one_process, tmp_path / 'from_one')
  output_one = train(from_two, 1, 4, 12, *shared_tokenizer(one_process))
  output_two = train(from_one, 2, 2, 12)
  for output in (output_one, output_two):
    assert 'Resuming from the checkpoint of step 10' in output
  one, two = train_losses(from_two), train_losses(from_one)
  for step in (11, 12):
    assert one[step] == pytest.approx(two[step], abs=1e-5), step
  assert one[11] < train_losses(one_process)[1]


def run_processes(command, tmp_path, count: int, devices: int = 2,
                  port: int | None = None):
  """Starts `command` as `count` processes (not through launch/local.sh,
  so that each can be signalled); returns them and their log paths."""
  port = port or free_port()
  logs = [tmp_path / f'process{i}.log' for i in range(count)]
  processes = []
  for i, log in enumerate(logs):
    with open(log, 'w') as out:
      processes.append(subprocess.Popen(
          command[i] if isinstance(command[0], list) else command,
          stdout=out, stderr=subprocess.STDOUT,
          env=process_env(port, i, count, devices)))
  return processes, logs


def end_all(processes) -> None:
  for process in processes:
    if process.poll() is None:
      process.kill()
    process.wait()


def wait_for_step(workdir, processes, logs, step: int, timeout: float) -> None:
  """Until process 0 has logged `step` (or a later one)."""
  metrics = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + timeout
  while not (metrics.exists() and any(
      json.loads(line).get('step', 0) >= step
      for line in metrics.read_text().splitlines() if line.endswith('}'))):
    failed = [i for i, p in enumerate(processes) if p.poll() is not None]
    assert not failed, f'process {failed} ended before step {step}:\n' + (
        '\n'.join(logs[i].read_text()[-3000:] for i in failed))
    assert time.monotonic() < deadline, f'no step {step} within the time limit'
    time.sleep(0.02)


def kill_one_and_time_the_others(workdir, processes, logs, step: int,
                                 victim: int, timeout: float):
  """SIGKILLs process `victim` once process 0 logged `step`; returns the
  seconds each other process took to exit."""
  wait_for_step(workdir, processes, logs, step, RUN_TIMEOUT)
  processes[victim].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  seconds = {}
  while len(seconds) < len(processes) - 1:
    for i, process in enumerate(processes):
      if i != victim and i not in seconds and process.poll() is not None:
        seconds[i] = time.monotonic() - killed
    assert time.monotonic() - killed < timeout, (
        f'still running after {timeout}s: '
        f'{[i for i in range(len(processes)) if i not in seconds]}\n'
        + logs[0].read_text()[-3000:])
    time.sleep(0.05)
  return seconds


HEARTBEAT = 10  # seconds, distributed.heartbeat_timeout of the kill tests


@pytest.mark.slow
@pytest.mark.parametrize('count', [2, 4])
def test_killing_one_process_ends_the_other_within_the_heartbeat_timeout(
    tmp_path, one_process, two_processes, count):
  """SIGKILL to a random worker at a random step: every other process exits
  non-zero within the heartbeat timeout, naming the dead one. With 2
  processes, the same command then resumes from the last checkpoint and
  reaches step 10 with the parameters of the uninterrupted run."""
  rng = np.random.default_rng()
  step, victim = int(rng.integers(3, 7)), int(rng.integers(1, count))
  workdir = tmp_path / 'run'
  # warmup_rsqrt does not depend on num_steps: the first 10 steps are those
  # of `two_processes`.
  command = [*TRAIN, '--workdir', str(workdir),
             '--config.train.num_steps=100000', *QUICK,
             '--config.checkpoint.every=2', *shared_tokenizer(one_process),
             f'--config.distributed.heartbeat_timeout={HEARTBEAT}']
  processes, logs = run_processes(command, tmp_path, count, 4 // count)
  try:
    seconds = kill_one_and_time_the_others(workdir, processes, logs, step,
                                           victim, HEARTBEAT + 60)
  finally:
    end_all(processes)
  print(f'{count} processes, process {victim} killed after step {step}: the '
        f'others exited after {seconds} s')
  for i, log in enumerate(logs):
    if i == victim:
      continue
    output = log.read_text()
    assert processes[i].returncode != 0, output[-3000:]
    assert seconds[i] < HEARTBEAT + 30, output[-3000:]
    # When the runtime sees the death at once (a dropped connection), its
    # own fatal log ends the others within a second, before any beat is
    # missed; else they wait for the heartbeat and name the dead one.
    if seconds[i] > 0.4 * HEARTBEAT + 2:
      # The victim is named; a process that its death took down first (a
      # collective failing under a checkpoint write) may be named with it.
      named = re.search(rf'jaxformer: process ([\d, ]+) of {count} stopped '
                        'responding', output)
      assert named and str(victim) in named.group(1).split(', '), (
          output[-3000:])
  if count != 2:
    return
  # A kill soon after step 2 may come before its save committed (Orbax
  # renames a step's folder to its number when it commits): then the
  # command starts again from step 0.
  saved = max((int(p.name) for p in (workdir / 'checkpoints').iterdir()
               if p.name.isdigit()), default=0)
  assert saved < 10  # The save of a later step may not have committed.
  output = train(workdir, 2, 2, 10, *shared_tokenizer(one_process))
  if saved:
    assert f'Resuming from the checkpoint of step {saved}' in output
  else:
    assert 'Resuming' not in output, output[-3000:]
  resumed, uninterrupted = train_losses(workdir), train_losses(two_processes)
  for s in range(saved + 1, 11):
    assert resumed[s] == uninterrupted[s], s
  from jaxformer.checkpoints import trained as trained_lib
  for a, b in zip(
      jax.tree.leaves(trained_lib.load(str(workdir), 10).params),
      jax.tree.leaves(trained_lib.load(str(two_processes), 10).params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
@pytest.mark.parametrize('count', [1, 2])
def test_sigterm_to_one_process_stops_all_at_the_same_saved_step(tmp_path,
                                                                 count):
  """A preemption notice reaches one process; JAX's preemption service picks
  a step at which all save and exit 0, with no step logged between. With
  one process the runtime is up too (as on a single-host TPU VM), so
  SIGTERM is JAX's, not the Python handler's."""
  workdir = tmp_path / 'run'
  command = [*TRAIN, '--workdir', str(workdir),
             '--config.train.num_steps=100000', *QUICK,
             '--config.train.log_every=1000',
             '--config.checkpoint.every=100000']
  processes, logs = run_processes(command, tmp_path, count)
  try:
    deadline = time.monotonic() + RUN_TIMEOUT
    while 'Training steps' not in logs[0].read_text():
      assert all(p.poll() is None for p in processes), logs[0].read_text()
      assert time.monotonic() < deadline, 'training did not start'
      time.sleep(0.1)
    time.sleep(5)
    processes[-1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=300) for p in processes]
  finally:
    end_all(processes)
  output = logs[0].read_text()
  assert codes == [0] * count, output[-3000:] + logs[-1].read_text()[-3000:]
  assert f'as process 0 of {count}' in output
  marker = 'Preemption notice (SIGTERM) received: saved the checkpoint of step '
  assert marker in output, output[-3000:]
  step = int(output.split(marker)[1].split()[0])
  saved = sorted(int(p.name) for p in (workdir / 'checkpoints').iterdir()
                 if p.name.isdigit())
  assert saved == [step]
  assert [r['step'] for r in read_metrics(workdir)] == [step]


def link_view(source: pathlib.Path, view: pathlib.Path) -> None:
  """`view`: a directory whose entries are symbolic links to those of
  `source` (files written into `source` later show through the links)."""
  view.mkdir()
  for entry in source.iterdir():
    (view / entry.name).symlink_to(entry)


@pytest.mark.slow
def test_hosts_restore_the_newest_step_that_every_host_can_read(
    tmp_path, one_process, two_processes):
  """Process 1 sees the run through another view of the storage, in which
  step 10 is a damaged copy (as a host's stale or corrupted cache would
  show it); process 0 reads step 10 intact. Both resume from step 5, and
  process 0 alone moves step 10 aside, after both agreed."""
  shared = shutil.copytree(two_processes, tmp_path / 'shared')
  view = tmp_path / 'view_of_process_1'
  (shared / peers.PROBE).write_text('')  # Process 0 rewrites it.
  link_view(shared, view)
  (view / 'checkpoints').unlink()
  link_view(shared / 'checkpoints', view / 'checkpoints')
  (view / 'checkpoints' / '10').unlink()
  damaged = shutil.copytree(shared / 'checkpoints' / '10',
                            view / 'checkpoints' / '10')
  manifest = damaged / 'state' / 'manifest.ocdbt'
  os.truncate(manifest, manifest.stat().st_size // 2)
  command = [*TRAIN, *QUICK, '--config.train.num_steps=5',
             *shared_tokenizer(one_process)]
  processes, logs = run_processes(
      [[*command, '--workdir', str(workdir)] for workdir in (shared, view)],
      tmp_path, 2)
  try:
    codes = [p.wait(timeout=RUN_TIMEOUT) for p in processes]
  finally:
    end_all(processes)
  first, second = (log.read_text() for log in logs)
  assert codes == [0, 0], first[-3000:] + second[-3000:]
  assert (f'{damaged} cannot be restored' in second
          and 'trying the one before' in second), second[-3000:]
  assert ('10 cannot be restored (process 1 cannot read it' in first
          and 'Resuming from the checkpoint of step 5' in first), first[-3000:]
  moved, kept = sorted(os.listdir(shared / 'checkpoints'))
  assert moved.startswith('10.damaged-') and kept == '5'
  assert sorted(os.listdir(view / 'checkpoints')) == ['10', '5']


@pytest.mark.slow
def test_hosts_with_different_workdirs_fail_in_seconds_naming_it(tmp_path):
  """Before this check, process 1 waited up to an hour for a tokenizer that
  process 0 wrote elsewhere."""
  workdirs = [tmp_path / 'host0', tmp_path / 'host1']
  processes, logs = run_processes(
      [[*TRAIN, *QUICK, '--workdir', str(w)] for w in workdirs], tmp_path, 2)
  try:
    joined = None
    while joined is None or any(p.poll() is None for p in processes):
      if joined is None and all('joining the distributed runtime' in
                                log.read_text() for log in logs):
        joined = time.monotonic()
      assert joined is None or time.monotonic() - joined < 60, (
          'still running 60 s after joining')
      assert all(p.poll() is None for p in processes) or joined, (
          logs[0].read_text())
      time.sleep(0.1)
    seconds = time.monotonic() - joined
  finally:
    end_all(processes)
  for process, log in zip(processes, logs):
    output = log.read_text()
    assert process.returncode != 0, output[-3000:]
    line = f'jaxformer train: error: The workdir {workdirs[1]} must be shared'
    if log == logs[0]:
      line = line.replace('host1', 'host0')
    assert line in output, output[-3000:]
    assert ('process 1 does not see the probe file process 0 wrote there'
            in output), output[-3000:]
  print(f'both processes exited {seconds:.1f} s after joining the runtime')
