"""Training throughput of the jitted train step on this machine.

  python benchmarks/train_throughput.py --config small [--steps 10] [--dtype float32]

Prints step time, source+target tokens/s, compile time, peak host memory and
MFU. MFU = model FLOPs per step / step time / peak FLOP/s, where

  model FLOPs per step = 3 x forward FLOPs (backward costs twice forward),
  forward FLOPs = 2 x (matmul parameters a token passes through) per token
                + 4 x d_model x (query, key) pairs per attention layer
                + 2 x d_model x vocab per target token (the logits),

(`jaxformer.train.flops.training_flops_per_step`), and the peak is measured
in the same run: the best FLOP/s of a large `jnp.dot` in the same dtype.
"""
import argparse
import resource
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxformer import parallel
from jaxformer.model import ModelConfig
from jaxformer.model.backend import ATTENTION_IMPLS
from jaxformer.tasks import get_task
from jaxformer.train import schedule as schedules
from jaxformer.train.flops import training_flops_per_step
from jaxformer.train.state import count_params, create_train_state
from jaxformer.train.step import compile_train_step

PRESETS = {
    'small': dict(model=dict(vocab_size=8000, d_model=256, num_heads=4,
                             d_ff=1024, num_encoder_layers=3,
                             num_decoder_layers=3),
                  rows=32, source_length=64, target_length=64),
    'base': dict(model=dict(vocab_size=32000, d_model=512, num_heads=8,
                            d_ff=2048, num_encoder_layers=6,
                            num_decoder_layers=6),
                 rows=8, source_length=64, target_length=64),
    'big': dict(model=dict(vocab_size=32000, d_model=1024, num_heads=16,
                           d_ff=4096, num_encoder_layers=6,
                           num_decoder_layers=6, embedding_dropout=0.3,
                           residual_dropout=0.3),
                rows=64, source_length=128, target_length=128),
}

TRAIN = ml_collections.ConfigDict(dict(
    schedule='rsqrt', learning_rate=1.0, warmup_steps=4000, num_steps=100,
    b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0, grad_clip_norm=0.0))


def peak_matmul_flops(dtype, n: int, repeats: int = 10) -> float:
  a = jnp.ones((n, n), dtype)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * n ** 3 / best


def random_batch(rng, rows, source_length, target_length, vocab):
  """Full-length rows (no padding): every position is a real token."""
  inputs = rng.integers(3, vocab, (rows, source_length), dtype=np.int32)
  targets = rng.integers(3, vocab, (rows, target_length), dtype=np.int32)
  inputs[:, -1] = targets[:, -1] = 1
  return {'inputs': inputs, 'targets': targets}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--config', choices=sorted(PRESETS), default='small')
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--dtype', choices=('float32', 'bfloat16'),
                      default='float32')
  parser.add_argument('--rows', type=int, default=0)
  parser.add_argument('--length', type=int, default=0,
                      help='source and target length')
  parser.add_argument('--attention', choices=ATTENTION_IMPLS, default='einsum',
                      help="model.attention_impl ('auto': cuDNN on GPUs, "
                      'splash on TPUs)')
  parser.add_argument('--remat', default='none')
  parser.add_argument('--scan', action='store_true')
  args = parser.parse_args()

  preset = PRESETS[args.config]
  rows = args.rows or preset['rows']
  source_length = target_length = args.length or preset['source_length']
  model_config = ModelConfig(max_len=max(512, source_length), dtype=args.dtype,
                             attention_impl=args.attention,
                             remat_policy=args.remat, scan_layers=args.scan,
                             **preset['model'])
  task = get_task('translation')
  mesh = parallel.make_mesh({'data': -1})
  rules = parallel.DEFAULT_AXIS_RULES
  schedule = schedules.make_schedule(TRAIN, model_config.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  rng = np.random.default_rng(0)
  batches = [random_batch(rng, rows, source_length, target_length,
                          model_config.vocab_size) for _ in range(2)]
  state = create_train_state(task, task.model(model_config), tx, batches[0],
                             mesh, rules, seed=0)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  with parallel.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(model_config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=0.1, grad_accum_steps=1,
        prng_impl='threefry2x32')
    device_batches = [parallel.global_batch(b, mesh) for b in batches]
    start = time.perf_counter()
    compiled = step.lower(state, device_batches[0]).compile()
    compile_seconds = time.perf_counter() - start
    state, metrics = compiled(state, device_batches[0])
    jax.block_until_ready(metrics)
    times = []
    for i in range(args.steps):
      start = time.perf_counter()
      state, metrics = compiled(state, device_batches[i % 2])
      jax.block_until_ready(metrics)
      times.append(time.perf_counter() - start)

  step_time = float(np.median(times))
  tokens = rows * (source_length + target_length)
  flops = training_flops_per_step(model_config, get_task('translation'), rows,
                                  source_length, target_length)
  device = jax.devices()[0]
  peak = peak_matmul_flops(jnp.dtype(args.dtype),
                           2048 if device.platform == 'cpu' else 8192)
  peak *= jax.device_count()
  peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f'config={args.config} dtype={args.dtype} device={device.device_kind} '
        f'x{jax.device_count()} params={count_params(state.params) / 1e6:.1f}M '
        f'batch={rows}x({source_length}+{target_length})')
  print(f'compile_time_s={compile_seconds:.2f}')
  print(f'step_time_s={step_time:.4f} (median of {args.steps})')
  print(f'tokens_per_s={tokens / step_time:,.0f}')
  print(f'model_tflops_per_step={flops / 1e12:.4f}')
  print(f'peak_matmul_gflops={peak / 1e9:,.0f}')
  print(f'mfu={100 * flops / step_time / peak:.1f}%')
  print(f'peak_host_memory_mib={peak_rss_mib:,.0f}')
  print(f'loss={float(metrics["loss"]):.4f}')


if __name__ == '__main__':
  main()
