#!/usr/bin/env python3
"""Trains on a Cloud TPU VM or pod slice with `gcloud`, start to finish.

  launch/tpu_vm.py --name my-tpu --zone us-central2-b --accelerator-type v4-16 \\
      --runtime-version tpu-ubuntu2204-base --spot --restart-on-preemption -- \\
      jaxformer train --config configs/quickstart.py --workdir gs://bucket/runs/q

Steps: create the VM; copy this checkout to every worker and install it (with
jax[tpu] pinned to the jax this checkout was tested with, and every other
package to launch/constraints.txt, the versions of the tested environment,
written by launch/constraints.py); start the command
on every worker at once, detached (each host is one JAX process; `jaxformer
train` finds the others through the TPU metadata); stream worker 0's log and
poll every worker until all have finished; delete the VM.

The command runs under `nohup setsid` with its output in
~/jaxformer-run/train.log on each worker, so a dropped ssh connection or a
closed laptop does not stop it: streaming and polling reconnect, and
`--attach` follows a run started earlier. With --restart-on-preemption a run
that ends because the VM was preempted is started again on a new VM and
resumes from the last checkpoint, so the workdir must be in a bucket (gs://).
--dry-run prints the gcloud commands instead of running them.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_PATHS = ('pyproject.toml', 'README.md', 'jaxformer', 'configs',
                 'launch/constraints.txt')
CONSTRAINTS = 'launch/constraints.txt'
PREEMPTED_STATES = ('PREEMPTED', 'TERMINATED')
REMOTE_DIR = '~/jaxformer'
REMOTE_TARBALL = 'jaxformer.tar.gz'
# The command's log, process id and exit status on each worker.
RUN_DIR = '$HOME/jaxformer-run'
LOG, PID, EXIT = f'{RUN_DIR}/train.log', f'{RUN_DIR}/pid', f'{RUN_DIR}/exit_code'
# Written when the worker was sent SIGTERM (a preemption's shutdown): then
# training saves and exits 0, which is not the end of the run.
TERMINATED = f'{RUN_DIR}/terminated'
STATUS_TAG = 'jaxformer-status'
LOST = 255  # A worker whose command vanished without an exit status.
STOPPED = 143  # A worker that exited 0 after a SIGTERM.
# The jax the test suite last passed with; `jax[tpu]==` pins jaxlib and
# libtpu to the versions jax was released with.
TESTED_JAX = '0.10.2'
# Google Cloud's resource names (RFC 1035 labels).
NAME = re.compile(r'[a-z]([-a-z0-9]{0,61}[a-z0-9])?')


def pinned_versions(path: str = os.path.join(REPO, CONSTRAINTS)
                    ) -> dict[str, str]:
  """{name: version} of a constraints file ({} when there is none)."""
  if not os.path.exists(path):
    return {}
  pins = {}
  with open(path) as file:
    for line in file:
      name, _, version = line.split('#', 1)[0].strip().partition('==')
      if name:
        pins[name.lower()] = version
  return pins


def tested_jax_version() -> str:
  """The jax of launch/constraints.txt (the one this checkout is tested
  with), else the one installed here, else TESTED_JAX."""
  from importlib import metadata
  try:
    return pinned_versions().get('jax') or metadata.version('jax')
  except metadata.PackageNotFoundError:
    return TESTED_JAX


def install_command(jax_version: str) -> str:
  return (f'mkdir -p {REMOTE_DIR} && tar -xzf ~/{REMOTE_TARBALL} '
          f'-C {REMOTE_DIR} && python3 -m pip install -q '
          f'-c {REMOTE_DIR}/{CONSTRAINTS} '
          f"'jax[tpu]=={jax_version}' -e {REMOTE_DIR}")


def parse_args(argv):
  parser = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--name', required=True, help='TPU VM name')
  parser.add_argument('--zone', required=True)
  parser.add_argument('--accelerator-type', required=True,
                      help='e.g. v4-8, v5litepod-16, v5p-64')
  parser.add_argument('--runtime-version', required=True,
                      help='TPU software version, e.g. tpu-ubuntu2204-base')
  parser.add_argument('--project', help='default: the gcloud configuration')
  capacity = parser.add_mutually_exclusive_group()
  capacity.add_argument('--spot', action='store_true')
  capacity.add_argument('--preemptible', action='store_true')
  parser.add_argument('--restart-on-preemption', action='store_true',
                      help='re-create the VM and resume after a preemption')
  parser.add_argument('--max-restarts', type=int, default=20)
  parser.add_argument('--no-copy', action='store_true',
                      help='the runtime image already has jaxformer installed')
  parser.add_argument('--jax-version', default=tested_jax_version(),
                      help='the jax[tpu] version installed on the workers '
                           '(default: the one tested, %(default)s)')
  parser.add_argument('--install',
                      help='shell command that installs the copied package on '
                           'each worker (default: pip install -c '
                           f"~/jaxformer/{CONSTRAINTS} "
                           "'jax[tpu]==JAX_VERSION' -e ~/jaxformer)")
  parser.add_argument('--attach', action='store_true',
                      help='follow a run started earlier on this VM (after '
                           'the launcher was stopped): no create, copy or '
                           'start')
  parser.add_argument('--poll-seconds', type=float, default=30.0,
                      help='how often to poll the workers for their status')
  parser.add_argument('--max-poll-failures', type=int, default=60,
                      help='give up following (training goes on) after this '
                           'many failed polls in a row of a VM that is not '
                           'preempted')
  parser.add_argument('--keep', action='store_true',
                      help='leave the VM running at the end')
  parser.add_argument('--dry-run', action='store_true',
                      help='print the gcloud commands, run nothing')
  parser.add_argument('command', nargs=argparse.REMAINDER,
                      help='after --: the command every worker runs')
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ['--'] else args.command
  if not NAME.fullmatch(args.name):
    parser.error(f'--name {args.name!r}: a TPU name is 1 to 63 lower-case '
                 'letters, digits and hyphens, starting with a letter and not '
                 'ending with a hyphen')
  if not (args.install or args.no_copy):
    pins = pinned_versions()
    if pins.get('jax') != args.jax_version:
      parser.error(
          f'{CONSTRAINTS} pins the versions the workers install, ' + (
              f'with jax=={pins["jax"]}, not --jax-version {args.jax_version}'
              if pins else 'and is missing') +
          ': run python launch/constraints.py in an environment with that '
          'jax where the tests pass, or give your own --install')
  args.install = args.install or install_command(args.jax_version)
  if not args.command:
    parser.error('give the command to run after --, e.g. -- jaxformer train '
                 '--config configs/quickstart.py --workdir gs://bucket/run')
  workdir = workdir_of(args.command)
  if args.restart_on_preemption and not (workdir or '').startswith('gs://'):
    parser.error(f'--restart-on-preemption resumes from checkpoints, which a '
                 f'preempted VM loses: pass a --workdir in a bucket '
                 f'(gs://...), not {workdir!r}.')
  if not (workdir or '').startswith('gs://'):
    print(f'tpu_vm.py: warning: --workdir {workdir} is not in a bucket; on a '
          'slice of several hosts each would keep its own checkpoints and '
          'tokenizer, which cannot work. Use gs://...', file=sys.stderr)
  return args


def workdir_of(command) -> str | None:
  for i, word in enumerate(command):
    if word == '--workdir' and i + 1 < len(command):
      return command[i + 1]
    if word.startswith('--workdir='):
      return word.split('=', 1)[1]
  return None


def tpu_vm(args, verb: str, *rest: str) -> list[str]:
  """A `gcloud compute tpus tpu-vm VERB` command for this VM."""
  command = ['gcloud', 'compute', 'tpus', 'tpu-vm', verb, *rest,
             f'--zone={args.zone}']
  if args.project:
    command.append(f'--project={args.project}')
  return command


def create_command(args) -> list[str]:
  capacity = ['--spot'] if args.spot else (
      ['--preemptible'] if args.preemptible else [])
  return tpu_vm(args, 'create', args.name,
                f'--accelerator-type={args.accelerator_type}',
                f'--version={args.runtime_version}', *capacity)


def on_all_workers(args, shell_command: str) -> list[str]:
  return tpu_vm(args, 'ssh', args.name, '--worker=all',
                f'--command={shell_command}')


def copy_commands(args, tarball: str) -> list[list[str]]:
  if args.no_copy:
    return []
  return [tpu_vm(args, 'scp', tarball, f'{args.name}:{REMOTE_TARBALL}',
                 '--worker=all'),
          on_all_workers(args, args.install)]


def on_worker_0(args, shell_command: str) -> list[str]:
  return tpu_vm(args, 'ssh', args.name, '--worker=0',
                f'--command={shell_command}')


def start_command(args) -> list[str]:
  """Starts the command on every worker in a session of its own (nohup
  setsid: an ssh hang-up does not reach it) and returns once it runs there
  (it writes its PID); its exit status goes to EXIT when it ends."""
  # pip installs scripts to ~/.local/bin, which ssh commands lack on PATH.
  job = (f'echo $$ > {PID}; trap "touch {TERMINATED}" TERM; '
         'export PATH="$HOME/.local/bin:$PATH"; ')
  if not args.no_copy:
    job += f'cd {REMOTE_DIR} && '
  job += (f'{shlex.join(args.command)}; echo $? > {EXIT}.tmp && '
          f'mv {EXIT}.tmp {EXIT}')
  return on_all_workers(
      args, f'mkdir -p {RUN_DIR} && rm -f {EXIT} {PID} {TERMINATED} && '
            f'{{ nohup setsid '
            f'bash -c {shlex.quote(job)} > {LOG} 2>&1 < /dev/null & }} && '
            f'for i in $(seq 300); do [ -s {PID} ] && break; sleep 0.1; done '
            f'&& [ -s {PID} ]')


def log_command(args, offset: int) -> list[str]:
  """Worker 0's log from byte `offset` on, following it until the command
  ends."""
  return on_worker_0(args, f'tail -c +{offset + 1} -f --pid="$(cat {PID})" '
                           f'{LOG}')


def status_command(args) -> list[str]:
  """Prints one STATUS_TAG line per worker: running, exited N, or lost (no
  process and no exit status)."""
  return on_all_workers(
      args, f'if [ -f {EXIT} ]; then echo "{STATUS_TAG} exited $(cat {EXIT})'
            f'$([ -f {TERMINATED} ] && echo " terminated")"; '
            f'elif kill -0 "$(cat {PID})" 2>/dev/null; then '
            f'echo "{STATUS_TAG} running"; else echo "{STATUS_TAG} lost"; fi')


def worker_states(output: str) -> list[str]:
  """'running', 'exited N' or 'lost' per worker, from status_command's
  output (gcloud may prefix the workers' lines)."""
  states = []
  for line in output.splitlines():
    if STATUS_TAG in line:
      states.append(' '.join(line.split(STATUS_TAG, 1)[1].split()))
  return states


def exit_status(states: list[str]) -> int | None:
  """The workers' combined exit status: None while one runs, LOST when one
  vanished without an exit status, STOPPED for a 0 after a SIGTERM, else
  the largest."""
  if 'running' in states:
    return None
  codes = []
  for state in states:
    words = state.split()
    code = int(words[1]) if words[0] == 'exited' and words[1:2] and words[
        1].isdigit() else LOST
    codes.append(STOPPED if code == 0 and 'terminated' in words else code)
  return max(codes)


def state_command(args) -> list[str]:
  return tpu_vm(args, 'describe', args.name, '--format=value(state)')


def delete_command(args) -> list[str]:
  return tpu_vm(args, 'delete', args.name, '--quiet')


def write_tarball(path: str) -> None:
  """This checkout's package sources, for `pip install` on the workers."""
  def skip(info):
    name = os.path.basename(info.name)
    return None if name == '__pycache__' or name.endswith('.pyc') else info
  with tarfile.open(path, 'w:gz') as tar:
    for relative in PACKAGE_PATHS:
      if os.path.exists(os.path.join(REPO, relative)):
        tar.add(os.path.join(REPO, relative), arcname=relative, filter=skip)


class Gcloud:
  """Runs (or, dry, prints) commands; output streams to this terminal."""

  def __init__(self, dry_run: bool):
    self.dry_run = dry_run

  def __call__(self, command, check: bool = True) -> int:
    print('+ ' + shlex.join(command), flush=True)
    if self.dry_run:
      return 0
    code = subprocess.call(command)
    if check and code:
      raise SystemExit(f'tpu_vm.py: `{shlex.join(command[:5])}` failed with '
                       f'status {code}; see its output above.')
    return code

  def state(self, command) -> str:
    return (self.output(command) or '').strip()

  def output(self, command) -> str | None:
    """The command's stdout, or None when it fails."""
    print('+ ' + shlex.join(command), flush=True)
    if self.dry_run:
      return ''
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout if result.returncode == 0 else None

  def stream(self, command) -> int:
    """Copies the command's output here as it comes; returns its bytes."""
    print('+ ' + shlex.join(command), flush=True)
    if self.dry_run:
      return 0
    received = 0
    with subprocess.Popen(command, stdout=subprocess.PIPE) as process:
      while chunk := process.stdout.read1(65536):
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        received += len(chunk)
    return received


class Detached(Exception):
  """This launcher stops following; the run goes on on the VM."""


def follow(args, gcloud: Gcloud) -> int:
  """Streams worker 0's log and polls every worker until all have finished;
  returns their combined exit status (see `exit_status`). A failed stream or
  poll is retried; one on a preempted VM returns LOST."""
  offset, failures = 0, 0
  while True:
    offset += gcloud.stream(log_command(args, offset))
    output = gcloud.output(status_command(args))
    if gcloud.dry_run:
      return 0
    states = worker_states(output or '')
    if not states:  # The VM did not answer.
      failures += 1
      state = gcloud.state(state_command(args))
      if state in PREEMPTED_STATES:
        return LOST
      if failures >= args.max_poll_failures:
        raise Detached(f'{failures} polls of {args.name} failed in a row (VM '
                       f'state {state or "unknown"})')
    else:
      failures = 0
      code = exit_status(states)
      if code is not None:
        return code
    time.sleep(args.poll_seconds)


def train_once(args, gcloud: Gcloud, tarball: str, attach: bool = False
               ) -> int:
  if not attach:
    if not (args.dry_run or args.no_copy or os.path.exists(tarball)):
      write_tarball(tarball)
    gcloud(create_command(args))
    for command in copy_commands(args, tarball):
      gcloud(command)
    gcloud(start_command(args))
  return follow(args, gcloud)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  gcloud = Gcloud(args.dry_run)
  # Built at the first copy, in a folder only this user can enter (mkdtemp),
  # removed at exit: never a stale or planted file of a shared /tmp.
  private = tempfile.TemporaryDirectory(prefix='jaxformer-launch-')
  tarball = os.path.join(private.name, REMOTE_TARBALL)
  code, restarts, detached = 1, 0, False
  try:
    code = train_once(args, gcloud, tarball, attach=args.attach)
    while code and args.restart_on_preemption and restarts < args.max_restarts:
      state = gcloud.state(state_command(args))
      if state not in PREEMPTED_STATES:
        break
      restarts += 1
      print(f'tpu_vm.py: {args.name} was preempted (state {state}); '
            f're-creating it and resuming (restart {restarts} of at most '
            f'{args.max_restarts}).', flush=True)
      gcloud(delete_command(args))
      code = train_once(args, gcloud, tarball)
  except (Detached, KeyboardInterrupt) as e:
    detached, code = True, 130 if isinstance(e, KeyboardInterrupt) else 1
    print(f'tpu_vm.py: {e or "interrupted"}: stopped following; the run goes '
          f'on on {args.name} (log: {LOG} on each worker). Follow it again '
          'with the same command and --attach; stop it with `'
          f'{shlex.join(delete_command(args))}`.', file=sys.stderr)
  finally:
    private.cleanup()
    if not (args.keep or detached):
      gcloud(delete_command(args), check=False)
  if code and not detached:
    print(f'tpu_vm.py: the command ended with status {code} on at least one '
          'worker.', file=sys.stderr)
  return code


if __name__ == '__main__':
  sys.exit(main())
