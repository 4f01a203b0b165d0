#!/usr/bin/env python3
"""Trains on a Cloud TPU VM or pod slice with `gcloud`, start to finish.

  launch/tpu_vm.py --name my-tpu --zone us-central2-b --accelerator-type v4-16 \\
      --runtime-version tpu-ubuntu2204-base --spot --restart-on-preemption -- \\
      jaxformer train --config configs/quickstart.py --workdir gs://bucket/runs/q

Steps: create the VM; copy this checkout to every worker and install it (with
jax[tpu]); run the command on every worker at once (each host is one JAX
process; `jaxformer train` finds the others through the TPU metadata); stream
their output; delete the VM. With --restart-on-preemption a run that ends
because the VM was preempted is started again on a new VM and resumes from
the last checkpoint, so the workdir must be in a bucket (gs://).
--dry-run prints the gcloud commands instead of running them.
"""
import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_PATHS = ('pyproject.toml', 'README.md', 'jaxformer', 'configs')
PREEMPTED_STATES = ('PREEMPTED', 'TERMINATED')
REMOTE_DIR = '~/jaxformer'
REMOTE_TARBALL = 'jaxformer.tar.gz'
DEFAULT_INSTALL = (f'mkdir -p {REMOTE_DIR} && tar -xzf ~/{REMOTE_TARBALL} '
                   f'-C {REMOTE_DIR} && python3 -m pip install -q -U '
                   f"'jax[tpu]' -e {REMOTE_DIR}")


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
  parser.add_argument('--install', default=DEFAULT_INSTALL,
                      help='shell command that installs the copied package on '
                           'each worker')
  parser.add_argument('--keep', action='store_true',
                      help='leave the VM running at the end')
  parser.add_argument('--dry-run', action='store_true',
                      help='print the gcloud commands, run nothing')
  parser.add_argument('command', nargs=argparse.REMAINDER,
                      help='after --: the command every worker runs')
  args = parser.parse_args(argv)
  args.command = args.command[1:] if args.command[:1] == ['--'] else args.command
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


def run_command(args) -> list[str]:
  # pip installs scripts to ~/.local/bin, which ssh commands lack on PATH.
  prefix = 'export PATH="$HOME/.local/bin:$PATH" && '
  if not args.no_copy:
    prefix += f'cd {REMOTE_DIR} && '
  return on_all_workers(args, prefix + shlex.join(args.command))


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
    print('+ ' + shlex.join(command), flush=True)
    if self.dry_run:
      return ''
    result = subprocess.run(command, capture_output=True, text=True)
    return result.stdout.strip() if result.returncode == 0 else ''


def train_once(args, gcloud: Gcloud, tarball: str) -> int:
  gcloud(create_command(args))
  for command in copy_commands(args, tarball):
    gcloud(command)
  return gcloud(run_command(args), check=False)


def main(argv=None) -> int:
  args = parse_args(sys.argv[1:] if argv is None else argv)
  gcloud = Gcloud(args.dry_run)
  tarball = os.path.join(tempfile.gettempdir(), f'jaxformer-{args.name}.tar.gz')
  if not (args.dry_run or args.no_copy):
    write_tarball(tarball)
  code, restarts = 1, 0
  try:
    code = train_once(args, gcloud, tarball)
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
  finally:
    if not args.keep:
      gcloud(delete_command(args), check=False)
  if code:
    print(f'tpu_vm.py: the command ended with status {code} on at least one '
          'worker.', file=sys.stderr)
  return code


if __name__ == '__main__':
  sys.exit(main())
