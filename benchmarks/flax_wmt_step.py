"""The anchor of train_throughput.py: Flax's WMT example's own train step.

Flax's `models.Transformer` and `train.train_step` (from `examples/wmt` of a
clone of github.com/google/flax), unchanged and pmapped as its train.py does,
on the architecture and batches train_throughput.py gives it.

This file imports nothing of jaxformer, so that run as its own process
(`--serve`, as train_throughput.py does) the step runs as in Flax's own
program, on the process defaults: `import jaxformer` sets the host's malloc
(jaxformer/runtime/host_memory.py), which would speed up Flax's step too.

  python benchmarks/flax_wmt_step.py --serve DIR --model JSON --rows R \
      --source_length S --target_length T

reads one line per step from stdin and answers each with the step's seconds.
"""
import argparse
import ast
import functools
import json
import os
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np


def random_batch(rng, rows, source_length, target_length, vocab):
  """Full-length rows (no padding): every position is a real token."""
  inputs = rng.integers(3, vocab, (rows, source_length), dtype=np.int32)
  targets = rng.integers(3, vocab, (rows, target_length), dtype=np.int32)
  inputs[:, -1] = targets[:, -1] = 1
  return {'inputs': inputs, 'targets': targets}


def batches_for(model: dict, rows: int, source_length: int,
                target_length: int) -> list[dict]:
  """The two batches each benchmarked step trains on in turn."""
  rng = np.random.default_rng(0)
  return [random_batch(rng, rows, source_length, target_length,
                       model['vocab_size']) for _ in range(2)]


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


def flax_wmt_step(flax_wmt: str, model: dict, batches):
  """Flax's WMT example's train step on the architecture `model` (our
  ModelConfig's fields as a dict) and `batches`, set up as its train.py's
  `train_and_evaluate` does (adamw with b2=0.98, eps=1e-9, its rsqrt
  schedule, label smoothing 0.1, pmap over 'batch').

  Returns:
    (step: () -> metrics, compile seconds, parameter count).
  """
  from flax import jax_utils  # pylint: disable=import-outside-toplevel
  from flax.training import common_utils  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  flax_models, flax_train = flax_wmt_train_module(flax_wmt)
  config = flax_models.TransformerConfig(
      vocab_size=model['vocab_size'], output_vocab_size=model['vocab_size'],
      share_embeddings=True, logits_via_embedding=True,
      dtype=jnp.dtype(model['dtype']), emb_dim=model['d_model'],
      num_heads=model['num_heads'], num_layers=model['num_encoder_layers'],
      qkv_dim=model['d_model'], mlp_dim=model['d_ff'],
      max_len=model['max_len'], dropout_rate=0.1, attention_dropout_rate=0.1,
      deterministic=False)
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
  params = sum(x.size for x in jax.tree.leaves(state.params))
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


def serve(args) -> None:
  """Builds the step, says its compile time and size, then times one step
  per line read from stdin."""
  model = json.loads(args.model)
  run, compile_seconds, params = flax_wmt_step(
      args.serve, model, batches_for(model, args.rows, args.source_length,
                                     args.target_length))
  print(json.dumps({'compile_seconds': compile_seconds, 'params': params}),
        flush=True)
  for _ in sys.stdin:
    start = time.perf_counter()
    jax.block_until_ready(run())
    print(time.perf_counter() - start, flush=True)


class StepProcess:
  """Flax's step in a process of its own (`serve`): calling it runs one step
  there and returns its seconds; nothing runs there between calls."""

  def __init__(self, flax_wmt: str, model: dict, rows: int,
               source_length: int, target_length: int):
    import subprocess  # pylint: disable=import-outside-toplevel
    self.process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), '--serve', flax_wmt,
         '--model', json.dumps(model), '--rows', str(rows),
         '--source_length', str(source_length),
         '--target_length', str(target_length)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    first = self.process.stdout.readline()
    if not first:
      raise SystemExit(f'the Flax step process ({flax_wmt}) failed to start; '
                       'its error is above.')
    info = json.loads(first)
    self.compile_seconds, self.params = info['compile_seconds'], info['params']

  def __call__(self) -> float:
    self.process.stdin.write('step\n')
    self.process.stdin.flush()
    return float(self.process.stdout.readline())

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait()


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--serve', required=True,
                      help="Flax's examples/wmt directory")
  parser.add_argument('--model', required=True, help='the model, as JSON')
  parser.add_argument('--rows', type=int, required=True)
  parser.add_argument('--source_length', type=int, required=True)
  parser.add_argument('--target_length', type=int, required=True)
  serve(parser.parse_args())


if __name__ == '__main__':
  if 'jaxformer' in sys.modules:
    raise SystemExit('flax_wmt_step.py must not run with jaxformer imported.')
  main()
