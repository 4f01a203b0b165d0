"""The cost of terminology constraints: lexically constrained beam search
(`translate --constraints`, `inference/constrained.py`) beside plain beam
search on the same random-weight model, sources and beam.

Each sentence gets 1-3 random phrases of 1-3 tokens. Both searches run
every step (EOS disabled: eos_id=-1 for plain beam search, and the
constrained search is given an EOS id no token has), so the work per step
is what differs: the extra candidates (each phrase's next token and each
hypothesis's own best) and the bank allocation over them. Rounds alternate
between the two in one process; medians are printed with the ratio, and
the machine's load average (on a shared CPU, wall time depends on it).
Compilation (the first call of each) is left out.

  python benchmarks/constrained_beam.py [--batch 32] [--source_len 24]
      [--decode_len 48] [--beam 4] [--rounds 5] [--d_model 256]
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.inference import beam_search, constrained
from jaxformer.model import EncoderDecoder, ModelConfig


def random_phrases(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
  rng = np.random.default_rng(seed)
  phrases = np.full((rows, 4, 4), -1, np.int32)
  for r in range(rows):
    for c in range(rng.integers(1, 4)):
      n = rng.integers(1, 4)
      phrases[r, c, :n] = rng.integers(4, vocab, n)
  return phrases


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--source_len', type=int, default=24)
  parser.add_argument('--decode_len', type=int, default=48)
  parser.add_argument('--beam', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--d_model', type=int, default=256)
  parser.add_argument('--vocab', type=int, default=8000)
  args = parser.parse_args()
  config = ModelConfig(vocab_size=args.vocab, d_model=args.d_model,
                       num_heads=4, d_ff=4 * args.d_model,
                       num_encoder_layers=3, num_decoder_layers=3,
                       max_len=max(args.source_len, args.decode_len))
  dummy = jnp.ones((1, 4), jnp.int32)
  params = meta.unbox(EncoderDecoder(config).init(
      jax.random.PRNGKey(0), dummy, dummy)['params'])
  rng = np.random.default_rng(0)
  inputs = rng.integers(4, args.vocab, (args.batch, args.source_len),
                        dtype=np.int32)
  phrases = random_phrases(args.batch, args.vocab)
  no_token = args.vocab + 1  # An EOS id no token has: every step runs.
  searches = {
      'beam': lambda: beam_search.beam_search(
          params, config, inputs, beam_size=args.beam, alpha=0.6,
          max_decode_len=args.decode_len, eos_id=-1, batch_parts=1),
      'constrained': lambda: constrained.constrained_beam_search(
          params, config, inputs, phrases, beam_size=args.beam, alpha=0.6,
          max_decode_len=args.decode_len, eos_id=no_token),
  }
  for run in searches.values():
    jax.block_until_ready(run())  # Compile.
  times = {name: [] for name in searches}
  for _ in range(args.rounds):
    for name, run in searches.items():
      start = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - start)
  medians = {name: float(np.median(t)) for name, t in times.items()}
  print(json.dumps(dict(
      batch=args.batch, beam=args.beam, decode_len=args.decode_len,
      d_model=args.d_model, vocab=args.vocab,
      seconds=medians, slowdown=medians['constrained'] / medians['beam'],
      load_average=os.getloadavg()[0]), indent=2))


if __name__ == '__main__':
  main()
