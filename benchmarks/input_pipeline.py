"""Input at scale: tokenise a generated 5M-pair TSV once, then restart from
the token cache.

Prints, each phase in its own process (so that its peak memory is its own):
  generate  a synthetic TSV of --pairs built-in sentence pairs (not timed
            as part of the pipeline);
  tokenizer a joint model trained on a --sample_size sample of it, as a
            run trains it: wall time and peak resident memory;
  tokenise  the train split into the token cache (data/token_cache.py):
            wall time and peak resident memory;
  restart   a fresh process, as a resumed run starts: time to its first
            'pack' batch at --resume_step (the cache is read, not written),
            then batches/s, and peak memory; run as 1 process without the
            stored batch counts of epochs (data/epoch_counts.py: a first
            resume plans every epoch before the step, and stores their
            counts), then with them (as a run that trained up to the step
            left them) as 1 process and as each of 2 processes of one run
            (process_index 0 and 1 at once).

With --workdir naming a folder that already holds train.tsv, the data and
the tokenizer are kept, and 'tokenise' finds the cache: it shows what a
later run on the same data pays.

With a gs:// --workdir (the TSV, tokenizer and token cache all in the
bucket, as on a pod), each restart also prints the storage requests it
made: at start-up (up to its first batch) and per batch of one process
(= per host and step), as the GCS emulator counted them, and the bytes it
copied to local disk (data/token_cache.py copies a remote cache once per
host, into a scratch folder here: the first restart makes the copy, the
later ones find it). --emulator starts one (tests/gcs_emulator.py, in
memory, holding the workdir's bucket); without it, STORAGE_EMULATOR_HOST
must name a running one.

Peak memory is ru_maxrss of the process (it includes the memory-mapped
token pages it touched).  Other work on the machine slows every phase:
The figures in docs/performance.md were taken with nothing else running.

  python benchmarks/input_pipeline.py [--pairs 5000000] [--workdir DIR]
  python benchmarks/input_pipeline.py --pairs 200000 --emulator \
      --workdir gs://bench-bucket/input
"""

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'tests'))
import gcs_emulator  # noqa: E402  (the emulator's request counts)


def data_config(tsv: str):
  from jaxformer.data.defaults import default_data_config
  config = default_data_config()
  config.source = 'tsv'
  config.tsv.train = tsv
  config.tokenizer.vocab_size = 512
  return config


def peak_memory_gib() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def emulator_port() -> int | None:
  """The port of the GCS emulator the storage libraries are pointed at."""
  url = os.environ.get('STORAGE_EMULATOR_HOST', '')
  return int(url.rsplit(':', 1)[1]) if url else None


def requests_served() -> int:
  port = emulator_port()
  return gcs_emulator.stats(port)['requests'] if port else 0


def start_emulator(bucket: str) -> subprocess.Popen:
  """tests/gcs_emulator.py serving `bucket`; points this process (and so
  its phases) at it."""
  process = subprocess.Popen([sys.executable, gcs_emulator.__file__, bucket],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
  port = int(process.stdout.readline().strip().split('=')[1])
  os.environ.update(gcs_emulator.environment(port))
  return process


def generate(tsv: str, num_pairs: int, seed: int = 1) -> None:
  """`num_pairs` built-in sentence pairs (not deduplicated), written in
  chunks (to a local file, then copied when `tsv` is remote)."""
  from jaxformer.storage import paths
  if paths.is_remote(tsv):
    with tempfile.TemporaryDirectory() as scratch:
      local = os.path.join(scratch, 'train.tsv')
      generate(local, num_pairs, seed)
      with open(local, 'rb') as f:
        paths.write_bytes(tsv, f.read())
    return
  from jaxformer.data import builtin
  rng = np.random.default_rng(seed)
  words = [list(builtin.SUBJECTS), list(builtin.VERBS), list(builtin.NOUNS),
           list(builtin.ADJECTIVES) + [None], list(builtin.ADVERBS) + [None]]
  with open(tsv, 'w', encoding='utf-8') as f:
    for start in range(0, num_pairs, 100_000):
      size = min(100_000, num_pairs - start)
      subject, verb, noun, adjective, adverb = (
          [choices[i] for i in rng.integers(0, len(choices), size)]
          for choices in words)
      numbers = rng.integers(builtin.MIN_NUMBER, builtin.MAX_NUMBER + 1, size)
      pairs = map(builtin.sentence_pair, subject, verb, numbers.tolist(), noun,
                  adjective, adverb)
      f.writelines(f'{source}\t{target}\n' for source, target in pairs)


def phase_tokenizer(tsv: str, workdir: str, sample_size: int) -> dict:
  """The run's joint tokenizer, trained as `jaxformer train` does (a seeded
  sample drawn while the TSV is streamed)."""
  from jaxformer.data import tokenizer as tokenizer_lib
  config = data_config(tsv)
  config.tokenizer.sample_size = sample_size
  start = time.perf_counter()
  tokenizer_lib.get_or_train(config, workdir, process_index=0)
  return dict(seconds=time.perf_counter() - start, peak_gib=peak_memory_gib())


def phase_tokenise(tsv: str, workdir: str) -> dict:
  from jaxformer.data import token_cache
  from jaxformer.data import tokenizer as tokenizer_lib
  config = data_config(tsv)
  tok = tokenizer_lib.load_tokenizer(tokenizer_path(workdir))
  start = time.perf_counter()
  examples = token_cache.tokenized_split(
      config, 'train', tok, tok, token_cache.directory(config, workdir))
  seconds = time.perf_counter() - start
  usage = resource.getrusage(resource.RUSAGE_SELF)
  tokens = int(examples.source_lengths.sum() + examples.target_lengths.sum())
  return dict(seconds=seconds, cpu_seconds=usage.ru_utime + usage.ru_stime,
              examples=examples.num_examples, tokens=tokens,
              peak_gib=peak_memory_gib())


def tokenizer_path(workdir: str) -> str:
  from jaxformer.storage import paths
  return paths.join(workdir, 'tokenizer', 'joint.model')


def phase_restart(tsv: str, workdir: str, resume_step: int, batches: int,
                  process_index: int, process_count: int) -> dict:
  start = time.perf_counter()
  requests = requests_served()
  from jaxformer.data import pipeline
  from jaxformer.data import token_cache
  from jaxformer.data import tokenizer as tokenizer_lib
  imported = time.perf_counter() - start
  config = data_config(tsv)
  tok = tokenizer_lib.load_tokenizer(tokenizer_path(workdir))
  cache = token_cache.directory(config, workdir)
  result = dict(import_seconds=imported)
  copied = local_bytes()
  start = time.perf_counter()
  stream = pipeline.translation_train_batches(
      config, tok, tok, start_step=resume_step, process_index=process_index,
      process_count=process_count, token_cache=cache)
  next(stream)
  result['first_batch_seconds'] = time.perf_counter() - start
  result['startup_requests'] = requests_served() - requests
  result['copied_bytes'] = local_bytes() - copied
  requests = requests_served()
  examples = 0
  start = time.perf_counter()
  for _ in range(batches):
    batch = next(stream)
    examples += int(((batch['inputs_positions'] == 0) & (batch['inputs'] != 0)
                     ).sum())
  result['batches_per_second'] = batches / (time.perf_counter() - start)
  result['requests_per_batch'] = (requests_served() - requests) / batches
  result['examples_per_batch'] = examples / batches
  result['peak_gib'] = peak_memory_gib()
  return result


def remove(path: str) -> None:
  from jaxformer.storage import paths
  if paths.is_remote(path):
    import fsspec
    filesystem, name = fsspec.core.url_to_fs(path)
    filesystem.rm(name)
  else:
    os.remove(path)


def local_bytes() -> int:
  """Bytes in the host's copies of remote token caches."""
  from jaxformer.data import token_cache
  return sum(entry.stat().st_size for folder, _, names in
             os.walk(token_cache.local_root()) for entry in
             map(lambda name, folder=folder: pathlib.Path(folder, name), names))


def in_subprocess(*arguments: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, __file__, *arguments],
                          stdout=subprocess.PIPE, text=True)


def result_of(process: subprocess.Popen) -> dict:
  output, _ = process.communicate()
  if process.returncode:
    sys.exit(f'a benchmark phase failed (exit {process.returncode})')
  return json.loads(output.strip().splitlines()[-1])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--pairs', type=int, default=5_000_000)
  parser.add_argument('--sample_size', type=int, default=20_000)
  parser.add_argument('--resume_step', type=int, default=100_000)
  parser.add_argument('--batches', type=int, default=200)
  parser.add_argument('--workdir', default='', help='kept if given; may be '
                      'gs://...')
  parser.add_argument('--emulator', action='store_true', help='serve the '
                      "gs:// workdir's bucket from tests/gcs_emulator.py")
  parser.add_argument('--phase', default='', help=argparse.SUPPRESS)
  parser.add_argument('--process', type=int, nargs=2, default=(0, 1),
                      help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.phase:  # One phase, in a subprocess started below.
    from jaxformer.storage import paths
    tsv = paths.join(args.workdir, 'train.tsv')
    if args.phase == 'tokenizer':
      result = phase_tokenizer(tsv, args.workdir, args.sample_size)
    elif args.phase == 'tokenise':
      result = phase_tokenise(tsv, args.workdir)
    else:
      result = phase_restart(tsv, args.workdir, args.resume_step, args.batches,
                             *args.process)
    print(json.dumps(result))
    return

  from jaxformer.storage import paths
  emulator = None
  if args.emulator:
    if not paths.is_remote(args.workdir):
      sys.exit('--emulator needs a gs:// --workdir')
    emulator = start_emulator(paths.bucket(args.workdir).split('://')[1])
  try:
    run(args)
  finally:
    if emulator is not None:
      emulator.terminate()
      emulator.wait()


def run(args) -> None:
  from jaxformer.storage import paths
  remote = paths.is_remote(args.workdir)
  if remote and not emulator_port():
    sys.exit('a gs:// --workdir is measured against the GCS emulator: pass '
             '--emulator, or set STORAGE_EMULATOR_HOST to a running one')
  with tempfile.TemporaryDirectory() as scratch:
    workdir = args.workdir or scratch
    # The host's copies of a remote cache: the tokenise phase's apart, so
    # that the first restart makes its own (and reports its cost).
    os.environ['JAXFORMER_TOKEN_CACHE_LOCAL'] = os.path.join(scratch,
                                                             'tokenise_host')
    paths.make_dirs(workdir)
    tsv = paths.join(workdir, 'train.tsv')
    if paths.exists(tsv):
      print(f'kept {tsv} and its tokenizer')
    else:
      start = time.perf_counter()
      generate(tsv, args.pairs)
      print(f'generate {args.pairs:,} pairs ({paths.stat(tsv)[0] / 2**20:.0f} '
            f'MiB TSV): {time.perf_counter() - start:.1f} s')
      trained = result_of(in_subprocess(
          '--phase', 'tokenizer', '--workdir', workdir, '--sample_size',
          str(args.sample_size)))
      print(f'train the tokenizer on {args.sample_size:,} pairs: '
            f'{trained["seconds"]:.1f} s, peak memory '
            f'{trained["peak_gib"]:.2f} GiB')
    common = ['--workdir', workdir, '--resume_step', str(args.resume_step),
              '--batches', str(args.batches)]
    tokenised = result_of(in_subprocess('--phase', 'tokenise', *common))
    os.environ['JAXFORMER_TOKEN_CACHE_LOCAL'] = os.path.join(scratch,
                                                             'restart_host')
    print(f'tokenise once into the cache (or find it): '
          f'{tokenised["seconds"]:.1f} s for '
          f'{tokenised["examples"]:,} pairs, {tokenised["tokens"]:,} tokens '
          f'({tokenised["examples"] / tokenised["seconds"]:,.0f} pairs/s; '
          f'{tokenised["cpu_seconds"]:.0f} s of CPU time in all), peak memory '
          f'{tokenised["peak_gib"]:.2f} GiB')
    cache = paths.join(workdir, 'tokenizer', 'token_cache')
    for folder in paths.list_dir(cache):
      for name in paths.list_dir(paths.join(cache, folder)):
        if folder.startswith('train-') and name.startswith('epochs-'):
          remove(paths.join(cache, folder, name))
    for count, counts in ((1, 'not stored'), (1, 'stored'), (2, 'stored')):
      runs = [in_subprocess('--phase', 'restart', '--process', str(i),
                            str(count), *common) for i in range(count)]
      for index, run in enumerate(runs):
        r = result_of(run)
        print(f'restart, epoch counts {counts}, process {index} of {count}: '
              f'imports '
              f'{r["import_seconds"]:.1f} s, first batch (step '
              f'{args.resume_step:,}) {r["first_batch_seconds"]:.1f} s, then '
              f'{r["batches_per_second"]:.3g} batches/s, peak memory '
              f'{r["peak_gib"]:.2f} GiB')
        if remote:
          print(f'  storage requests{" (all processes)" * (count > 1)}: '
                f'{r["startup_requests"]:,} up to the first batch '
                f'(copied {r["copied_bytes"] / 2**20:.1f} MiB to local '
                f'disk), then {r["requests_per_batch"]:.1f} per batch '
                f'({r["examples_per_batch"]:.0f} examples a batch)')
    print('(measured on a shared machine: the speeds are lower bounds, the '
          'times upper bounds, of what an idle one does)')


if __name__ == '__main__':
  main()
