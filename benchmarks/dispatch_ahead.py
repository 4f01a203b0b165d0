"""Tokens/s of the training loop with bounded and unbounded dispatch-ahead,
side by side in one process.

  python benchmarks/dispatch_ahead.py [--config configs/quickstart.py]
      [--rounds 6] [--steps 50] [--config.KEY=VALUE ...]

`bounded` is what `jaxformer train` does: before step n + 1 is dispatched,
the metrics of step n - 1 are fetched, so at most two steps are queued and a
SIGTERM is acted on within two steps. `unbounded` is the loop before that
change: metrics are fetched only every --log-every steps, so up to that many
steps queue up on the device. Both run the same compiled step on the same
data stream (the config's real input pipeline), alternating round by round;
the script prints each round's tokens/s and the median per mode.
"""
import argparse
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from jaxformer.parallel import mesh as mesh_lib
from jaxformer.config.settings import load_config
from jaxformer.data import task_batches
from jaxformer.run.trainer import Trainer


def run_round(step_fn, state, batches, mesh, steps: int, mode: str,
              log_every: int):
  """(state, tokens/s) after `steps` steps dispatched as `mode` says."""
  pending, tokens = [], 0
  start = time.perf_counter()
  for index in range(1, steps + 1):
    local = next(batches)
    state, metrics = step_fn(state, mesh_lib.global_batch(local, mesh))
    tokens += int(sum(np.count_nonzero(local[k]) for k in ('inputs', 'targets')
                      if k in local))
    pending.append(metrics)
    if mode == 'bounded':
      for m in pending[:-1]:
        jax.device_get(m)
      del pending[:-1]
    if index % log_every == 0 or index == steps:
      for m in pending:
        jax.device_get(m)
      pending = []
  jax.block_until_ready(state)
  return state, tokens / (time.perf_counter() - start)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  overrides = [a for a in argv if a.startswith('--config.')]
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', default='configs/quickstart.py')
  parser.add_argument('--rounds', type=int, default=6)
  parser.add_argument('--steps', type=int, default=50)
  parser.add_argument('--log-every', type=int, default=100)
  args = parser.parse_args([a for a in argv if a not in overrides])
  config = load_config(args.config, overrides)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = Trainer(config, workdir)
    state = trainer.initial_state()
    trainer.checkpoints.close()
  run = trainer.spec
  batches = task_batches.train_batches(run.config, trainer.source_tok,
                                       trainer.target_tok, start_step=0)
  with mesh_lib.activate(run.mesh, run.rules):
    step_fn = run.train_step(jax.tree.map(lambda x: x.sharding, state))
    state, _ = run_round(step_fn, state, batches, trainer.mesh, 5, 'bounded',
                         args.log_every)  # Compiles.
    results = {'unbounded': [], 'bounded': []}
    for round_index in range(args.rounds):
      order = list(results) if round_index % 2 == 0 else list(results)[::-1]
      for mode in order:
        state, rate = run_round(step_fn, state, batches, trainer.mesh,
                                args.steps, mode, args.log_every)
        results[mode].append(rate)
        print(f'round {round_index} {mode:9s} {rate:12,.0f} tokens/s',
              flush=True)
  device = jax.devices()[0]
  print(f'{device.device_kind} x{jax.device_count()}, {args.config}, '
        f'{args.steps} steps per round, unbounded fetches every '
        f'{args.log_every}:')
  for mode, rates in results.items():
    print(f'  {mode:9s} median {statistics.median(rates):12,.0f} tokens/s '
          f'(range {min(rates):,.0f}-{max(rates):,.0f})')
  ratio = statistics.median(results['bounded']) / statistics.median(
      results['unbounded'])
  print(f'  bounded / unbounded = {ratio:.3f}')


if __name__ == '__main__':
  main()
