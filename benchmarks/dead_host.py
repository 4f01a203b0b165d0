"""How long the other processes of a multi-host run take to exit when one
dies: N CPU processes over gloo (as launch/local.sh starts them), a tiny
model, SIGKILL to a random worker at a random step.

  python benchmarks/dead_host.py [--processes 2 4] [--trials 3]
      [--heartbeat 10] [--config.KEY=VALUE ...]

For each trial it prints the killed process, the step, and for every other
process its exit status, the seconds from the kill to its exit, and whether
its log names the dead process; then the median and worst exit time per
process count beside the heartbeat timeout they are bounded by
(`distributed.heartbeat_timeout`). tests/test_multihost.py asserts the
bound.
"""
import argparse
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ['--config.model.d_model=16', '--config.model.d_ff=32',
        '--config.model.num_heads=2', '--config.train.log_every=1',
        '--config.eval.every=0', '--config.eval.final_split=',
        '--config.eval.bleu_examples=0', '--config.train.peak_flops=1e9',
        '--config.checkpoint.every=2', '--config.train.num_steps=100000']


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def tokenizer(directory: pathlib.Path) -> str:
  """A small SentencePiece model on the built-in data, trained once."""
  from jaxformer.config import settings as config_lib
  from jaxformer.data import builtin
  from jaxformer.data import tokenizer as tokenizer_lib
  tok_config = config_lib.default_config().data.tokenizer
  tok_config.vocab_size = 256
  prefix = directory / 'joint'
  tokenizer_lib.train_tokenizer(
      [text for pair in builtin.generate(600, 0, 'train') for text in pair],
      str(prefix), tok_config)
  return f'{prefix}.model'


def last_step(workdir: pathlib.Path) -> int:
  metrics = workdir / 'metrics.jsonl'
  if not metrics.exists():
    return 0
  steps = [json.loads(line).get('step', 0)
           for line in metrics.read_text().splitlines() if line.endswith('}')]
  return max(steps, default=0)


def trial(count: int, heartbeat: int, model: str, overrides: list[str],
          directory: pathlib.Path, rng: np.random.Generator) -> dict:
  """One run of `count` processes, one of them killed; what followed."""
  step, victim = int(rng.integers(3, 9)), int(rng.integers(1, count))
  workdir, port = directory / 'run', free_port()
  command = [sys.executable, '-m', 'jaxformer', 'train', '--config',
             f'{REPO}/configs/quickstart.py:runlocal', '--workdir',
             str(workdir), *TINY, f'--config.data.tokenizer.model_path={model}',
             f'--config.distributed.heartbeat_timeout={heartbeat}', *overrides]
  logs = [directory / f'process{i}.log' for i in range(count)]
  processes = []
  for i, log in enumerate(logs):
    with open(log, 'w') as out:
      processes.append(subprocess.Popen(
          command, stdout=out, stderr=subprocess.STDOUT, env=dict(
              os.environ, JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}',
              JAX_NUM_PROCESSES=str(count), JAX_PROCESS_ID=str(i),
              JAX_PLATFORMS='cpu',
              XLA_FLAGS='--xla_force_host_platform_device_count=1')))
  try:
    while last_step(workdir) < step:
      if any(p.poll() is not None for p in processes):
        raise RuntimeError('a process ended before the kill:\n'
                           + logs[0].read_text()[-3000:])
      time.sleep(0.02)
    processes[victim].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    seconds = {}
    while len(seconds) < count - 1:
      for i, p in enumerate(processes):
        if i != victim and i not in seconds and p.poll() is not None:
          seconds[i] = time.monotonic() - killed
      if time.monotonic() - killed > heartbeat + 300:
        raise RuntimeError(f'still running {heartbeat + 300} s after the kill')
      time.sleep(0.05)
  finally:
    for p in processes:
      if p.poll() is None:
        p.kill()
      p.wait()
  named = f'jaxformer: process {victim} of {count} stopped responding'
  return dict(victim=victim, step=step, seconds=seconds, codes={
      i: processes[i].returncode for i in seconds}, named={
          i: named in logs[i].read_text() for i in seconds})


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--processes', type=int, nargs='+', default=[2, 4])
  parser.add_argument('--trials', type=int, default=3)
  parser.add_argument('--heartbeat', type=int, default=10)
  parser.add_argument('--seed', type=int, default=0)
  args, overrides = parser.parse_known_args()
  rng = np.random.default_rng(args.seed)
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    model = tokenizer(scratch)
    summary = {}
    for count in args.processes:
      for index in range(args.trials):
        directory = scratch / f'{count}-{index}'
        directory.mkdir()
        result = trial(count, args.heartbeat, model, overrides, directory, rng)
        summary.setdefault(count, []).extend(result['seconds'].values())
        print(f'{count} processes, trial {index + 1}: killed process '
              f'{result["victim"]} after step {result["step"]}; '
              + ', '.join(f'process {i} exited {s:.1f} s later (status '
                          f'{result["codes"][i]}, names it: '
                          f'{result["named"][i]})'
                          for i, s in sorted(result['seconds'].items())),
              flush=True)
  for count, seconds in summary.items():
    print(f'{count} processes: the others exited {statistics.median(seconds):.1f}'
          f' s (median), {max(seconds):.1f} s (worst) after the kill; '
          f'heartbeat timeout {args.heartbeat} s')


if __name__ == '__main__':
  main()
