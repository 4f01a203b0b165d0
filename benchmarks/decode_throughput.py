"""Decoding throughput of greedy search and beam search on the 'small' model.

Output tokens/s counts the tokens of the returned sentences only (one per
sentence, the best beam), with EOS disabled so that every step runs; compile
time (first call minus a steady-state call) is reported separately. Random
initial parameters: speed barely depends on their values (greedy search on
CPU computes all the logits only at steps where its int8 screen leaves more
than two candidates in some row, `cpu_kernels.screened_argmax`: 1 step in 64
with these parameters). On a single CPU device a batch is decoded as one
part per core, the parts side by side (`cpu_kernels.default_batch_parts`;
`--batch_parts 1` decodes it in one piece). The machine's load average is printed too: on a
shared CPU, wall time depends on it, process CPU time (all threads) much less.

  python benchmarks/decode_throughput.py [--repeats 5] [--batch 8]
      [--batch_parts N] [--json FILE]
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import decode
from jaxformer.model import EncoderDecoder, ModelConfig, cpu_kernels

SMALL = ModelConfig(vocab_size=8000, d_model=256, num_heads=4, d_ff=1024,
                    num_encoder_layers=3, num_decoder_layers=3, max_len=256)
NO_EOS = -1


def random_sources(batch: int, length: int, vocab: int, seed: int = 0):
  """[batch, length] int32 tokens in [2, vocab): no padding, no EOS."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(2, vocab, (batch, length)), jnp.int32)


def timed(fn, repeats: int):
  """(seconds of the first call, median wall seconds and median process CPU
  seconds of `repeats` more calls)."""
  start = time.perf_counter()
  jax.block_until_ready(fn())
  first = time.perf_counter() - start
  wall, cpu = [], []
  for _ in range(repeats):
    start, start_cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(fn())
    wall.append(time.perf_counter() - start)
    cpu.append(time.process_time() - start_cpu)
  return first, float(np.median(wall)), float(np.median(cpu))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--source_len', type=int, default=64)
  parser.add_argument('--output_len', type=int, default=64)
  parser.add_argument('--repeats', type=int, default=5)
  parser.add_argument('--batch_parts', type=int, default=None,
                      help='default: cpu_kernels.default_batch_parts')
  parser.add_argument('--json', help='also write the figures to this file')
  args = parser.parse_args()

  config = SMALL
  inputs = random_sources(args.batch, args.source_len, config.vocab_size)
  params = EncoderDecoder(config).init(jax.random.PRNGKey(0), inputs,
                                       inputs)['params']
  output_tokens = args.batch * args.output_len
  parts = args.batch_parts
  if parts is None:
    parts = cpu_kernels.default_batch_parts(inputs)
  print(f'{jax.devices()[0].platform}: batch {args.batch} in {parts} '
        f'part(s), source {args.source_len}, output {args.output_len} tokens, '
        f'model {config}')

  runs = {
      'greedy': lambda: decode.greedy_decode(
          params, config, inputs, max_decode_len=args.output_len,
          eos_id=NO_EOS, batch_parts=parts),
      'beam 4': lambda: decode.beam_search(
          params, config, inputs, beam_size=4, max_decode_len=args.output_len,
          eos_id=NO_EOS, batch_parts=parts),
  }
  figures = {'device': jax.devices()[0].device_kind, 'batch': args.batch,
             'batch_parts': parts, 'source_len': args.source_len,
             'output_len': args.output_len, 'runs': {}}
  for name, run in runs.items():
    first, wall, cpu = timed(run, args.repeats)
    figures['runs'][name] = {'output_tokens_per_s': output_tokens / wall,
                             'batch_s': wall, 'cpu_s': cpu,
                             'compile_s': first - wall}
    print(f'{name:>7}: {output_tokens / wall:6.0f} output tokens/s '
          f'({wall * 1e3:.0f} ms per batch, {cpu * 1e3:.0f} ms CPU), '
          f'compile {first - wall:.1f} s; load average '
          f'{os.getloadavg()[0]:.1f}')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(figures, f, indent=2)


if __name__ == '__main__':
  main()
