"""How many batches each training epoch has, stored beside the token cache.

With 'pack' batching the number of batches of epoch e is known only from
that epoch's packing plan, so a run resumed at step k would plan every
epoch before k to find where k falls (seconds per epoch for millions of
examples).  The counts are a pure function of the examples' lengths (in
split order), the batching settings, the seed and the planning code, so
they are kept once computed, in the split's token cache folder:

  <split>-<key>/epochs-<settings hash>.json
      {"format": 1, "settings": {...}, "counts": [c0, c1, ...],
       "sha256": <hash of settings and counts>}

`settings` holds everything the counts depend on (with a digest of the
lengths and TensorFlow's version, whose shuffle the plans use): another
batching, seed or data never reads these counts.  Only process 0 writes;
each write replaces the file whole (paths.write_text), so a reader sees
a committed list or the one before.  A file that does not parse, does not
match its settings or checksum, or holds a count no plan of these lengths
can have is ignored, and the counts are computed again; nothing waits for
the file, so a process that finds none computes what it needs itself.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading

import numpy as np

from jaxformer.storage import paths

FORMAT = 1


def packing(data_config, folder: str, source_lengths: np.ndarray,
            target_lengths: np.ndarray, planner_version: str, writer: bool
            ) -> EpochCounts:
  """The counts of 'pack' epochs of these training examples (see
  `settings_of`), stored in the token cache folder `folder`."""
  return EpochCounts(
      folder, settings_of(data_config, source_lengths, target_lengths,
                          planner_version),
      count_bounds(data_config, source_lengths, target_lengths), writer)


def settings_of(data_config, source_lengths: np.ndarray,
                target_lengths: np.ndarray, planner_version: str) -> dict:
  """What the 'pack' counts of epochs depend on, as a JSON-able dict.

  Args:
    source_lengths, target_lengths: [examples] int32, the training examples
      in split order (after dropping those over the max lengths).
    planner_version: names the planning code (e.g. TensorFlow's version).
  """
  lengths = hashlib.sha256(np.ascontiguousarray(source_lengths, np.int32))
  lengths.update(np.ascontiguousarray(target_lengths, np.int32))
  return dict(format=FORMAT, batching='pack',
              max_source_length=int(data_config.max_source_length),
              max_target_length=int(data_config.max_target_length),
              batch_size=int(data_config.batch_size),
              seed=int(data_config.seed),
              shuffle=bool(data_config.shuffle_buffer > 0),
              examples=len(source_lengths), lengths_sha256=lengths.hexdigest(),
              planner=planner_version)


def count_bounds(data_config, source_lengths: np.ndarray,
                 target_lengths: np.ndarray) -> tuple[int, int]:
  """(fewest, most) batches any 'pack' epoch of these examples can have:
  rows hold at least one example and at most a row's width of tokens."""
  batch_size = data_config.batch_size
  fewest_rows = max(-(-int(source_lengths.sum()) // data_config.max_source_length),
                    -(-int(target_lengths.sum()) // data_config.max_target_length))
  return (-(-fewest_rows // batch_size),
          -(-len(source_lengths) // batch_size))


def file_name(settings: dict) -> str:
  return f'epochs-{_checksum(settings, [])[:16]}.json'


def _checksum(settings: dict, counts: list[int]) -> str:
  return hashlib.sha256(json.dumps([settings, counts], sort_keys=True)
                        .encode()).hexdigest()


class EpochCounts:
  """The known batch counts of epochs 0, 1, ... of one batching of a split.

  `folder` is the split's token cache folder (None: nothing is stored);
  only the `writer` (process 0) writes the file.  Safe to use from
  tf.data's threads.
  """

  def __init__(self, folder: str | None, settings: dict,
               bounds: tuple[int, int], writer: bool):
    self.settings, self.bounds, self.writer = settings, bounds, writer
    self.path = None if folder is None else paths.join(
        folder, file_name(settings))
    self._lock = threading.Lock()
    self.counts = self._read() if self.path else []

  def _read(self) -> list[int]:
    """The stored counts, or [] when there are none that can be trusted."""
    if not paths.exists(self.path):
      return []
    try:
      stored = json.loads(paths.read_text(self.path))
      counts = stored['counts']
      low, high = self.bounds
      if (stored['settings'] == self.settings and
          stored['sha256'] == _checksum(self.settings, counts) and
          all(type(c) is int and low <= c <= high for c in counts)):
        return counts
    except (ValueError, KeyError, TypeError, OSError):
      pass
    logging.warning('%s: not a valid list of epoch batch counts for this '
                    'data and batching; computing them again', self.path)
    return []

  def known(self) -> list[int]:
    with self._lock:
      return list(self.counts)

  def record(self, epoch: int, count: int) -> None:
    """Notes that epoch `epoch` has `count` batches (computed from its plan).

    Raises:
      ValueError: a stored count of that epoch differs (the file was
        altered: batches located with it may be wrong).
    """
    epoch, count = int(epoch), int(count)
    with self._lock:
      if epoch < len(self.counts):
        if self.counts[epoch] != count:
          raise ValueError(
              f'{self.path} says epoch {epoch} has {self.counts[epoch]} '
              f'batches but its plan has {count}; delete the file (it is '
              'computed again) and resume again')
        return
      if epoch > len(self.counts):  # Only a contiguous list is stored.
        return
      self.counts.append(count)
      if self.writer and self.path:
        self._write()

  def _write(self) -> None:
    text = json.dumps(dict(format=FORMAT, settings=self.settings,
                           counts=self.counts,
                           sha256=_checksum(self.settings, self.counts)))
    try:
      paths.write_text(self.path, text)
    except Exception as e:  # Storage clients raise many types.
      # The counts only save time on a resume; training goes on.
      logging.warning('could not store epoch batch counts in %s (%s: %s); a '
                      'resume will compute them again', self.path,
                      type(e).__name__, e)
