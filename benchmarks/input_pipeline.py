"""Input pipeline throughput: the built-in dataset and a generated 1M-pair TSV.

Prints, for each dataset: time to read the train split, to train the
tokenizer, to pre-tokenise, to the first batch, to resume far into training,
and the steady-state tokens/s delivered (real source + target tokens, padding
excluded) for 'pack' and 'bucket' batching.

  python benchmarks/input_pipeline.py [--tsv_pairs 1000000] [--batches 300]
"""

import argparse
import itertools
import os
import tempfile
import time

import numpy as np

from jaxformer.data import builtin
from jaxformer.data.config import default_data_config
from jaxformer.data import pipeline
from jaxformer.data import sources
from jaxformer.data import tokenizer as tokenizer_lib


def timed(label: str, function, *args, **kwargs):
  start = time.perf_counter()
  result = function(*args, **kwargs)
  print(f'  {label:<40} {time.perf_counter() - start:8.2f} s')
  return result


def real_tokens(batch: dict[str, np.ndarray]) -> int:
  return int(np.count_nonzero(batch['inputs_segment_ids']) +
             np.count_nonzero(batch['targets_segment_ids']))


def measure_stream(data_config, tok, num_batches: int) -> None:
  for batching in ('pack', 'bucket'):
    data_config.batching = batching
    start = time.perf_counter()
    batches = pipeline.train_batches(data_config, tok, tok)
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    tokens = sum(real_tokens(batch) for batch in itertools.islice(batches, num_batches))
    seconds = time.perf_counter() - start
    print(f'  {batching + " first batch":<40} {first:8.2f} s, then '
          f'{num_batches / seconds:.0f} batches/s, {tokens / seconds / 1e6:.2f} M tokens/s')


def measure_resume(data_config, tok, start_step: int) -> None:
  data_config.batching = 'pack'
  start = time.perf_counter()
  next(pipeline.train_batches(data_config, tok, tok, start_step=start_step))
  print(f'  {f"resume at step {start_step:,}":<40} {time.perf_counter() - start:8.2f} s')


def benchmark(name: str, data_config, workdir: str, num_batches: int) -> None:
  print(f'{name}: batch_size={data_config.batch_size}, '
        f'tokens_per_batch={data_config.tokens_per_batch}, '
        f'max lengths {data_config.max_source_length}/{data_config.max_target_length}')
  start = time.perf_counter()
  pairs = sources.read_split(data_config, 'train')
  read_seconds = time.perf_counter() - start
  print(f'  {f"read train split ({len(pairs):,} pairs)":<40} {read_seconds:8.2f} s')
  sample = np.random.default_rng(0).choice(
      len(pairs), data_config.tokenizer.sample_size, replace=False)
  texts = [text for i in sample for text in pairs[i]]
  del pairs
  tok = timed(f'train tokenizer ({len(sample):,} pairs)', tokenizer_lib.train_tokenizer,
              texts, os.path.join(workdir, 'joint'), data_config.tokenizer)
  start = time.perf_counter()
  examples = pipeline.tokenized_split(data_config, 'train', tok, tok)
  tokenize_seconds = time.perf_counter() - start - read_seconds
  num_tokens = examples.source_tokens.size + examples.target_tokens.size
  print(f'  {f"pre-tokenise ({num_tokens:,} tokens)":<40} {tokenize_seconds:8.2f} s')
  measure_stream(data_config, tok, num_batches)
  measure_resume(data_config, tok, start_step=100_000)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--tsv_pairs', type=int, default=1_000_000)
  parser.add_argument('--batches', type=int, default=300)
  args = parser.parse_args()

  with tempfile.TemporaryDirectory() as tmp:
    data_config = default_data_config()
    benchmark('builtin', data_config, os.path.join(tmp, 'builtin'), args.batches)

    tsv_path = os.path.join(tmp, 'train.tsv')
    pairs = timed(f'generate {args.tsv_pairs:,} pairs', builtin.generate,
                  args.tsv_pairs, 1, 'train')
    with open(tsv_path, 'w', encoding='utf-8') as f:
      f.writelines(f'{source}\t{target}\n' for source, target in pairs)
    del pairs
    data_config = default_data_config()
    data_config.source = 'tsv'
    data_config.tsv.train = tsv_path
    benchmark('tsv', data_config, os.path.join(tmp, 'tsv'), args.batches)


if __name__ == '__main__':
  main()
