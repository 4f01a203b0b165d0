"""A LoRA train step beside a full one, on the same decoder-only model:
tokens/s, peak memory and MFU, each mode in a process of its own (so that
each peak is its own).

  python benchmarks/lora_step.py --export models/qwen   # an imported model
  python benchmarks/lora_step.py --shape small          # random weights
  python benchmarks/lora_step.py --shape 8b --dtype bfloat16 --remat full \\
      --rows 1 --length 4096 --modes lora               # on one GPU

--shape 8b is configs/lm_llama.py:8b's shape (Llama-3.1-8B) with random
weights: for a GPU; its full step does not fit one 80 GB card (see
docs/finetune-llama.md). LoRA: rank --rank on q,k,v,o,gate,up,down (the
base frozen in --base_dtype). Peak memory is the device's
peak_bytes_in_use where it reports one (GPU, TPU), else the process's
peak resident set (CPU). MFU counts the model FLOPs of the step: a full
step 3 x forward (`train.flops.training_flops_per_step`); a LoRA step 2 x
forward (the frozen forward and the backward through the activations; no
weight gradients of the base), the adapters' own FLOPs left out; against
--peak_flops, or the chip's nominal peak (`train.flops`), on CPU none.
"""
import argparse
import json
import resource
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np

SHAPES = {  # d_model, layers, heads, kv heads, d_ff, vocabulary.
    'small': (256, 4, 8, 2, 768, 4096),
    '8b': (4096, 32, 32, 8, 14_336, 128_256),
}
TARGETS = 'q,k,v,o,gate,up,down'


def model_config(args, lora: bool):
  from jaxformer.model import ModelConfig, lora as lora_lib
  if args.export:
    from jaxformer.checkpoints import trained
    config = trained.load(args.export).model_config
  else:
    d, layers, heads, kv, d_ff, vocab = SHAPES[args.shape]
    config = ModelConfig(
        vocab_size=vocab, d_model=d, num_heads=heads, num_kv_heads=kv,
        d_ff=d_ff, num_encoder_layers=0, num_decoder_layers=layers,
        max_len=args.length, share_embeddings='none', norm_position='pre',
        norm_type='rms', activation='swiglu', position_embedding='rope',
        scale_embedding=False, use_bias=False, logits_bias=False,
        embedding_dropout=0.0, residual_dropout=0.0)
  config = config.replace(dtype=args.dtype, remat_policy=args.remat,
                          max_len=max(config.max_len, args.length))
  if lora:
    config = config.replace(lora=lora_lib.LoraConfig(
        targets=TARGETS, rank=args.rank, alpha=2.0 * args.rank,
        base_dtype=args.base_dtype))
  return config


def peak_bytes() -> int:
  stats = jax.devices()[0].memory_stats() or {}
  if 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use'])
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_mode(args) -> dict:
  """Times args.steps steps of one mode ('lora' or 'full') here."""
  from jaxformer.parallel import mesh as mesh_lib
  from jaxformer.train import flops, frozen_base
  from jaxformer.train import schedule as schedules
  from jaxformer.train.state import count_params, create_train_state
  from jaxformer.train.step import compile_train_step
  from jaxformer.train.tasks import get_task
  lora = args.mode == 'lora'
  config = model_config(args, lora)
  task = get_task('language_model')
  train = ml_collections.ConfigDict(dict(
      schedule='warmup_cosine', learning_rate=1e-4, warmup_steps=1,
      num_steps=100, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0,
      grad_clip_norm=1.0))
  schedule = schedules.make_schedule(train, config.d_model)
  tx = schedules.make_optimizer(train, schedule)
  rng = np.random.default_rng(0)
  batch = {'targets': rng.integers(3, config.vocab_size,
                                   (args.rows, args.length), np.int32)}
  mesh = mesh_lib.make_mesh({'data': 1}, jax.devices()[:1])
  rules = mesh_lib.DEFAULT_AXIS_RULES
  state = create_train_state(task, task.model(config), tx, batch, mesh,
                             rules, seed=0)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  if args.export:  # The export's weights, the adapters as initialised.
    from jaxformer.checkpoints import trained
    from jaxformer.model import frozen_kernels
    saved = trained.load(args.export).params
    params = frozen_base.merge(frozen_base.split(state.params)[0], saved)
    state = state.replace(params=jax.device_put(
        frozen_kernels.quantize(params, state.params), shardings.params))
  with mesh_lib.activate(mesh, rules):
    step = compile_train_step(
        mesh, shardings, task=task,
        model=task.model(config, deterministic=False), tx=tx,
        schedule=schedule, label_smoothing=0.0, grad_accum_steps=1,
        prng_impl='threefry2x32')
    batch = mesh_lib.global_batch(batch, mesh)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    float(metrics['loss'])
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
      state, metrics = step(state, batch)
    float(metrics['loss'])
    step_s = (time.perf_counter() - start) / args.steps
  trainable = frozen_base.split(state.params)[0]
  full_flops = flops.training_flops_per_step(config, task, args.rows, 0,
                                             args.length)
  model_flops = full_flops * (2 / 3 if lora else 1)
  peak = args.peak_flops or flops.device_peak_flops(
      jax.devices()[0].device_kind)
  return {'mode': args.mode, 'params': count_params(state.params),
          'trainable': count_params(trainable),
          'optimizer_state': count_params(state.opt_state),
          'step_s': step_s, 'compile_s': compile_s,
          'tokens_per_s': args.rows * args.length / step_s,
          'peak_memory_gib': peak_bytes() / 2 ** 30,
          'mfu': model_flops / step_s / peak if peak else None,
          'device': jax.devices()[0].device_kind}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--export', default='')
  parser.add_argument('--shape', default='small', choices=sorted(SHAPES))
  parser.add_argument('--rows', type=int, default=4)
  parser.add_argument('--length', type=int, default=256)
  parser.add_argument('--steps', type=int, default=5)
  parser.add_argument('--rank', type=int, default=16)
  parser.add_argument('--base_dtype', default='float32')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--remat', default='none')
  parser.add_argument('--peak_flops', type=float, default=0.0)
  parser.add_argument('--modes', default='lora,full')
  parser.add_argument('--mode', default='', help=argparse.SUPPRESS)
  parser.add_argument('--json', default='')
  args = parser.parse_args()
  if args.mode:
    print(json.dumps(run_mode(args)))
    return
  results = []
  for mode in args.modes.split(','):
    out = subprocess.run([sys.executable, __file__, *sys.argv[1:],
                          '--mode', mode], capture_output=True, text=True)
    if out.returncode:
      print(f'{mode}: failed: {out.stderr.strip().splitlines()[-1:]}')
      continue
    results.append(json.loads(out.stdout.strip().splitlines()[-1]))
  print(f'{"mode":6} {"params":>12} {"trainable":>11} {"opt state":>11} '
        f'{"tokens/s":>10} {"step s":>8} {"peak GiB":>9} {"MFU":>6}')
  for r in results:
    mfu = f'{r["mfu"]:.1%}' if r['mfu'] else '-'
    print(f'{r["mode"]:6} {r["params"]:>12,} {r["trainable"]:>11,} '
          f'{r["optimizer_state"]:>11,} {r["tokens_per_s"]:>10,.0f} '
          f'{r["step_s"]:>8.3f} {r["peak_memory_gib"]:>9.2f} {mfu:>6}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  main()
