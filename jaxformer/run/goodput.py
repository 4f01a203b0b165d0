"""Where a run's wall time goes: training steps (goodput) and the rest by
cause, from the start of the `Trainer` to the end of the run, plus the time
lost to restarts since the workdir's first start.

Time is counted in the outermost cause being timed (a save waiting on the
previous one counts once); training is what no cause claims after the
first step: dispatch, the devices' work the host waits for, logging. A
restart loses the time from the save of the step it resumes from (or from
the previous start, when there was no checkpoint) to its own start: the
steps trained after that save and the time nobody ran. A run that finished
loses nothing to the next start. The record of starts and saves is
`<workdir>/goodput.json`, written by process 0.
"""
import contextlib
import functools
import json
import time

import jax

from jaxformer.storage import paths

RECORD_FILE = 'goodput.json'
CAUSES = ('startup', 'compile', 'input', 'checkpoint', 'eval', 'restarts')
# The metrics' fields of wall-clock time (they differ between equal runs).
FIELDS = (*(f'time_{cause}' for cause in CAUSES), 'time_train', 'time_wall',
          'goodput')
KEPT_SAVES = 50  # Step save times kept in the record.


class Record:
  """`<workdir>/goodput.json`: the workdir's run starts, the wall-clock time
  of each saved step, whether the last run finished, the seconds lost."""

  def __init__(self, workdir: str, enabled: bool):
    self.path = paths.join(workdir, RECORD_FILE)
    self.enabled = enabled
    self.data = (json.loads(paths.read_text(self.path))
                 if paths.exists(self.path) else None)

  def start(self, resumed_step: int | None, now: float) -> float:
    """Notes a start at `now` (Unix time) resuming `resumed_step` (None: no
    checkpoint); returns the seconds this restart lost."""
    data = self.data or {'starts': [], 'saved': {}, 'finished': False,
                         'lost_seconds': 0.0}
    lost = 0.0
    if data['starts'] and not data['finished']:
      since = data['saved'].get(str(resumed_step), data['starts'][-1])
      lost = max(now - since, 0.0)
    data['lost_seconds'] += lost
    data['starts'].append(now)
    data['finished'] = False
    self.data = data
    self._write()
    return lost

  def saved(self, step: int) -> None:
    saved = self.data['saved'] if self.data else {}
    if self.data and str(step) not in saved:
      saved[str(step)] = time.time()
      for old in sorted(saved, key=int)[:-KEPT_SAVES]:
        del saved[old]
      self._write()

  def finished(self) -> None:
    self.data['finished'] = True
    self._write()

  def _write(self) -> None:
    if self.enabled:
      paths.write_text(self.path, json.dumps(self.data, indent=1))


class Goodput:
  """The seconds of a run by cause; created where the run starts."""

  def __init__(self, workdir: str, start: float):
    """start: time.monotonic() when the run started (before the
    distributed runtime, which must start before any other JAX call)."""
    self.start = start
    self.seconds = dict.fromkeys(CAUSES, 0.0)
    self.record = Record(workdir, jax.process_index() == 0)
    self._loop_start = None
    self._timing = False

  @contextlib.contextmanager
  def timing(self, cause: str):
    """Counts the time inside in `cause` (unless inside another cause)."""
    if self._timing:
      yield
      return
    self._timing, begin = True, time.monotonic()
    try:
      yield
    finally:
      self._timing = False
      self.seconds[cause] += time.monotonic() - begin

  def timed(self, cause: str, fn):
    """`fn`, its calls counted in `cause`."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with self.timing(cause):
        return fn(*args, **kwargs)
    return wrapped

  def first_call_timed(self, step_fn):
    """A freshly built step: its first call (tracing, compiling, dispatch)
    counts as compilation."""
    calls = iter([self.timed('compile', step_fn)])
    return lambda *args: next(calls, step_fn)(*args)

  def watch(self, checkpoints) -> None:
    """Counts `checkpoints`' saves and waits, and records each saved step."""
    save = self.timed('checkpoint', checkpoints.save)
    def recorded_save(step, *args, **kwargs):
      save(step, *args, **kwargs)
      self.record.saved(step)
    checkpoints.save = recorded_save
    checkpoints.wait = self.timed('checkpoint', checkpoints.wait)

  def begin(self, resumed_step: int | None) -> None:
    """The first step is next: start-up ends; notes the start (resuming
    `resumed_step`) in the record."""
    self._loop_start = time.monotonic()
    self.seconds['startup'] = self._loop_start - self.start
    self.record.start(resumed_step, time.time())
    self.seconds['restarts'] = self.record.data['lost_seconds']

  def end(self, finished: bool) -> dict[str, float]:
    """The run's fields at its end; a finished run loses nothing to the
    next start."""
    if finished and self.record.data:
      self.record.finished()
    return self.fields()

  def fields(self) -> dict[str, float]:
    """Seconds per cause ('time_<cause>'), training ('time_train'), their
    sum ('time_wall': this run's time and the restarts' losses) and the
    share that trained ('goodput')."""
    wall = time.monotonic() - self.start + self.seconds['restarts']
    result = {f'time_{k}': v for k, v in self.seconds.items()}
    result['time_train'] = max(wall - sum(self.seconds.values()), 0.0)
    result['time_wall'] = wall
    result['goodput'] = result['time_train'] / wall if wall else 0.0
    return result


def summary(fields: dict[str, float]) -> str:
  """The end of a run's line: goodput and the seconds of each cause."""
  names = dict(train='training', startup='start-up', compile='compile',
               input='waiting for input', checkpoint='checkpoints',
               eval='evaluation', restarts='lost to restarts')
  wall = fields['time_wall']
  parts = ', '.join(
      f'{name} {fields[f"time_{k}"]:.1f} s '
      f'({100 * fields[f"time_{k}"] / max(wall, 1e-9):.1f}%)'
      for k, name in names.items())
  line = (f'Goodput {100 * fields["goodput"]:.1f}% of '
          f'{wall:.1f} s: {parts}')
  if 'mfu' in fields:
    line += f'; MFU {100 * fields["mfu"]:.1f}% in the last log window'
  return line + '.'
