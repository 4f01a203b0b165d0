"""Runs variants of `configs/tsv_example.py:cpu` on a TSV corpus (e.g. the
one benchmarks/gettext_corpus.py writes) and tabulates them: the steps, the
seconds per step, the dev curve, the final test scores, and each command's
wall minutes with the machine's load average while it ran
(WORKDIR/wall.json). Results: benchmarks/cpu_recipe.md.

  python3 benchmarks/gettext_corpus.py --lang fr --out data/gettext-fr
  python3 benchmarks/cpu_recipe.py --data data/gettext-fr --out runs/recipe \
      --variant recipe= --variant issue_guess=train.schedule=warmup_rsqrt,\
train.schedule_over_budget=false,train.warmup_steps=300,eval.average_last=0

Each variant is `name=key=value,key=value` (overrides of the :cpu config).
--curve then scores every checkpoint the run kept (raise checkpoint.keep
for more points) on the dev split with greedy decoding, after training, so
the curve costs the budget nothing; it writes WORKDIR/curve.json and
WORKDIR/curve.png (dev BLEU and train loss against training minutes).
On a shared machine wall-clock budgets are not comparable: pass
--num_steps to compare variants at a fixed number of steps (the budget is
then switched off and warmup_cosine decays over those steps), and compare
the seconds per step separately. A finished variant is not run again.
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

from jaxformer.run.metrics import read_metrics

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), 'configs', 'tsv_example.py') + ':cpu'


def overrides_of(spec: str) -> tuple[str, list[str]]:
  name, _, rest = spec.partition('=')
  return name, [f'--config.{kv}' for kv in rest.split(',') if kv]


def run_variant(name: str, overrides: list[str], args) -> str:
  workdir = os.path.join(args.out, name)
  if os.path.exists(os.path.join(workdir, 'test_scores.json')):
    return workdir
  data = [f'--config.data.tsv.{split}={os.path.join(args.data, split)}.tsv'
          for split in ('train', 'dev', 'test')]
  fixed = []
  if args.num_steps:
    fixed = [f'--config.train.num_steps={args.num_steps}',
             '--config.train.max_minutes=0',
             '--config.train.schedule_over_budget=false']
  if args.eval_every:
    fixed.append(f'--config.eval.every={args.eval_every}')
  command = ['jaxformer', 'train', '--config', CONFIG, '--workdir', workdir,
             *data, *fixed, *overrides]
  os.makedirs(workdir, exist_ok=True)
  print(' '.join(command), flush=True)
  with open(os.path.join(workdir, 'log.txt'), 'a') as log:
    wall = timed(lambda: subprocess.run(
        command, stdout=log, stderr=subprocess.STDOUT, check=True))
  with open(os.path.join(workdir, 'wall.json'), 'w') as f:
    json.dump(wall, f)
  return workdir


def timed(run, every: float = 10.0) -> dict:
  """Calls `run`; returns its wall minutes and the machine's 1-minute load
  average, sampled every `every` seconds while it ran (mean and maximum):
  on a shared machine the load says what the minutes were worth."""
  samples, done = [os.getloadavg()[0]], threading.Event()

  def sample():
    while not done.wait(every):
      samples.append(os.getloadavg()[0])

  threading.Thread(target=sample, daemon=True).start()
  start = time.monotonic()
  try:
    run()
  finally:
    done.set()
  return {'minutes': round((time.monotonic() - start) / 60, 2),
          'load_mean': round(sum(samples) / len(samples), 1),
          'load_max': round(max(samples), 1)}


def kept_steps(workdir: str) -> list[int]:
  directory = os.path.join(workdir, 'checkpoints')
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def training_minutes(records: list[dict]) -> dict[int, float]:
  """Step -> minutes of training up to it (the sum of the log windows'
  step times: compile included, evaluation and start-up excluded)."""
  minutes, previous, total = {}, 0, 0.0
  for record in records:
    if 'step_time' in record:
      total += record['step_time'] * (record['step'] - previous) / 60
      previous = record['step']
      minutes[record['step']] = total
  return minutes


def dev_curve(workdir: str) -> list[dict]:
  """Dev BLEU/chrF (greedy) of each kept checkpoint, with its minutes."""
  minutes = training_minutes(read_metrics(workdir))
  points = []
  for step in kept_steps(workdir):
    out = subprocess.run(
        ['jaxformer', 'evaluate', '--workdir', workdir, '--checkpoint',
         str(step), '--split', 'dev', '--beam', '1'],
        check=True, capture_output=True, text=True).stdout
    scores = json.loads(out[out.index('{'):])
    points.append({'step': step, 'minutes': round(minutes.get(step, 0), 2),
                   'dev_bleu': round(scores['bleu'], 2),
                   'dev_chrf': round(scores['chrf'], 2)})
    print(json.dumps(points[-1]), flush=True)
  return points


def plot_curve(workdir: str, points: list[dict], out_path: str) -> None:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=import-outside-toplevel
  records = read_metrics(workdir)
  minutes = training_minutes(records)
  train = [(minutes[r['step']], r['loss']) for r in records
           if 'step_time' in r]
  fig, (bleu_ax, loss_ax) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
  bleu_ax.plot([p['minutes'] for p in points],
               [p['dev_bleu'] for p in points], marker='o')
  bleu_ax.set_ylabel('dev BLEU (greedy)')
  loss_ax.plot(*zip(*train))
  loss_ax.set_ylabel('train loss')
  loss_ax.set_xlabel('training minutes')
  for ax in (bleu_ax, loss_ax):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out_path)
  plt.close(fig)


def summary(name: str, workdir: str) -> dict:
  records = read_metrics(workdir)
  train = [r for r in records if 'step_time' in r]
  # The first window holds the compilation.
  times = [r['step_time'] for r in train[1:]] or [float('nan')]
  curve = [(r['step'], round(r['eval_bleu'], 2)) for r in records
           if 'eval_bleu' in r]
  averaged = [r for r in records if 'eval_average_bleu' in r]
  dev_loss = [r['eval_loss'] for r in records if 'eval_loss' in r]
  scores_path = os.path.join(workdir, 'test_scores.json')
  scores = json.load(open(scores_path)) if os.path.exists(scores_path) else {}
  wall_path = os.path.join(workdir, 'wall.json')
  wall = json.load(open(wall_path)) if os.path.exists(wall_path) else {}
  return {'variant': name, 'steps': train[-1]['step'] if train else 0,
          'seconds_per_step': round(sorted(times)[len(times) // 2], 3),
          'final_loss': round(train[-1]['loss'], 3) if train else None,
          'dev_loss': round(dev_loss[-1], 3) if dev_loss else None,
          'dev_bleu_curve': curve,
          'dev_bleu_averaged': (round(averaged[-1]['eval_average_bleu'], 2)
                                if averaged else None),
          'test_bleu': round(scores.get('bleu', float('nan')), 2),
          'test_chrf': round(scores.get('chrf', float('nan')), 2), **wall}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--data', required=True,
                      help='directory with train.tsv, dev.tsv, test.tsv')
  parser.add_argument('--out', required=True, help='one workdir per variant')
  parser.add_argument('--variant', action='append', required=True,
                      help='name=key=value,key=value')
  parser.add_argument('--num_steps', type=int, default=0,
                      help='> 0: a fixed step count instead of the budget')
  parser.add_argument('--eval_every', type=int, default=0,
                      help='> 0: dev BLEU every that many steps (a curve)')
  parser.add_argument('--curve', action='store_true',
                      help='after training, dev BLEU of every kept '
                      'checkpoint')
  args = parser.parse_args(argv)
  rows = []
  for spec in args.variant:
    name, overrides = overrides_of(spec)
    workdir = run_variant(name, overrides, args)
    rows.append(summary(name, workdir))
    if args.curve:
      points = dev_curve(workdir)
      with open(os.path.join(workdir, 'curve.json'), 'w') as f:
        json.dump(points, f, indent=1)
      plot_curve(workdir, points, os.path.join(workdir, 'curve.png'))
      rows[-1]['dev_curve'] = [(p['minutes'], p['dev_bleu']) for p in points]
    print(json.dumps(rows[-1]), flush=True)
  with open(os.path.join(args.out, 'summary.jsonl'), 'a') as f:
    for row in rows:
      f.write(json.dumps(row) + '\n')
  return 0


if __name__ == '__main__':
  sys.exit(main())
