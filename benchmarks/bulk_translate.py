"""Bulk translation (or, with `--command generate`, generation) on this
machine: `jaxformer translate --input FILE --output OUT` as 1, 2 and 4
processes (launch/local.sh, `--devices` fake CPU devices each), one layout
after another on the same input, in rounds that alternate the layouts;
prints a table of lines/s and checks that every layout wrote the same
bytes.

Two rates per layout (medians over the rounds): `decode`, the one the
command's last line reports (from the end of its start-up to the output
written, compiling included), and `wall`, the whole command's (process
start, JAX, the model's restore, reading the input twice). The machine's
load average is printed before and after: on a shared CPU the figures
depend on it, and N processes on C < N cores share them.

A quick-start model is trained first (`runlocal`, `--steps` steps: it
translates badly, at varied lengths; for generate, `lm_quick.py:runlocal`),
unless `--workdir` names a trained run; the input is the built-in corpus's
sentences (for generate, their first 0 to 7 words, continued by sampling
with `--max_new_tokens`).

  python benchmarks/bulk_translate.py [--command translate|generate]
      [--workdir RUN] [--lines 2000] [--processes 1,2,4] [--devices 1]
      [--beam 1] [--max_new_tokens 16] [--batch_size 32]
      [--chunk_batches 4] [--rounds 1]
"""
import argparse
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
FINAL = (r'{}: ([\d,]+)/[\d,]+ lines \(100%\), ([\d.]+) lines/s, ([\d,]+) '
         r'tokens/s, in ([\d.]+) s')
CONFIGS = {'translate': 'quickstart.py:runlocal',
           'generate': 'lm_quick.py:runlocal'}


def jaxformer(*args) -> list[str]:
  return [sys.executable, '-m', 'jaxformer', *args]


def train(workdir: str, steps: int, command: str) -> None:
  subprocess.run(jaxformer(
      'train', '--config', f'{REPO}/configs/{CONFIGS[command]}',
      '--workdir', workdir, f'--config.train.num_steps={steps}',
      '--config.eval.every=0', '--config.eval.final_split=',
      '--config.eval.bleu_examples=0', '--config.train.peak_flops=1e9',
      f'--config.checkpoint.every={steps}'), check=True,
      stdout=subprocess.DEVNULL, env=environment())


def environment() -> dict:
  return dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS='cpu',
              JAXFORMER_COMPILATION_CACHE='off')


def write_input(path: pathlib.Path, lines: int, command: str) -> None:
  """Sentences to translate, or prompts of their first 0 to 7 words."""
  sys.path.insert(0, str(REPO))
  from jaxformer.data import builtin
  texts = [source for source, _ in builtin.generate(lines, 11, 'test')]
  if command == 'generate':
    texts = [' '.join(t.split()[:i % 8]) for i, t in enumerate(texts)]
  path.write_text(''.join(text + '\n' for text in texts))


def decode(command: str, workdir: str, source, out, processes: int,
           devices: int, flags) -> dict:
  """One run: its rates, tokens/s and output bytes."""
  start = time.monotonic()
  result = subprocess.run(
      [str(REPO / 'launch' / 'local.sh'), '--processes', str(processes),
       '--devices', str(devices), '--', *jaxformer(
           command, '--workdir', workdir, '--input', str(source),
           '--output', str(out), *flags)],
      capture_output=True, text=True, env=environment())
  wall = time.monotonic() - start
  if result.returncode:
    sys.exit(f'{processes} x {devices} failed:\n{result.stderr[-3000:]}')
  lines, rate, tokens, _ = re.search(FINAL.format(command),
                                     result.stderr).groups()
  lines = int(lines.replace(',', ''))
  return dict(decode=float(rate), wall=lines / wall,
              tokens=float(tokens.replace(',', '')),
              output=pathlib.Path(out).read_bytes())


def load() -> str:
  return ' '.join(f'{x:.2f}' for x in os.getloadavg())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--command', choices=sorted(CONFIGS),
                      default='translate')
  parser.add_argument('--workdir', help='a trained translation run (for '
                      'generate, a language model run)')
  parser.add_argument('--steps', type=int, default=60)
  parser.add_argument('--lines', type=int, default=2000)
  parser.add_argument('--processes', default='1,2,4')
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--beam', type=int, default=1)
  parser.add_argument('--max_new_tokens', type=int, default=16)
  parser.add_argument('--batch_size', type=int, default=32)
  parser.add_argument('--chunk_batches', type=int, default=4)
  parser.add_argument('--rounds', type=int, default=1)
  args = parser.parse_args()
  layouts = [int(p) for p in args.processes.split(',')]
  flags = ['--batch-size', str(args.batch_size), '--chunk-batches',
           str(args.chunk_batches)]
  flags += (['--beam', str(args.beam)] if args.command == 'translate' else
            ['--max-new-tokens', str(args.max_new_tokens), '--seed', '1'])
  with tempfile.TemporaryDirectory() as scratch:
    scratch = pathlib.Path(scratch)
    workdir = args.workdir or str(scratch / 'model')
    if not args.workdir:
      train(workdir, args.steps, args.command)
    source = scratch / 'input.txt'
    write_input(source, args.lines, args.command)
    what = (f'beam {args.beam}' if args.command == 'translate' else
            f'sampled, {args.max_new_tokens} new tokens at most')
    print(f'{args.command}: {args.lines} lines, {what}, batch '
          f'{args.batch_size}, {args.chunk_batches} batches a chunk; '
          f'{os.cpu_count()} cores, load average {load()}', flush=True)
    runs = {p: [] for p in layouts}
    for round_ in range(args.rounds):
      for processes in layouts:
        runs[processes].append(decode(
            args.command, workdir, source,
            scratch / f'out-{processes}-{round_}.txt',
            processes, args.devices, flags))
  reference = runs[layouts[0]][0]['output']
  print(f'load average after: {load()}\n')
  print('| processes x devices | lines/s (decode) | lines/s (wall) | '
        'tokens/s | same bytes |')
  print('|---|---|---|---|---|')
  for processes, results in runs.items():
    median = {k: statistics.median(r[k] for r in results)
              for k in ('decode', 'wall', 'tokens')}
    same = all(r['output'] == reference for r in results)
    print(f'| {processes} x {args.devices} | {median["decode"]:.1f} | '
          f'{median["wall"]:.1f} | {median["tokens"]:,.0f} | '
          f'{"yes" if same else "NO"} |')


if __name__ == '__main__':
  main()
