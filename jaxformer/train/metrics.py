"""Where training metrics go: DIR/metrics.jsonl (one JSON object per line),
TensorBoard under DIR/tensorboard, and the terminal."""
import json
import os
import sys
import time

import numpy as np


class MetricsWriter:
  """Writes on the main process only; a no-op elsewhere."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    self._tensorboard = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a')
      from tensorboardX import SummaryWriter
      self._tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict, prefix: str = '') -> None:
    if not self.enabled:
      return
    record = {'step': int(step)}
    for key, value in metrics.items():
      value = np.asarray(value)
      if value.ndim == 0:
        record[prefix + key] = float(value)
    self._jsonl.write(json.dumps(record) + '\n')
    self._jsonl.flush()
    for key, value in record.items():
      if key != 'step':
        self._tensorboard.add_scalar(key, value, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tensorboard.close()


def read_metrics(workdir: str) -> list[dict]:
  """All records of DIR/metrics.jsonl, in order."""
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]


class Progress:
  """A tqdm bar on a terminal, plain log lines otherwise."""

  def __init__(self, total: int, initial: int, enabled: bool = True):
    self.enabled = enabled
    self._bar = None
    self._start = time.time()
    self._initial, self._total = initial, total
    if enabled and sys.stderr.isatty():
      from tqdm import tqdm
      self._bar = tqdm(total=total, initial=initial, unit='step',
                       dynamic_ncols=True)

  def update(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    shown = {k: metrics[k] for k in ('loss', 'tokens_per_second')
             if k in metrics}
    if self._bar is not None:
      self._bar.n = step
      self._bar.set_postfix({k: f'{v:.4g}' for k, v in shown.items()})
      return
    elapsed = time.time() - self._start
    done = max(step - self._initial, 1)
    eta = elapsed / done * (self._total - step)
    text = ' '.join(f'{k}={v:.4g}' for k, v in shown.items())
    print(f'step {step}/{self._total} {text} eta={eta:.0f}s', flush=True)

  def log(self, text: str) -> None:
    if not self.enabled:
      return
    if self._bar is not None:
      self._bar.write(text)
    else:
      print(text, flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
