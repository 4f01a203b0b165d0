"""The launchers in launch/, run against fake `gcloud`, `kubectl`, `sbatch`,
`srun`, `scontrol` and `jaxformer` programs that record how they were
called (the fake gcloud runs ssh commands here, one $HOME per worker)."""
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import textwrap

import pytest
import yaml

from jaxformer.config import settings as config_lib
from jaxformer.parallel import cluster
from jaxformer.parallel import mesh as mesh_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = REPO / 'launch'
TRAIN = ['jaxformer', 'train', '--config', 'configs/quickstart.py',
         '--workdir', 'gs://bucket/run']

# Each fake appends {"argv": [...], "env": {JAX_*, XLA_FLAGS}} to $FAKE_LOG,
# then behaves as its entry in $FAKE_SCRIPT says (a JSON object of lists).
FAKE = textwrap.dedent('''\
    #!{python}
    import json, os, sys
    name = os.path.basename(sys.argv[0])
    env = {{k: v for k, v in os.environ.items()
            if k.startswith(('JAX_', 'XLA_FLAGS'))}}
    with open(os.environ['FAKE_LOG'], 'a') as log:
      log.write(json.dumps({{'argv': [name] + sys.argv[1:], 'env': env}}) + '\\n')
    {behaviour}
    ''')

# ssh runs the command here, once per worker with its own $HOME under
# $FAKE_WORKERS_DIR, in a session of its own that is hung up (SIGHUP, then
# SIGKILL to its process group) when the command ends or the connection
# "drops" ($FAKE_SCRIPT's '<kind>_drop_after' seconds); '<kind>_codes' make
# a call fail before it reaches the workers. pip installs are only recorded.
GCLOUD = '''
import signal, subprocess, time
def take(key, default):
  path = os.environ['FAKE_SCRIPT']
  script = json.load(open(path))
  values = script.get(key) or [default]
  script[key] = values[1:]
  json.dump(script, open(path, 'w'))
  return values[0]
verb = sys.argv[4]
if verb == 'describe':
  print(take('states', 'READY'))
elif verb == 'scp':  # To every worker's $HOME; and the source folder's mode.
  import shutil
  source, target = sys.argv[5], sys.argv[6].split(':', 1)[1]
  for index in range(int(os.environ['FAKE_WORKERS'])):
    home = os.path.join(os.environ['FAKE_WORKERS_DIR'], f'worker{index}')
    os.makedirs(home, exist_ok=True)
    shutil.copy(source, os.path.join(home, target))
  with open(os.environ['FAKE_LOG'] + '.scp', 'a') as modes:
    modes.write(oct(os.stat(os.path.dirname(source)).st_mode & 0o777) + '\\n')
elif verb == 'ssh':
  command = next(a for a in sys.argv if a.startswith('--command='))[10:]
  if 'pip install' in command:
    sys.exit(0)
  kind = ('tail' if command.startswith('tail') else
          'status' if 'jaxformer-status' in command else 'start')
  code = take(kind + '_codes', 0)
  if code:
    sys.exit(code)
  seconds = take(kind + '_drop_after', None)
  worker = next(a for a in sys.argv if a.startswith('--worker='))[9:]
  workers = range(int(os.environ['FAKE_WORKERS'])) if worker == 'all' else [
      int(worker)]
  # SIGTERM to every worker's run once it has started (said hello: its
  # handler is set).
  if take(kind + '_shut_down', False):
    for index in range(int(os.environ['FAKE_WORKERS'])):
      run_dir = os.path.join(os.environ['FAKE_WORKERS_DIR'], f'worker{index}',
                             'jaxformer-run')
      log = os.path.join(run_dir, 'train.log')
      deadline = time.monotonic() + 30
      while time.monotonic() < deadline and 'hello from' not in (
          open(log).read() if os.path.exists(log) else ''):
        time.sleep(0.05)
      os.killpg(int(open(os.path.join(run_dir, 'pid')).read()), signal.SIGTERM)
    time.sleep(1)
  for index in workers:
    home = os.path.join(os.environ['FAKE_WORKERS_DIR'], f'worker{index}')
    os.makedirs(os.path.join(home, 'jaxformer'), exist_ok=True)
    session = subprocess.Popen(['bash', '-c', command], start_new_session=True,
                               env=dict(os.environ, HOME=home,
                                        JAX_PROCESS_ID=str(index)))
    try:
      code = session.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
      code = 255
    for hang_up in (signal.SIGHUP, signal.SIGKILL):
      try:
        os.killpg(session.pid, hang_up)
      except ProcessLookupError:
        pass
    session.wait()
  sys.exit(code)
'''

KUBECTL = '''
with open(os.environ['FAKE_LOG'] + '.stdin', 'w') as manifest:
  manifest.write(sys.stdin.read())
'''

SCONTROL = '''
print('gpu-a01\\ngpu-a02')
'''

# Runs the command after srun's options once per task, as slurmd would.
SRUN = '''
import subprocess
options = {}
rest = sys.argv[1:]
while rest[0].startswith('--'):
  key, _, value = rest.pop(0)[2:].partition('=')
  options[key] = value
per_node = int(options['ntasks-per-node'])
for task in range(int(options['ntasks'])):
  subprocess.run(rest, check=True, env=dict(
      os.environ, SLURM_PROCID=str(task), SLURM_LOCALID=str(task % per_node)))
'''

JAXFORMER = '''
import signal, time
# As jaxformer train: a SIGTERM saves a checkpoint and exits 0.
def stop(signum, frame):
  sys.stdout.write('saved\\n')
  sys.exit(0)
signal.signal(signal.SIGTERM, stop)
# One write per line: under PYTHONUNBUFFERED, print() writes each piece
# separately and the concurrent processes' pieces would interleave.
sys.stdout.write(f"hello from {os.environ['JAX_PROCESS_ID']}\\n")
sys.stdout.flush()
time.sleep(float(os.environ.get('FAKE_TRAIN_SECONDS', 0)))
sys.stdout.write(f"done {os.environ['JAX_PROCESS_ID']}\\n")
sys.stdout.flush()
sys.exit(int(os.environ.get('FAKE_FAIL_' + os.environ['JAX_PROCESS_ID'], 0)))
'''


@pytest.fixture
def fakes(tmp_path):
  """A PATH with the fake programs first; returns (env, calls())."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  behaviours = {'gcloud': GCLOUD, 'sbatch': '', 'srun': SRUN,
                'scontrol': SCONTROL, 'jaxformer': JAXFORMER,
                'kubectl': KUBECTL}
  for name, behaviour in behaviours.items():
    path = bin_dir / name
    path.write_text(FAKE.format(python=sys.executable,
                                behaviour=textwrap.dedent(behaviour)))
    path.chmod(0o755)
  log, script = tmp_path / 'calls.jsonl', tmp_path / 'script.json'
  script.write_text('{}')
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(('SLURM_', 'JAX_', 'XLA_FLAGS'))}
  env.update(PATH=f'{bin_dir}{os.pathsep}{env["PATH"]}', FAKE_LOG=str(log),
             FAKE_SCRIPT=str(script), TMPDIR=str(tmp_path), FAKE_WORKERS='2',
             FAKE_WORKERS_DIR=str(tmp_path / 'workers'))

  def calls():
    if not log.exists():
      return []
    return [json.loads(line) for line in log.read_text().splitlines()]
  return env, calls, script


def run(command, env, check=True):
  result = subprocess.run([str(c) for c in command], env=env,
                          capture_output=True, text=True, timeout=60)
  if check:
    assert result.returncode == 0, result.stdout + result.stderr
  return result


# ------------------------------------------------------------------ TPU VMs

TPU = [sys.executable, LAUNCH / 'tpu_vm.py', '--name', 'tpu1', '--zone',
       'us-central2-b', '--accelerator-type', 'v4-16', '--runtime-version',
       'tpu-ubuntu2204-base', '--spot']


def gcloud_verbs(calls):
  return [c['argv'][4] for c in calls() if c['argv'][0] == 'gcloud']


def ssh_kinds(calls):
  """What each gcloud ssh call did: install, start, tail or status."""
  kinds = []
  for call in calls():
    if call['argv'][:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh']:
      command = call['argv'][7]
      kinds.append('install' if 'pip install' in command else
                   'tail' if command.startswith('--command=tail') else
                   'status' if 'jaxformer-status' in command else 'start')
  return kinds


def worker_files(env, name):
  workers = pathlib.Path(env['FAKE_WORKERS_DIR'])
  return [(workers / f'worker{i}' / 'jaxformer-run' / name).read_text()
          for i in range(int(env['FAKE_WORKERS']))]


FOLLOW = ['--poll-seconds', '0.1']


def shipped(env, worker=0) -> list[str]:
  """The names in the archive that scp copied to a worker."""
  archive = pathlib.Path(env['FAKE_WORKERS_DIR']) / f'worker{worker}'
  with tarfile.open(archive / 'jaxformer.tar.gz') as tar:
    return tar.getnames()


@pytest.mark.slow
def test_tpu_vm_creates_installs_starts_detached_follows_and_deletes(fakes):
  env, calls, _ = fakes
  result = run([*TPU, *FOLLOW, '--', *TRAIN], dict(env, FAKE_TRAIN_SECONDS='1'))
  create, scp, install, start, *follow, delete = [c['argv'] for c in calls()
                                                  if c['argv'][0] == 'gcloud']
  assert create == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'tpu1',
                    '--accelerator-type=v4-16',
                    '--version=tpu-ubuntu2204-base', '--spot',
                    '--zone=us-central2-b']
  assert scp[4] == 'scp' and scp[6] == 'tpu1:jaxformer.tar.gz'
  assert {'pyproject.toml', 'jaxformer/parallel/mesh.py',
          'configs/quickstart.py'} <= set(shipped(env))
  assert '--worker=all' in scp and '--worker=all' in install
  # The workers get the jax (and through jax[tpu], the libtpu) tested here,
  # and every other package at the version of launch/constraints.txt.
  pinned = f"'jax[tpu]=={importlib.metadata.version('jax')}'"
  assert 'pip install' in install[-2] and pinned in install[-2]
  assert ' -U ' not in install[-2]
  assert ' -c ~/jaxformer/launch/constraints.txt ' in install[-2]
  assert 'launch/constraints.txt' in shipped(env)
  assert start[4:7] == ['ssh', 'tpu1', '--worker=all']
  assert 'nohup setsid bash -c' in start[7]
  assert 'cd ~/jaxformer && ' + shlex.join(TRAIN) in shlex.split(
      start[7].split('bash -c ', 1)[1])[0]
  assert {tuple(c[4:7]) for c in follow} == {
      ('ssh', 'tpu1', '--worker=0'), ('ssh', 'tpu1', '--worker=all')}
  assert delete[4:7] == ['delete', 'tpu1', '--quiet']
  # Worker 0's log came through once; every worker ran the command.
  assert result.stdout.count('hello from 0\n') == 1
  assert result.stdout.count('done 0\n') == 1
  assert worker_files(env, 'train.log') == [f'hello from {i}\ndone {i}\n'
                                            for i in range(2)]
  assert worker_files(env, 'exit_code') == ['0\n', '0\n']


@pytest.mark.slow
def test_tpu_vm_ships_a_fresh_private_archive_never_a_planted_one(fakes):
  """An archive left (or planted by another user) in the shared temporary
  folder is not what the workers install: each launch builds its own in a
  folder only its user can enter, and removes it at exit."""
  env, calls, _ = fakes
  planted = pathlib.Path(env['TMPDIR']) / 'jaxformer-tpu1.tar.gz'
  with tarfile.open(planted, 'w:gz') as tar:
    tar.add(__file__, arcname='planted.py')
  run([*TPU, *FOLLOW, '--', *TRAIN], env)
  (scp,) = [c['argv'] for c in calls() if c['argv'][4:5] == ['scp']]
  assert scp[5] != str(planted)
  names = shipped(env)
  assert 'planted.py' not in names and 'jaxformer/parallel/mesh.py' in names
  assert pathlib.Path(env['FAKE_LOG'] + '.scp').read_text() == '0o700\n'
  assert not pathlib.Path(scp[5]).parent.exists()
  assert list(pathlib.Path(env['TMPDIR']).glob('jaxformer-launch-*')) == []


@pytest.mark.parametrize('name', ['Tpu1', '1tpu', 'tpu_1', 'tpu-', 'a' * 64,
                                  '../tpu', ''])
def test_tpu_vm_names_follow_the_cloud_rules(fakes, name):
  env, calls, _ = fakes
  result = run([*TPU[:3], name, *TPU[4:], '--dry-run', '--', *TRAIN], env,
               check=False)
  assert result.returncode == 2
  assert f'--name {name!r}' in result.stderr and 'lower-case' in result.stderr
  assert calls() == []


@pytest.mark.slow
def test_tpu_vm_training_outlives_dropped_connections(fakes):
  env, calls, script = fakes
  # The log stream drops mid-run and the next poll cannot reach the VM.
  script.write_text(json.dumps({'tail_drop_after': [0.5],
                                'status_codes': [255]}))
  result = run([*TPU, *FOLLOW, '--', *TRAIN], dict(env, FAKE_TRAIN_SECONDS='2'))
  kinds = ssh_kinds(calls)
  assert kinds[:4] == ['install', 'start', 'tail', 'status']
  assert kinds.count('tail') >= 2
  assert 'describe' in gcloud_verbs(calls)  # The failed poll: preempted?
  # Training went on; the log resumed where the dropped stream stopped.
  assert result.stdout.count('hello from 0\n') == 1
  assert result.stdout.count('done 0\n') == 1
  assert worker_files(env, 'exit_code') == ['0\n', '0\n']


@pytest.mark.slow
def test_tpu_vm_can_stop_following_and_attach_again(fakes):
  env, calls, script = fakes
  env = dict(env, FAKE_TRAIN_SECONDS='2')
  script.write_text(json.dumps({'status_codes': [255, 255]}))
  left = run([*TPU, *FOLLOW, '--max-poll-failures', '2', '--', *TRAIN], env,
             check=False)
  assert left.returncode == 1
  assert '--attach' in left.stderr and 'goes on' in left.stderr
  assert 'delete' not in gcloud_verbs(calls)
  before = len(calls())
  attached = run([*TPU, *FOLLOW, '--attach', '--', *TRAIN], env)
  verbs = [c['argv'][4] for c in calls()[before:]]
  assert 'create' not in verbs and 'scp' not in verbs
  assert ssh_kinds(lambda: calls()[before:])[0] == 'tail'
  assert verbs[-1] == 'delete'
  assert 'hello from 0\ndone 0\n' in attached.stdout
  assert worker_files(env, 'exit_code') == ['0\n', '0\n']


def test_tpu_vm_combines_the_workers_states():
  tpu_vm = load_launcher('tpu_vm')
  output = ('Using ssh batch size of 1.\n[worker 0] jaxformer-status exited 0\n'
            'jaxformer-status  running\n')
  assert tpu_vm.worker_states(output) == ['exited 0', 'running']
  assert tpu_vm.exit_status(['exited 0', 'running']) is None
  assert tpu_vm.exit_status(['exited 0', 'exited 3']) == 3
  assert tpu_vm.exit_status(['exited 0', 'lost']) == tpu_vm.LOST == 255
  assert tpu_vm.exit_status(['exited 0 terminated', 'exited 0']) == 143
  assert tpu_vm.worker_states('ssh: connect to host: timed out') == []


def test_tpu_vm_dry_run_prints_the_commands_and_runs_none(fakes):
  env, calls, _ = fakes
  result = run([*TPU, '--dry-run', '--', *TRAIN], env)
  printed = [line[2:] for line in result.stdout.splitlines()
             if line.startswith('+ ')]
  assert [shlex.split(line)[4] for line in printed] == [
      'create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh', 'delete']
  assert shlex.join(TRAIN) in printed[3]
  assert calls() == []


@pytest.mark.slow
def test_tpu_vm_recreates_and_resumes_after_a_preemption(fakes):
  env, calls, script = fakes
  # The VM vanishes under the first run: polls fail, its state is PREEMPTED.
  script.write_text(json.dumps({'status_codes': [255],
                                'states': ['PREEMPTED', 'PREEMPTED']}))
  result = run([*TPU, *FOLLOW, '--restart-on-preemption', '--', *TRAIN], env)
  assert gcloud_verbs(calls) == [
      'create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh', 'describe', 'describe',
      'delete', 'create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh', 'delete']
  assert 'preempted' in result.stdout


@pytest.mark.slow
def test_tpu_vm_restarts_a_run_stopped_cleanly_by_a_preemption(fakes):
  env, calls, script = fakes
  # The preemption's shutdown sends SIGTERM: training saves and exits 0.
  script.write_text(json.dumps({'tail_shut_down': [True],
                                'states': ['PREEMPTED']}))
  result = run([*TPU, *FOLLOW, '--restart-on-preemption', '--', *TRAIN],
               dict(env, FAKE_TRAIN_SECONDS='3'))
  assert 'saved' in result.stdout and 'preempted' in result.stdout
  assert gcloud_verbs(calls) == [
      'create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh', 'describe', 'delete',
      'create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh', 'delete']


def test_tpu_vm_reports_a_failure_that_is_not_a_preemption(fakes):
  env, calls, _ = fakes
  result = run([*TPU, *FOLLOW, '--restart-on-preemption', '--', *TRAIN],
               dict(env, FAKE_FAIL_1='3'), check=False)
  assert result.returncode == 3
  assert worker_files(env, 'exit_code') == ['0\n', '3\n']
  assert gcloud_verbs(calls) == ['create', 'scp', 'ssh', 'ssh', 'ssh', 'ssh',
                                 'describe', 'delete']


def test_tpu_vm_restarts_need_a_bucket_workdir(fakes):
  env, calls, _ = fakes
  local = [*TRAIN[:-1], 'runs/local']
  result = run([*TPU, '--restart-on-preemption', '--', *local], env,
               check=False)
  assert result.returncode == 2
  assert 'gs://' in result.stderr and "'runs/local'" in result.stderr
  assert calls() == []


def load_launcher(name: str):
  spec = importlib.util.spec_from_file_location(name, LAUNCH / f'{name}.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_worker_installs_are_pinned_to_the_tested_environment(fakes, tmp_path):
  """launch/constraints.py writes every package of jaxformer's dependency
  closure (and jax[tpu]'s) at its version here; the committed file pins the
  same packages, and the jax that --jax-version defaults to."""
  pytest.importorskip('libtpu')  # jax[tpu] needs it.
  generator, tpu_vm = load_launcher('constraints'), load_launcher('tpu_vm')
  written = tmp_path / 'constraints.txt'
  run([sys.executable, LAUNCH / 'constraints.py', '--output', written], fakes[0])
  pins = tpu_vm.pinned_versions(str(written))
  for name in ('jax', 'jaxlib', 'flax', 'orbax-checkpoint', 'numpy',
               'sentencepiece', 'protobuf', 'libtpu'):
    assert pins[name] == importlib.metadata.version(name), name
  direct = [r.name.lower() for r in generator.roots(REPO / 'pyproject.toml')
            if generator.applies(r, frozenset())]
  committed = tpu_vm.pinned_versions(str(LAUNCH / 'constraints.txt'))
  assert set(direct) <= set(committed) and 'jaxlib' in committed
  assert tpu_vm.parse_args(['--name', 'a', '--zone', 'z', '--accelerator-type',
                            'v4-8', '--runtime-version', 'r', '--',
                            *TRAIN]).jax_version == committed['jax']
  other = run([*TPU, '--jax-version', '0.0.1', '--dry-run', '--', *TRAIN],
              fakes[0], check=False)
  assert other.returncode == 2 and 'launch/constraints.py' in other.stderr


# ---------------------------------------------------------------- GKE JobSet

DIGEST = 'sha256:' + '0123456789abcdef' * 4
GKE = [sys.executable, LAUNCH / 'gke_jobset.py', '--name', 'run', '--image',
       f'jaxformer@{DIGEST}']


def jobset(text):
  """The pod count and pod spec of a JobSet manifest (YAML or JSON)."""
  document = yaml.safe_load(text)
  assert (document['apiVersion'], document['kind']) == (
      'jobset.x-k8s.io/v1alpha2', 'JobSet')
  (workers,) = document['spec']['replicatedJobs']
  job = workers['template']['spec']
  assert job['parallelism'] == job['completions']
  assert job['completionMode'] == 'Indexed'
  return job['parallelism'], job['template']['spec']


@pytest.mark.parametrize('accelerator_type, topology_name', [
    ('v5litepod-16', 'v5e-16'), ('v5p-64', 'v5p-64'), ('v4-16', 'v4-16')])
def test_gke_tpu_jobset_has_one_pod_per_host_of_the_slice(
    fakes, accelerator_type, topology_name):
  pytest.importorskip('libtpu')
  from jaxformer.aot import topology as topology_lib
  env, calls, _ = fakes
  result = run([*GKE, '--accelerator-type', accelerator_type, '--spot',
                '--dry-run', '--', *TRAIN], env)
  pods, spec = jobset(result.stdout)
  # The slice as libtpu lays it out: its hosts, chips and shape.
  topology = topology_lib.topology(topology_name)
  devices = topology_lib.topology_devices(topology)
  assert pods == len({d.process_index for d in devices})
  (container,) = spec['containers']
  chips = container['resources']['limits']['google.com/tpu']
  assert container['resources']['requests']['google.com/tpu'] == chips
  assert pods * chips == topology.chips == len(devices)
  assert spec['nodeSelector'] == {
      'cloud.google.com/gke-tpu-accelerator': {
          'v5e': 'tpu-v5-lite-podslice', 'v5p': 'tpu-v5p-slice',
          'v4': 'tpu-v4-podslice'}[topology.chip.kind],
      'cloud.google.com/gke-tpu-topology': topology.grid,
      'cloud.google.com/gke-spot': 'true'}
  assert container['command'] == TRAIN
  assert container['image'] == f'jaxformer@{DIGEST}'
  assert calls() == []


def test_gke_gpu_pods_find_their_coordinator_and_ids(fakes):
  env, calls, _ = fakes
  result = run([*GKE, '--gpu-type', 'nvidia-h100-80gb', '--nodes', '2',
                '--gpus-per-node', '8', '--output', 'json', '--', *TRAIN], env)
  (call,) = calls()
  assert call['argv'] == ['kubectl', 'apply', '-f', '-']
  applied = pathlib.Path(env['FAKE_LOG'] + '.stdin').read_text()
  assert '+ kubectl apply -f -' in result.stdout
  pods, spec = jobset(applied)
  (container,) = spec['containers']
  assert pods == 2 and container['resources']['limits'] == {
      'nvidia.com/gpu': 8}
  # Pod 1 as Kubernetes starts it: the manifest's variables and its index.
  pod_env = {e['name']: e['value'] for e in container['env']}
  pod_env.update(KUBERNETES_SERVICE_HOST='10.0.0.1', JOB_COMPLETION_INDEX='1')
  arguments = cluster.distributed_arguments(
      config_lib.default_config().distributed, pod_env)
  assert (arguments['coordinator_address'], arguments['num_processes'],
          arguments['process_id']) == ('run-workers-0-0.run:1234', 2, 1)


def test_gke_images_are_pinned_by_digest(fakes):
  """A tag can be moved to another image between two restarts of the
  JobSet: it works, with a warning; a digest is what the manifest holds."""
  env, calls, _ = fakes
  command = [*GKE, '--gpu-type', 'nvidia-h100-80gb', '--dry-run', '--',
             *TRAIN]
  pinned = run(command, env)
  assert jobset(pinned.stdout)[1]['containers'][0]['image'] == (
      f'jaxformer@{DIGEST}')
  assert 'warning' not in pinned.stderr
  tagged = run([*command[:5], 'us-docker.pkg.dev/p/r/jaxformer:v1',
                *command[6:]], env)
  assert 'warning: --image us-docker.pkg.dev/p/r/jaxformer:v1 is a tag' in (
      tagged.stderr)
  assert jobset(tagged.stdout)[1]['containers'][0]['image'] == (
      'us-docker.pkg.dev/p/r/jaxformer:v1')
  for bad in ('jaxformer@sha256:0123', 'jaxformer@md5:' + '0' * 64):
    wrong = run([*command[:5], bad, *command[6:]], env, check=False)
    assert wrong.returncode == 2 and f'--image {bad!r}' in wrong.stderr
  assert calls() == []


def test_gke_rejects_an_unknown_slice_in_one_line(fakes):
  env, calls, _ = fakes
  result = run([*GKE, '--accelerator-type', 'v5litepod-12', '--', *TRAIN], env,
               check=False)
  assert result.returncode == 2
  assert 'no v5e slice of 12 chips' in result.stderr
  assert 'v5e-16' in result.stderr and calls() == []


# -------------------------------------------------------------------- SLURM

SBATCH = LAUNCH / 'slurm.sbatch'
IN_JOB = {'SLURM_JOB_ID': '4242', 'SLURM_JOB_NODELIST': 'gpu-a[01-02]'}


def test_slurm_submits_itself_with_the_node_layout(fakes):
  env, calls, _ = fakes
  run([SBATCH, '--nodes', '2', '--gpus-per-node', '8', '--sbatch=--time=1:00:00',
       '--', *TRAIN], env)
  (call,) = calls()
  assert call['argv'] == ['sbatch', '--nodes=2', '--ntasks-per-node=1',
                          '--gpus-per-node=8', '--time=1:00:00', str(SBATCH),
                          '--nodes', '2', '--gpus-per-node', '8',
                          '--sbatch=--time=1:00:00', '--', *TRAIN]


def test_slurm_one_process_per_node_gets_all_its_gpus(fakes):
  env, calls, _ = fakes
  run([SBATCH, '--nodes', '2', '--gpus-per-node', '4', '--', *TRAIN],
      dict(env, **IN_JOB))
  srun, *tasks = [c for c in calls() if c['argv'][0] in ('srun', 'jaxformer')]
  assert srun['argv'][:5] == ['srun', '--nodes=2', '--ntasks=2',
                              '--ntasks-per-node=1', '--kill-on-bad-exit=1']
  assert [t['argv'][1:] for t in tasks] == [TRAIN[1:]] * 2
  assert [t['env'] for t in tasks] == [
      {'JAX_COORDINATOR_ADDRESS': 'gpu-a01:24242', 'JAX_NUM_PROCESSES': '2',
       'JAX_PROCESS_ID': str(i), 'JAX_LOCAL_DEVICE_IDS': '0,1,2,3'}
      for i in range(2)]


def test_slurm_one_process_per_gpu(fakes):
  env, calls, _ = fakes
  run([SBATCH, '--nodes', '2', '--gpus-per-node', '2', '--per-gpu', '--port',
       '3000', '--', *TRAIN], dict(env, **IN_JOB))
  tasks = [c['env'] for c in calls() if c['argv'][0] == 'jaxformer']
  assert [(t['JAX_PROCESS_ID'], t['JAX_LOCAL_DEVICE_IDS']) for t in tasks] == [
      ('0', '0'), ('1', '1'), ('2', '0'), ('3', '1')]
  assert {t['JAX_COORDINATOR_ADDRESS'] for t in tasks} == {'gpu-a01:3000'}
  assert {t['JAX_NUM_PROCESSES'] for t in tasks} == {'4'}


def test_slurm_dry_run_prints_and_runs_nothing(fakes):
  env, calls, _ = fakes
  outside = run([SBATCH, '--nodes', '2', '--dry-run', '--', *TRAIN], env)
  assert shlex.split(outside.stdout)[:4] == [
      'sbatch', '--nodes=2', '--ntasks-per-node=1', '--gpus-per-node=8']
  inside = run([SBATCH, '--nodes', '2', '--dry-run', '--', *TRAIN],
               dict(env, **IN_JOB))
  exports, launch = inside.stdout.splitlines()
  assert shlex.split(exports) == ['export', 'JAX_COORDINATOR_ADDRESS=gpu-a01:24242',
                                  'JAX_NUM_PROCESSES=2']
  assert shlex.split(launch)[0] == 'srun'
  assert shlex.split(launch)[-len(TRAIN):] == TRAIN
  assert [c['argv'][0] for c in calls()] == ['scontrol']


# -------------------------------------------------------------------- local


LOCAL = LAUNCH / 'local.sh'


def test_local_starts_each_process_with_its_id_and_fake_devices(fakes):
  env, calls, _ = fakes
  env = dict(env, XLA_FLAGS='--xla_dump_to=/tmp/x '
             '--xla_force_host_platform_device_count=8')
  result = run([LOCAL, '--processes', '3', '--devices', '2', '--port', '4321',
                '--', *TRAIN], env)
  tasks = sorted((c['env'] for c in calls()),
                 key=lambda e: e['JAX_PROCESS_ID'])
  assert tasks == [
      {'JAX_COORDINATOR_ADDRESS': '127.0.0.1:4321',
       'JAX_COORDINATOR_BIND_ADDRESS': '127.0.0.1:4321', 'JAX_NUM_PROCESSES': '3',
       'JAX_PROCESS_ID': str(i), 'JAX_PLATFORMS': 'cpu',
       'XLA_FLAGS': '--xla_dump_to=/tmp/x '
                    '--xla_force_host_platform_device_count=2'}
      for i in range(3)]
  # The processes write concurrently, so only the pieces are checked.
  for i in range(3):
    assert f'hello from {i}' in result.stdout
  assert '[p1] ' in result.stdout and '[p2] ' in result.stdout


def test_local_exits_with_the_status_of_a_failed_process(fakes):
  env, _, _ = fakes
  result = run([LOCAL, '--processes', '2', '--', *TRAIN],
               dict(env, FAKE_FAIL_1='7'), check=False)
  assert result.returncode == 7


def test_local_dry_run_prints_one_command_per_process(fakes):
  env, calls, _ = fakes
  result = run([LOCAL, '--processes', '2', '--port', '5555', '--dry-run', '--',
                *TRAIN], env)
  commands = [shlex.split(line) for line in result.stdout.splitlines()]
  assert [c[:5] for c in commands] == [
      ['env', 'JAX_COORDINATOR_ADDRESS=127.0.0.1:5555',
       'JAX_COORDINATOR_BIND_ADDRESS=127.0.0.1:5555', 'JAX_NUM_PROCESSES=2',
       f'JAX_PROCESS_ID={i}'] for i in range(2)]
  assert all(c[-len(TRAIN):] == TRAIN for c in commands)
  assert calls() == []


@pytest.mark.parametrize('flag, value', [
    ('--nodes', 'nodes[$(touch {marker})]'),
    ('--gpus-per-node', 'gpus_per_node[$(touch {marker})]'),
    ('--nodes', '0'), ('--port', 'port[$(touch {marker})]')])
def test_slurm_takes_counts_as_numbers_and_runs_no_command_in_them(
    fakes, tmp_path, flag, value):
  """Bash arithmetic on '$(...)' in a subscript runs it (even in --dry-run);
  counts and the port must be positive integers."""
  env, calls, _ = fakes
  marker = tmp_path / 'ran'
  for where in (env, dict(env, **IN_JOB)):
    result = run([SBATCH, flag, value.format(marker=marker), '--per-gpu',
                  '--dry-run', '--', *TRAIN], where, check=False)
    assert not marker.exists()
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'{flag} must be a positive integer' in result.stderr
  assert calls() == []
