"""Training throughput of the jitted train step on this machine, optionally
side by side with Flax's WMT example as an anchor.

  python benchmarks/train_throughput.py --config small [--steps 10] [--dtype float32]
  python benchmarks/train_throughput.py --config small --flax_wmt DIR [--rounds 3]
  python benchmarks/train_throughput.py --config llama_125m --dtype bfloat16

small, base and big are the paper's translation models; llama_125m is
configs/lm_llama.py:125m (a decoder-only LM with RoPE, RMSNorm, SwiGLU and
4 kv heads for 12 query heads; scanned layers, remat 'dots' unless --remat
names another policy) on full rows of 2048 tokens.

With --flax_wmt (DIR is `examples/wmt` of a clone of github.com/google/flax),
Flax's own `models.Transformer` and `train.train_step`, unchanged and
pmapped as its train.py does, train the same architecture on the same
batch (benchmarks/flax_wmt_step.py), twice:

  flax_wmt             in a process of its own, as Flax's own program runs it;
  flax_wmt_in_process  in this process, after `import jaxformer`, which sets
                       the host's malloc for XLA's temporaries
                       (jaxformer/runtime/host_memory.py): the same for
                       both steps.

Two of our steps run beside them: the config as it is ('ours': the paper's
dropout on embeddings and residuals, post-LayerNorm), and the same with
Flax's dropout (0.1 also on the FFN hidden layer and the attention weights)
and its pre-LayerNorm ('ours_flax_dropout', identical computation).  Each
round times the steps one after another, step by step (nothing runs in the
other process meanwhile), so that drift of the machine's speed hits all
alike, and reports their medians and three ratios:

  speedup          flax_wmt / ours: each as its program runs it;
  step alone       flax_wmt_in_process / ours: the same malloc settings;
  identical        flax_wmt_in_process / ours_flax_dropout.

Prints step time, source+target tokens/s, compile time, peak host memory and
MFU. MFU = model FLOPs per step / step time / peak FLOP/s, where

  model FLOPs per step = 3 x forward FLOPs (backward costs twice forward),
  forward FLOPs = 2 x (matmul parameters a token passes through) per token
                + 4 x d_model x (query, key) pairs per attention layer
                + 2 x d_model x vocab per target token (the logits),

(`jaxformer.train.flops.training_flops_per_step`), and the peak is measured
in the same run: the best FLOP/s of a large `jnp.dot` in the same dtype,
or the chip's nominal peak with --peak_flops (per device; e.g. 989e12 for
an H100/H200's dense bf16). --json FILE also writes the figures.
"""
import argparse
import dataclasses
import json
import os
import resource
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jaxformer.config.settings import load_config
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.model import ModelConfig
from jaxformer.model.config import from_config_dict
from jaxformer.model.backend import ATTENTION_IMPLS
from jaxformer.train.tasks import get_task
from jaxformer.train import schedule as schedules
from jaxformer.train.flops import training_flops_per_step
from jaxformer.train.state import count_params, create_train_state
from jaxformer.train.step import compile_train_step

import flax_wmt_step  # pylint: disable=g-bad-import-order

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
    # The model of configs/lm_llama.py:125m.
    'llama_125m': dict(task='language_model', lm_llama='125m', rows=16,
                       source_length=0, target_length=2048),
}
LM_LLAMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..',
                        'configs', 'lm_llama.py')

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


FLAX_DROPOUT = dict(embedding_dropout=0.1, residual_dropout=0.1,
                    attention_dropout=0.1, ffn_dropout=0.1)


def preset_model(name: str, args) -> ModelConfig:
  """The preset's model with the command line's dtype and attention, and
  its remat and scan where given (else the preset's own)."""
  preset = PRESETS[name]
  if 'lm_llama' in preset:
    model_config = from_config_dict(
        load_config(f'{LM_LLAMA}:{preset["lm_llama"]}').model)
  else:
    model_config = ModelConfig(**preset['model'])
  changes = dict(dtype=args.dtype, attention_impl=args.attention)
  if args.remat:
    changes['remat_policy'] = args.remat
  if args.scan:
    changes['scan_layers'] = True
  length = max(args.length or preset['source_length'],
               args.length or preset['target_length'])
  changes['max_len'] = max(512, length, model_config.max_len)
  return model_config.replace(**changes)


def lm_batches(rows: int, length: int, vocab: int) -> list[dict]:
  """The two batches of full rows (no padding, one document a row)."""
  rng = np.random.default_rng(0)
  return [{'targets': rng.integers(3, vocab, (rows, length), dtype=np.int32)}
          for _ in range(2)]


def our_step(model_config, batches, task_name: str = 'translation'):
  """Our jitted train step on `batches` (a list of host batches, used in
  turn). Returns (step: () -> metrics, compile seconds, parameter count)."""
  task = get_task(task_name)
  mesh = mesh_lib.make_mesh({'data': -1})
  rules = mesh_lib.DEFAULT_AXIS_RULES
  schedule = schedules.make_schedule(TRAIN, model_config.d_model)
  tx = schedules.make_optimizer(TRAIN, schedule)
  state = create_train_state(task, task.model(model_config), tx, batches[0],
                             mesh, rules, seed=0)
  params = count_params(state.params)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(model_config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=0.1, grad_accum_steps=1,
        prng_impl='threefry2x32')
    device_batches = [mesh_lib.global_batch(b, mesh) for b in batches]
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


def timed(run):
  """A step that returns its own seconds."""
  def step():
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start
  return step


def median_step_seconds(steps: dict, count: int) -> dict[str, float]:
  """{name: median seconds of `count` steps}; `steps` return their seconds
  and are interleaved step by step."""
  for step in steps.values():
    step()  # Warm (the first call may compile).
  times = {name: [] for name in steps}
  for _ in range(count):
    for name, step in steps.items():
      times[name].append(step())
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
  parser.add_argument('--remat', default='',
                      help="model.remat_policy (default: the preset's)")
  parser.add_argument('--scan', action='store_true',
                      help="scanned layers (default: the preset's)")
  parser.add_argument('--flax_wmt', default='',
                      help="Flax's examples/wmt directory: time its train "
                      'step beside ours')
  parser.add_argument('--rounds', type=int, default=3,
                      help='with --flax_wmt: alternating rounds of --steps')
  parser.add_argument('--peak_flops', type=float, default=0.0,
                      help='MFU against this peak FLOP/s per device '
                      '(default: the measured best matmul)')
  parser.add_argument('--json', help='also write the figures to this file')
  args = parser.parse_args()

  preset = PRESETS[args.config]
  task = get_task(preset.get('task', 'translation'))
  if args.flax_wmt and task.name != 'translation':
    parser.error(f'--flax_wmt times translation models, not {args.config}')
  rows = args.rows or preset['rows']
  source_length = args.length or preset['source_length']
  target_length = args.length or preset['target_length']
  if 'inputs' not in task.batch_keys:
    source_length = 0
  model_config = preset_model(args.config, args)
  model = dataclasses.asdict(model_config)
  if task.name == 'translation':
    batches = flax_wmt_step.batches_for(model, rows, source_length,
                                        target_length)
  else:
    batches = lm_batches(rows, target_length, model_config.vocab_size)
  steps = {}  # name: (step returning its seconds, compile seconds, params)
  run, compile_seconds, params = our_step(model_config, batches, task.name)
  steps['ours'] = (timed(run), compile_seconds, params)
  if args.flax_wmt:
    run, compile_seconds, params = our_step(
        model_config.replace(norm_position='pre', **FLAX_DROPOUT), batches)
    steps['ours_flax_dropout'] = (timed(run), compile_seconds, params)
    own = flax_wmt_step.StepProcess(args.flax_wmt, model, rows,
                                    source_length, target_length)
    steps['flax_wmt'] = (own, own.compile_seconds, own.params)
    run, compile_seconds, params = flax_wmt_step.flax_wmt_step(
        args.flax_wmt, model, batches)
    steps['flax_wmt_in_process'] = (timed(run), compile_seconds, params)

  tokens = rows * (source_length + target_length)
  flops = training_flops_per_step(model_config, task, rows, source_length,
                                  target_length)
  device = jax.devices()[0]
  print(f'config={args.config} dtype={args.dtype} device={device.device_kind} '
        f'x{jax.device_count()} params={steps["ours"][2] / 1e6:.1f}M '
        f'batch={task.shape_name(rows, source_length, target_length)}')
  for name, (_, compile_seconds, params) in steps.items():
    print(f'{name}: compile_time_s={compile_seconds:.2f} '
          f'params={params / 1e6:.2f}M')
  print(f'model_tflops_per_step={flops / 1e12:.4f}')
  peak_size = 2048 if device.platform == 'cpu' else 8192
  figures = {'config': args.config, 'dtype': args.dtype,
             'attention': args.attention, 'device': device.device_kind,
             'devices': jax.device_count(), 'rows': rows,
             'source_length': source_length, 'target_length': target_length,
             'params': steps['ours'][2], 'model_flops_per_step': flops,
             'compile_s': {n: c for n, (_, c, _) in steps.items()},
             'rounds': []}
  for round_index in range(args.rounds if args.flax_wmt else 1):
    # The peak in the same round (the machine's speed drifts), the better
    # of a reading before and one after the steps: one reading can catch
    # a moment when other work holds a core.
    measured = peak_matmul_flops(jnp.dtype(args.dtype), peak_size)
    seconds = median_step_seconds(
        {name: run for name, (run, _, _) in steps.items()}, args.steps)
    measured = max(measured,
                   peak_matmul_flops(jnp.dtype(args.dtype), peak_size))
    peak = (args.peak_flops or measured) * jax.device_count()
    line = [f'round {round_index + 1}:',
            f'peak_matmul_gflops={measured * jax.device_count() / 1e9:,.0f}']
    if args.peak_flops:
      line.append(f'mfu_peak_gflops={peak / 1e9:,.0f}')
    figures['rounds'].append({
        'measured_peak_flops': measured * jax.device_count(),
        'mfu_peak_flops': peak, 'steps': {
            name: {'step_time_s': t, 'tokens_per_s': tokens / t,
                   'mfu': flops / t / peak} for name, t in seconds.items()}})
    for name, step_time in seconds.items():
      line.append(f'{name}: step_time_s={step_time:.4f} '
                  f'tokens_per_s={tokens / step_time:,.0f} '
                  f'mfu={100 * flops / step_time / peak:.1f}%')
    if args.flax_wmt:
      in_process = seconds['flax_wmt_in_process']
      line.append(
          f'speedup={seconds["flax_wmt"] / seconds["ours"]:.2f}x '
          f'(step alone: {in_process / seconds["ours"]:.2f}x, identical '
          f'computation: {in_process / seconds["ours_flax_dropout"]:.2f}x)')
    print(' | '.join(line), flush=True)
  if args.flax_wmt:
    own.close()
  peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
  print(f'(medians of {args.steps} steps) '
        f'peak_host_memory_mib={peak_rss_mib:,.0f}')
  if args.json:
    figures['peak_host_memory_mib'] = peak_rss_mib
    with open(args.json, 'w') as f:
      json.dump(figures, f, indent=2)


if __name__ == '__main__':
  main()
