"""Training throughput of the jitted train step on this machine, optionally
side by side with Flax's WMT example as an anchor.

  python benchmarks/train_throughput.py --config small [--steps 10] [--dtype float32]
  python benchmarks/train_throughput.py --config small --flax_wmt DIR [--rounds 3]

With --flax_wmt (DIR is `examples/wmt` of a clone of github.com/google/flax),
Flax's own `models.Transformer` and `train.train_step`, unchanged and
pmapped as its train.py does, train the same architecture on the same
batch.  Two of our steps run beside it: the config as it is ('ours':
the paper's dropout on embeddings and residuals, post-LayerNorm), and the
same with Flax's dropout (0.1 also on the FFN hidden layer and the
attention weights) and its pre-LayerNorm ('ours_flax_dropout', identical
computation).  Each round times the steps one after another, step by
step, so that drift of the machine's speed hits all alike, and reports
their medians.

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
import ast
import functools
import os
import resource
import sys
import time
import types

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


FLAX_DROPOUT = dict(embedding_dropout=0.1, residual_dropout=0.1,
                    attention_dropout=0.1, ffn_dropout=0.1)


def our_step(model_config, batches):
  """Our jitted train step on `batches` (a list of host batches, used in
  turn). Returns (step: () -> metrics, compile seconds, parameter count)."""
  task = get_task('translation')
  mesh = parallel.make_mesh({'data': -1})
  rules = parallel.DEFAULT_AXIS_RULES
  schedule = schedules.make_schedule(TRAIN, model_config.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  state = create_train_state(task, task.model(model_config), tx, batches[0],
                             mesh, rules, seed=0)
  params = count_params(state.params)
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
  calls = [0]

  def run():
    nonlocal state
    state, metrics = compiled(state, device_batches[calls[0] % 2])
    calls[0] += 1
    return metrics
  return run, compile_seconds, params


def flax_wmt_train_module(flax_wmt: str):
  """(Flax's `models` module, a namespace of its train.py's step
  definitions).

  The definitions (TrainState, the schedule, the loss and metrics,
  `train_step`) are taken from train.py's source unchanged and executed with
  the imports they use; the rest of the module is left out, because its
  input pipeline imports tensorflow_text and clu, which the step does not
  need.
  """
  from flax import linen  # pylint: disable=import-outside-toplevel
  from flax.training import common_utils, dynamic_scale, train_state  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, os.path.abspath(flax_wmt))
  import models  # pylint: disable=import-outside-toplevel
  path = os.path.join(flax_wmt, 'train.py')
  with open(path) as f:
    tree = ast.parse(f.read())
  wanted = {'TrainState', 'rsqrt_schedule', 'create_learning_rate_schedule',
            'compute_weighted_cross_entropy', 'compute_weighted_accuracy',
            'compute_metrics', 'train_step'}
  body = [node for node in tree.body if getattr(node, 'name', None) in wanted]
  missing = wanted - {node.name for node in body}
  if missing:
    raise SystemExit(f'--flax_wmt {flax_wmt}: train.py has no '
                     f'{sorted(missing)}; pass examples/wmt of a Flax clone.')
  namespace = dict(functools=functools, jax=jax, jnp=jnp, np=np, optax=optax,
                   nn=linen, common_utils=common_utils,
                   dynamic_scale_lib=dynamic_scale, train_state=train_state,
                   models=models)
  exec(compile(ast.Module(body, type_ignores=[]), path, 'exec'), namespace)  # pylint: disable=exec-used
  return models, types.SimpleNamespace(**namespace)


def flax_wmt_step(flax_wmt: str, model_config, batches):
  """Flax's WMT example's train step on the same architecture and batches,
  set up as its train.py's `train_and_evaluate` does (adamw with b2=0.98,
  eps=1e-9, its rsqrt schedule, label smoothing 0.1, pmap over 'batch')."""
  from flax import jax_utils  # pylint: disable=import-outside-toplevel
  from flax.training import common_utils  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  flax_models, flax_train = flax_wmt_train_module(flax_wmt)
  cfg = model_config
  config = flax_models.TransformerConfig(
      vocab_size=cfg.vocab_size, output_vocab_size=cfg.vocab_size,
      share_embeddings=True, logits_via_embedding=True,
      dtype=jnp.dtype(cfg.dtype), emb_dim=cfg.d_model,
      num_heads=cfg.num_heads, num_layers=cfg.num_encoder_layers,
      qkv_dim=cfg.d_model, mlp_dim=cfg.d_ff, max_len=cfg.max_len,
      dropout_rate=0.1, attention_dropout_rate=0.1, deterministic=False)
  shape = batches[0]['inputs'].shape
  variables = jax.jit(flax_models.Transformer(
      config.replace(deterministic=True)).init)(
          jax.random.key(0), jnp.ones(shape, jnp.float32),
          jnp.ones(batches[0]['targets'].shape, jnp.float32))
  learning_rate_fn = flax_train.create_learning_rate_schedule(
      learning_rate=0.002, warmup_steps=1000)
  state = flax_train.TrainState.create(
      apply_fn=flax_models.Transformer(config).apply,
      params=variables['params'],
      tx=optax.adamw(learning_rate=learning_rate_fn, b1=0.9, b2=0.98,
                     eps=1e-9, weight_decay=0.0),
      dynamic_scale=None)
  params = count_params(state.params)
  state = jax_utils.replicate(state)
  p_train_step = jax.pmap(
      functools.partial(flax_train.train_step, config=config,
                        learning_rate_fn=learning_rate_fn,
                        label_smoothing=0.1),
      axis_name='batch', donate_argnums=(0,))
  device_batches = [common_utils.shard(b) for b in batches]
  dropout_rngs = jax.random.split(jax.random.key(1), jax.local_device_count())
  start = time.perf_counter()
  state, metrics = p_train_step(state, device_batches[0],
                                dropout_rng=dropout_rngs)
  jax.block_until_ready(metrics)
  compile_seconds = time.perf_counter() - start
  calls = [0]

  def run():
    nonlocal state
    state, metrics = p_train_step(state, device_batches[calls[0] % 2],
                                  dropout_rng=dropout_rngs)
    calls[0] += 1
    return metrics
  return run, compile_seconds, params


def median_step_seconds(runs: dict, steps: int) -> dict[str, float]:
  """{name: median seconds of `steps` steps}, the runs interleaved step by
  step."""
  for run in runs.values():
    jax.block_until_ready(run())  # Warm (the first call may compile).
  times = {name: [] for name in runs}
  for _ in range(steps):
    for name, run in runs.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  return {name: float(np.median(t)) for name, t in times.items()}


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
  parser.add_argument('--flax_wmt', default='',
                      help="Flax's examples/wmt directory: time its train "
                      'step beside ours')
  parser.add_argument('--rounds', type=int, default=3,
                      help='with --flax_wmt: alternating rounds of --steps')
  args = parser.parse_args()

  preset = PRESETS[args.config]
  rows = args.rows or preset['rows']
  source_length = target_length = args.length or preset['source_length']
  model_config = ModelConfig(max_len=max(512, source_length), dtype=args.dtype,
                             attention_impl=args.attention,
                             remat_policy=args.remat, scan_layers=args.scan,
                             **preset['model'])
  rng = np.random.default_rng(0)
  batches = [random_batch(rng, rows, source_length, target_length,
                          model_config.vocab_size) for _ in range(2)]
  steps = {'ours': our_step(model_config, batches)}
  if args.flax_wmt:
    steps['ours_flax_dropout'] = our_step(
        model_config.replace(norm_position='pre', **FLAX_DROPOUT), batches)
    steps['flax_wmt'] = flax_wmt_step(args.flax_wmt, model_config, batches)

  tokens = rows * (source_length + target_length)
  flops = training_flops_per_step(model_config, get_task('translation'), rows,
                                  source_length, target_length)
  device = jax.devices()[0]
  print(f'config={args.config} dtype={args.dtype} device={device.device_kind} '
        f'x{jax.device_count()} params={steps["ours"][2] / 1e6:.1f}M '
        f'batch={rows}x({source_length}+{target_length})')
  for name, (_, compile_seconds, params) in steps.items():
    print(f'{name}: compile_time_s={compile_seconds:.2f} '
          f'params={params / 1e6:.2f}M')
  print(f'model_tflops_per_step={flops / 1e12:.4f}')
  peak_size = 2048 if device.platform == 'cpu' else 8192
  for round_index in range(args.rounds if args.flax_wmt else 1):
    # The peak in the same round (the machine's speed drifts), the better
    # of a reading before and one after the steps: one reading can catch
    # a moment when other work holds a core.
    peak = peak_matmul_flops(jnp.dtype(args.dtype), peak_size)
    seconds = median_step_seconds(
        {name: run for name, (run, _, _) in steps.items()}, args.steps)
    peak = max(peak, peak_matmul_flops(jnp.dtype(args.dtype), peak_size))
    peak *= jax.device_count()
    line = [f'round {round_index + 1}:',
            f'peak_matmul_gflops={peak / 1e9:,.0f}']
    for name, step_time in seconds.items():
      line.append(f'{name}: step_time_s={step_time:.4f} '
                  f'tokens_per_s={tokens / step_time:,.0f} '
                  f'mfu={100 * flops / step_time / peak:.1f}%')
    if args.flax_wmt:
      line.append(
          f'speedup={seconds["flax_wmt"] / seconds["ours"]:.2f}x '
          f'(identical computation: '
          f'{seconds["flax_wmt"] / seconds["ours_flax_dropout"]:.2f}x)')
    print(' | '.join(line), flush=True)
  peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f'(medians of {args.steps} steps) '
        f'peak_host_memory_mib={peak_rss_mib:,.0f}')


if __name__ == '__main__':
  main()
