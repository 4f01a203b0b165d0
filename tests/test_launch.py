"""The launchers in launch/, run against fake `gcloud`, `sbatch`, `srun`,
`scontrol` and `jaxformer` programs that record how they were called."""
import json
import os
import pathlib
import shlex
import subprocess
import sys
import tarfile
import textwrap

import pytest

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

GCLOUD = '''
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
elif verb == 'ssh' and 'jaxformer train' in sys.argv[-2]:
  sys.exit(take('run_codes', 0))
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
# One write per line: under PYTHONUNBUFFERED, print() writes each piece
# separately and the concurrent processes' pieces would interleave.
sys.stdout.write(f"hello from {os.environ['JAX_PROCESS_ID']}\\n")
sys.stdout.flush()
sys.exit(int(os.environ.get('FAKE_FAIL_' + os.environ['JAX_PROCESS_ID'], 0)))
'''


@pytest.fixture
def fakes(tmp_path):
  """A PATH with the fake programs first; returns (env, calls())."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  behaviours = {'gcloud': GCLOUD, 'sbatch': '', 'srun': SRUN,
                'scontrol': SCONTROL, 'jaxformer': JAXFORMER}
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
             FAKE_SCRIPT=str(script), TMPDIR=str(tmp_path))

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


def test_tpu_vm_creates_installs_runs_on_all_workers_and_deletes(fakes):
  env, calls, _ = fakes
  run([*TPU, '--', *TRAIN], env)
  create, scp, install, train, delete = [c['argv'] for c in calls()]
  assert create == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'tpu1',
                    '--accelerator-type=v4-16',
                    '--version=tpu-ubuntu2204-base', '--spot',
                    '--zone=us-central2-b']
  assert scp[4] == 'scp' and scp[6] == 'tpu1:jaxformer.tar.gz'
  with tarfile.open(scp[5]) as tar:
    assert {'pyproject.toml', 'jaxformer/parallel.py',
            'configs/quickstart.py'} <= set(tar.getnames())
  assert '--worker=all' in scp and '--worker=all' in install
  assert 'pip install' in install[-2] and "'jax[tpu]'" in install[-2]
  assert train[4:7] == ['ssh', 'tpu1', '--worker=all']
  assert train[7].endswith('cd ~/jaxformer && ' + shlex.join(TRAIN))
  assert delete[4:7] == ['delete', 'tpu1', '--quiet']


def test_tpu_vm_dry_run_prints_the_commands_and_runs_none(fakes):
  env, calls, _ = fakes
  result = run([*TPU, '--dry-run', '--', *TRAIN], env)
  printed = [line[2:] for line in result.stdout.splitlines()
             if line.startswith('+ ')]
  assert [shlex.split(line)[4] for line in printed] == [
      'create', 'scp', 'ssh', 'ssh', 'delete']
  assert shlex.join(TRAIN) in printed[3]
  assert calls() == []


def test_tpu_vm_recreates_and_resumes_after_a_preemption(fakes):
  env, calls, script = fakes
  script.write_text(json.dumps({'run_codes': [255, 0],
                                'states': ['PREEMPTED']}))
  result = run([*TPU, '--restart-on-preemption', '--', *TRAIN], env)
  assert gcloud_verbs(calls) == [
      'create', 'scp', 'ssh', 'ssh', 'describe', 'delete',
      'create', 'scp', 'ssh', 'ssh', 'delete']
  assert 'preempted' in result.stdout


def test_tpu_vm_reports_a_failure_that_is_not_a_preemption(fakes):
  env, calls, script = fakes
  script.write_text(json.dumps({'run_codes': [3], 'states': ['READY']}))
  result = run([*TPU, '--restart-on-preemption', '--', *TRAIN], env,
               check=False)
  assert result.returncode == 3
  assert gcloud_verbs(calls) == ['create', 'scp', 'ssh', 'ssh', 'describe',
                                 'delete']


def test_tpu_vm_restarts_need_a_bucket_workdir(fakes):
  env, calls, _ = fakes
  local = [*TRAIN[:-1], 'runs/local']
  result = run([*TPU, '--restart-on-preemption', '--', *local], env,
               check=False)
  assert result.returncode == 2
  assert 'gs://' in result.stderr and "'runs/local'" in result.stderr
  assert calls() == []


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
      {'JAX_COORDINATOR_ADDRESS': '127.0.0.1:4321', 'JAX_NUM_PROCESSES': '3',
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
  assert [c[:4] for c in commands] == [
      ['env', 'JAX_COORDINATOR_ADDRESS=127.0.0.1:5555', 'JAX_NUM_PROCESSES=2',
       f'JAX_PROCESS_ID={i}'] for i in range(2)]
  assert all(c[-len(TRAIN):] == TRAIN for c in commands)
  assert calls() == []
