"""Where training metrics go: DIR/metrics.jsonl (one JSON object per line),
TensorBoard events under DIR/tensorboard, and the terminal. DIR may be local
or on cloud storage (see jaxformer.storage.paths). On cloud storage each file is a
series of objects appended to (`paths.AppendableFile`: metrics.jsonl.00000,
...; TensorBoard reads the event parts of a directory in name order), read
back as one stream by `read_metrics`."""
import json
import socket
import struct
import sys
import time

import google_crc32c
import numpy as np

from jaxformer.storage import paths


class EventFile:
  """A TensorBoard event file of scalars: TFRecords of TensorFlow's `Event`
  protos, written through jaxformer.storage.paths.

  TensorFlow is already imported by the commands that train (tf.data);
  tensorboardX, which wrote these before, imported torch at start-up where
  it is installed (1.2 s of every training process)."""

  def __init__(self, directory: str):
    from tensorflow.core.framework import summary_pb2
    from tensorflow.core.util import event_pb2
    self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
    # Zero-padded, so that a restart within the same second sorts after
    # the part before it (TensorBoard reads the parts in name order).
    now = time.time_ns()
    name = (f'events.out.tfevents.{now // 10**9:010d}.'
            f'{socket.gethostname()}.{now % 10**9:09d}')
    self._file = paths.AppendableFile(paths.join(directory, name))
    self._write(event_pb2.Event(wall_time=time.time(),
                                file_version='brain.Event:2'))

  def scalars(self, step: int, values: dict[str, float]) -> None:
    summary = self._summary_pb2.Summary(value=[
        self._summary_pb2.Summary.Value(tag=key, simple_value=float(value))
        for key, value in values.items()])
    self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                      summary=summary))

  def _write(self, event) -> None:
    data = event.SerializeToString()
    header = struct.pack('<Q', len(data))
    self._file.append(header + struct.pack('<I', masked_crc32c(header))
                      + data + struct.pack('<I', masked_crc32c(data)))

  def close(self) -> None:
    self._file.close()


def masked_crc32c(data: bytes) -> int:
  """The CRC-32C of `data`, masked as TFRecord files store it."""
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + 0xa282ead8) & 0xffffffff


class MetricsWriter:
  """Writes on the main process only; a no-op elsewhere."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      self._jsonl = paths.AppendableFile(metrics_path(workdir))
      self._tensorboard = EventFile(paths.join(workdir, 'tensorboard'))

  def write(self, step: int, metrics: dict, prefix: str = '') -> None:
    if not self.enabled:
      return
    record = {'step': int(step)}
    for key, value in metrics.items():
      value = np.asarray(value)
      if value.ndim == 0:
        record[prefix + key] = float(value)
    self._jsonl.append((json.dumps(record) + '\n').encode())
    self._tensorboard.scalars(
        step, {k: v for k, v in record.items() if k != 'step'})

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tensorboard.close()


def metrics_path(workdir: str) -> str:
  return paths.join(workdir, 'metrics.jsonl')


def has_metrics(workdir: str) -> bool:
  return paths.appended_exists(metrics_path(workdir))


def read_metrics(workdir: str) -> list[dict]:
  """All records of DIR/metrics.jsonl, in order."""
  text = paths.read_appended(metrics_path(workdir)).decode('utf-8')
  return [json.loads(line) for line in text.splitlines() if line.strip()]


class Progress:
  """A tqdm bar on a terminal, plain log lines otherwise."""

  def __init__(self, total: int, initial: int, enabled: bool = True,
               seconds_left=None):
    """seconds_left: () -> the seconds a time budget leaves (None: no
    budget); the ETA is then the sooner of the budget's end and the last
    step's."""
    self.enabled = enabled
    self._seconds_left = seconds_left
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
    if self._seconds_left is not None:
      eta = max(min(eta, self._seconds_left()), 0.0)
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
