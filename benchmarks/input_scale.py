"""The row tasks' input at scale (data/token_shards.py): a language model's
one-document-a-line text of --mb megabytes, tokenized into the token cache,
then served as packed rows.

Each phase runs in its own process, so that its peak memory is its own:
  tokenize x1  one process tokenizes every piece (--workers local workers):
               wall time, MB/s, peak resident memory;
  tokenize x2  two processes at once, process_index 0 and 1 of 2 (as two
               hosts of a run), into another cache: wall time, MB/s, the
               peak memory of each; the caches' bytes are compared;
  serve        a fresh process, as a run (or a resumed run) starts on the
               committed cache: start-up (to its first batch at
               --resume_step), then tokens/s of --steps batches of --batch
               rows of --width tokens, and peak memory.

  python benchmarks/input_scale.py --mb 4 --workdir /tmp/input_scale
  python benchmarks/input_scale.py --mb 1024 --workdir /data/scale

The text is the built-in sentences, 1 to 8 to a line (about 40 to 400
bytes a document). Peak memory is ru_maxrss (it counts the memory-mapped
token pages a process touched). Other work on the machine slows every
phase; say so beside the figures.
"""
import argparse
import filecmp
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _peak_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_corpus(path: str, megabytes: float, seed: int = 0) -> int:
  """Writes about `megabytes` MB of one-document-a-line text; its bytes."""
  from jaxformer.data import builtin
  sentences = [s for s, _ in builtin.generate(20_000, seed, 'train')]
  rng = np.random.default_rng(seed)
  target, written = int(megabytes * (1 << 20)), 0
  with open(path, 'w', encoding='utf-8') as f:
    while written < target:
      picks = rng.integers(0, len(sentences), (4096, 8))
      counts = rng.integers(1, 9, 4096)
      block = ''.join(' '.join(sentences[i] for i in row[:n]) + '\n'
                      for row, n in zip(picks, counts))
      f.write(block)
      written += len(block.encode())
  return written


def _config(args, cache: str):
  import ml_collections
  from jaxformer.data.defaults import default_data_config
  config = ml_collections.ConfigDict(dict(
      task='language_model', model={}, init={}, data=default_data_config()))
  data = config.data
  data.source, data.text.train = 'text', os.path.join(args.workdir, 'lm.txt')
  data.update(max_target_length=args.width, batch_size=args.batch,
              token_cache_dir=cache, tokenize_workers=args.workers,
              token_cache_piece_bytes=args.piece_mb << 20)
  return config


def _tokenizer(args):
  from jaxformer.data import tokenizer as tokenizer_lib
  with open(os.path.join(args.workdir, 'joint.model'), 'rb') as f:
    return tokenizer_lib.Tokenizer.from_serialized(f.read())


def phase_tokenize(args) -> dict:
  from jaxformer.data import row_layouts
  config = _config(args, args.cache)
  start = time.perf_counter()
  row_layouts.open_split(config.data, 'train', row_layouts.ENCODINGS[
      'lm_packed'], _tokenizer(args), args.cache,
                         process_index=args.process_index,
                         process_count=args.process_count)
  return dict(seconds=time.perf_counter() - start, peak_mb=_peak_mb())


def phase_serve(args) -> dict:
  from jaxformer.data import task_batches
  config = _config(args, args.cache)
  start = time.perf_counter()
  batches = task_batches.train_batches(
      config, _tokenizer(args), None, start_step=args.resume_step,
      token_cache=args.cache)
  next(batches)
  startup = time.perf_counter() - start
  start, tokens = time.perf_counter(), 0
  for _ in range(args.steps):
    tokens += int((next(batches)['targets_segment_ids'] > 0).sum())
  seconds = time.perf_counter() - start
  return dict(startup_seconds=startup, tokens_per_second=tokens / seconds,
              peak_mb=_peak_mb())


def _phase(args, phase: str, **extra) -> subprocess.Popen:
  flags = [f'--{key}={value}' for key, value in extra.items()]
  command = [sys.executable, __file__, f'--phase={phase}',
             f'--workdir={args.workdir}', f'--width={args.width}',
             f'--batch={args.batch}', f'--steps={args.steps}',
             f'--workers={args.workers}', f'--piece_mb={args.piece_mb}',
             f'--resume_step={args.resume_step}', *flags]
  return subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                          env={**os.environ, 'PYTHONPATH': ROOT})


def _result(process: subprocess.Popen) -> dict:
  out, _ = process.communicate()
  if process.returncode:
    raise SystemExit(f'a phase failed (exit {process.returncode})')
  return json.loads(out.strip().splitlines()[-1])


def _same_cache(one: str, two: str) -> bool:
  (a,), (b,) = os.listdir(one), os.listdir(two)
  names = sorted(os.listdir(os.path.join(one, a)))
  return names == sorted(os.listdir(os.path.join(two, b))) and all(
      filecmp.cmp(os.path.join(one, a, n), os.path.join(two, b, n),
                  shallow=False) for n in names)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--mb', type=float, default=4)
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--width', type=int, default=512)
  parser.add_argument('--batch', type=int, default=16)
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--resume_step', type=int, default=1000)
  parser.add_argument('--workers', type=int, default=1)
  parser.add_argument('--piece_mb', type=int, default=16)
  parser.add_argument('--phase', default='')
  parser.add_argument('--cache', default='')
  parser.add_argument('--process_index', type=int, default=0)
  parser.add_argument('--process_count', type=int, default=1)
  args = parser.parse_args(argv)
  if args.phase:
    phase = phase_tokenize if args.phase == 'tokenize' else phase_serve
    print(json.dumps(phase(args)))
    return
  os.makedirs(args.workdir, exist_ok=True)
  corpus = os.path.join(args.workdir, 'lm.txt')
  megabytes = write_corpus(corpus, args.mb) / (1 << 20)
  from jaxformer.data import tokenizer as tokenizer_lib
  from jaxformer.data.defaults import default_data_config
  with open(corpus, encoding='utf-8') as f:
    sample = [next(f).rstrip('\n') for _ in range(5000)]
  settings = default_data_config().tokenizer
  settings.vocab_size = 400  # The built-in sentences allow at most ~470.
  tokenizer_lib.train_tokenizer(sample, os.path.join(args.workdir, 'joint'),
                                settings)
  caches = [os.path.join(args.workdir, name) for name in ('cache1', 'cache2')]
  for cache in caches:
    subprocess.run(['rm', '-rf', cache], check=True)
  print(f'text: {megabytes:.1f} MB ({corpus})')
  one = _result(_phase(args, 'tokenize', cache=caches[0]))
  print(f'tokenize x1: {one["seconds"]:.1f} s, '
        f'{megabytes / one["seconds"]:.2f} MB/s, peak {one["peak_mb"]:.0f} MB')
  start = time.perf_counter()
  # Process 1 first: process 0 waits for its pieces, then commits.
  two = [_phase(args, 'tokenize', cache=caches[1], process_index=index,
                process_count=2) for index in (1, 0)]
  results = [_result(process) for process in two]
  seconds = time.perf_counter() - start
  print(f'tokenize x2: {seconds:.1f} s, {megabytes / seconds:.2f} MB/s '
        f'({megabytes / seconds / 2:.2f} per process), peak '
        f'{max(r["peak_mb"] for r in results):.0f} MB; same bytes as x1: '
        f'{_same_cache(*caches)}')
  served = _result(_phase(args, 'serve', cache=caches[0]))
  print(f'serve: start-up {served["startup_seconds"]:.2f} s (first batch at '
        f'step {args.resume_step}), {served["tokens_per_second"]:,.0f} '
        f'tokens/s, peak {served["peak_mb"]:.0f} MB')


if __name__ == '__main__':
  main()
