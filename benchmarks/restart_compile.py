"""A restart's time to its first steps, with and without the persistent
compilation cache (jaxformer/runtime/compilation_cache.py), side by side.

  python3 benchmarks/restart_compile.py --config configs/quickstart.py
  python3 benchmarks/restart_compile.py --config configs/quickstart.py \
      --steps 40 --config.data.batching=bucket

A first run (the cache on, in a fresh directory) trains past the checkpoint
of step --checkpoint and is killed (SIGKILL, as a preemption) at step
--checkpoint + --steps. Then the same command restarts from that checkpoint,
--repeats times with the cache off and as many with it on, each killed at
the same step; the restarts replay the same batches, so with bucket
batching they meet the same bucket widths (one program each). Printed: per
run, the seconds from the process's start to its first step's line and to
the last step's.
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def timed_run(argv, env, until_step: int, first_step: int) -> dict:
  """Runs `argv` until it prints the line of step `until_step`, then kills
  it; the seconds to the lines of `first_step` and `until_step`."""
  start = time.perf_counter()
  process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, cwd=REPO,
                             start_new_session=True)
  seen, tail = {}, []
  for line in process.stdout:
    tail = (tail + [line])[-20:]
    match = re.match(r'step (\d+)/\d+ ', line)
    if not match:
      continue
    step = int(match.group(1))
    if step >= first_step and 'first' not in seen:
      seen['first'] = time.perf_counter() - start
    if step >= until_step:
      seen['last'] = time.perf_counter() - start
      os.killpg(process.pid, signal.SIGKILL)
      break
  process.wait()
  if 'last' not in seen:
    raise RuntimeError(f'{argv} ended before step {until_step}:\n'
                       + ''.join(tail))
  return {'first_step_s': round(seen['first'], 2),
          'last_step_s': round(seen['last'], 2)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--config', default='configs/quickstart.py')
  parser.add_argument('--checkpoint', type=int, default=50,
                      help='the step of the checkpoint restarts resume from')
  parser.add_argument('--steps', type=int, default=1,
                      help='steps each restart trains before it is killed')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--workdir', help='default: a fresh temporary folder')
  args, overrides = parser.parse_known_args()
  if args.steps >= args.checkpoint:
    parser.error('--steps must be below --checkpoint (a restart must not '
                 'reach the next checkpoint)')
  root = args.workdir or tempfile.mkdtemp(prefix='restart_compile_')
  cache = os.path.join(root, 'xla')
  argv = [sys.executable, '-m', 'jaxformer', 'train', '--config',
          args.config, '--workdir', os.path.join(root, 'run'),
          '--config.train.log_every=1',
          f'--config.checkpoint.every={args.checkpoint}',
          '--config.eval.every=0', *overrides]
  env = dict(os.environ, PYTHONPATH=REPO)
  env.pop('JAX_COMPILATION_CACHE_DIR', None)
  on = dict(env, JAXFORMER_COMPILATION_CACHE=cache)
  off = dict(env, JAXFORMER_COMPILATION_CACHE='off')
  last = args.checkpoint + args.steps
  runs = {'first run (cold cache)': timed_run(argv, on, last, 1)}
  entries = [f for f in os.listdir(cache) if f.endswith('-cache')]
  for i in range(args.repeats):
    runs[f'restart {i + 1}, cache off'] = timed_run(
        argv, off, last, args.checkpoint + 1)
    runs[f'restart {i + 1}, cache on'] = timed_run(
        argv, on, last, args.checkpoint + 1)
  print(f'{args.config} {" ".join(overrides)}: restarts from step '
        f'{args.checkpoint}, {args.steps} step(s) each; cache {cache} '
        f'({len(entries)} programs after the first run)')
  for name, run in runs.items():
    print(f'  {name:28s} first step {run["first_step_s"]:6.1f} s   step '
          f'{last} {run["last_step_s"]:6.1f} s')
  print(json.dumps({'config': args.config, 'overrides': overrides,
                    'cache_entries': len(entries), 'runs': runs}))


if __name__ == '__main__':
  main()
