"""Translating a corpus into one file, on every host at once (`jaxformer
translate --input FILES --output OUT`).

The work is cut from the input alone, so the file written is the same bytes
whatever the number of processes and devices:
- the lines are cut into chunks of `chunk_batches` x `batch_size`
  consecutive lines; inside a chunk they are grouped by length (sorted by
  their number of characters, ties in input order) into batches of
  `batch_size`, each padded to `batch_size` rows and decoded as far as its
  own longest source allows (`evaluate.decode_rows`);
- chunk c belongs to process c % process_count;
- a process decodes each of its batches whole on one of its devices
  (several batches at a time), so the program that decodes a batch depends
  on the batch alone, not on how many devices or processes share the work.

Each process commits its chunks as they finish, and SIGTERM (`Stop`) makes
it commit the batches it finished (`chunks.Parts`), so the same command
started again decodes only what is missing. Once every chunk is there,
process 0 joins them into OUT. Every file goes through storage/paths.py:
the input and OUT may be on gs://.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence

import jax
import numpy as np
from flax.core import meta

from jaxformer.data import language_tokenizer, sources
from jaxformer.inference import evaluate
from jaxformer.inference.chunks import Parts, Plan, length_batches
from jaxformer.parallel import peers
from jaxformer.storage import paths

# How long a process waits for the others' shares; a process that dies ends
# the run sooner (the runtime's heartbeats).
WAIT_SECONDS = 7 * 24 * 3600
STOP_KEY, PROGRESS_KEY = 'bulk_translate/stop', 'bulk_translate/progress'
UTF8_FIX = (', or pass --invalid-utf8=replace to replace undecodable bytes '
            'with U+FFFD')


@dataclasses.dataclass(frozen=True)
class Settings:
  """How a corpus is cut and decoded (see the module's docstring)."""
  batch_size: int
  chunk_batches: int
  beam_size: int
  alpha: float
  max_extra_len: int
  max_source_length: int
  on_too_long: str = 'truncate'  # or 'error'
  invalid_utf8: str = 'error'  # or 'replace'


def read_lines(files: Sequence[str], invalid_utf8: str = 'error'
               ) -> Iterator[str]:
  """The lines of `files` one after the other (plain or .gz, local or
  gs://); a line that is not UTF-8 is an error naming its file and line, or
  with invalid_utf8='replace' has U+FFFD for its undecodable bytes."""
  errors = 'replace' if invalid_utf8 == 'replace' else 'strict'
  for path in files:
    with paths.open_bytes(path) as stream:
      if path.endswith('.gz'):
        stream = gzip.GzipFile(fileobj=stream, mode='rb')
      yield from sources.decode_lines(stream, path, errors, UTF8_FIX)


def chunks_of(lines: Iterable[str], plan: Plan, wanted: Sequence[int]
              ) -> Iterator[tuple[int, list[str]]]:
  """(chunk, its lines) of the `wanted` chunks (ascending), reading `lines`
  no further than the last of them."""
  wanted, lines = list(wanted), iter(lines)
  position = 0
  for chunk in wanted:
    span = plan.lines_of(chunk)
    for _ in range(span.start - position):
      next(lines)
    yield chunk, [next(lines) for _ in span]
    position = span.stop


class Stop:
  """A request to commit what is done and stop: made in this process
  (`request`, which a signal handler may call) or by another process of the
  run; `poll` (between batches) posts this process's and reads theirs."""

  def __init__(self):
    self.reason: str | None = None
    self._posted = False
    self._polled = 0.0

  def request(self, reason: str) -> None:
    self.reason = self.reason or reason

  def is_set(self) -> bool:
    return self.reason is not None

  def poll(self, every: float = 1.0) -> bool:
    """Whether to stop; reads the others' at most every `every` seconds."""
    if self.reason is not None and not self._posted:
      peers.post(STOP_KEY, 'stop')
      self._posted = True
    elif self.reason is None and time.monotonic() - self._polled >= every:
      self._polled = time.monotonic()
      others = peers.posted(STOP_KEY, 'stop')
      if others:
        self._posted = True  # Only a process that was stopped posts.
        self.request(f'process {min(others)} was stopped')
    return self.is_set()


class Progress:
  """Lines and output tokens decoded by every process in this run; process
  0 prints a line on stderr at most every `every` seconds."""

  def __init__(self, total: int, committed: int, every: float = 10.0):
    self.total, self.committed, self.every = total, committed, every
    self.start = self._printed = time.monotonic()
    self.lines = self.tokens = 0

  def add(self, lines: int, tokens: int) -> None:
    self.lines += lines
    self.tokens += tokens
    peers.post(PROGRESS_KEY, f'{self.lines},{self.tokens}')
    if (jax.process_index() == 0
        and time.monotonic() - self._printed >= self.every):
      self._printed = time.monotonic()
      print(f'translate: {self.line()}', file=sys.stderr, flush=True)

  def counts(self) -> tuple[int, int]:
    """(lines, tokens) decoded in this run by all processes."""
    posted = peers.posted(PROGRESS_KEY, '[0-9]{1,15},[0-9]{1,15}')
    values = [tuple(map(int, v.split(','))) for v in posted.values()]
    values = values or [(self.lines, self.tokens)]
    return sum(v[0] for v in values), sum(v[1] for v in values)

  def line(self, final: bool = False) -> str:
    """'D/T lines (P%), R lines/s, K tokens/s', then 'eta S s' or (final)
    'in S s'."""
    lines, tokens = self.counts()
    seconds = max(time.monotonic() - self.start, 1e-9)
    done = self.committed + lines
    rate = lines / seconds
    share = 100 * done / self.total if self.total else 100
    text = (f'{done:,}/{self.total:,} lines ({share:.0f}%), '
            f'{rate:.1f} lines/s, {tokens / seconds:,.0f} tokens/s, ')
    if final:
      return text + f'in {seconds:.1f} s'
    return text + (f'eta {(self.total - done) / rate:.0f} s' if rate
                   else 'eta ?')


class Lanes:
  """This process's devices, each with its copy of the parameters, and the
  threads that keep batches in flight on them: one per device, on CPU one
  per core (searches on separate threads fill the cores' idle time)."""

  def __init__(self, params, devices: Sequence[jax.Device]):
    unboxed = meta.unbox(params)
    self.devices = list(devices)
    self.params = [jax.device_put(unboxed, d) for d in self.devices]
    per_device = 1
    if self.devices[0].platform == 'cpu':
      per_device = max(1, len(os.sched_getaffinity(0)) // len(self.devices))
    self.pool = concurrent.futures.ThreadPoolExecutor(
        len(self.devices) * per_device, thread_name_prefix='jaxformer-bulk')

  def submit(self, batch: int, decode, rows: np.ndarray, stop: Stop):
    """A future of decode(params, rows, device) on the device of `batch`;
    None if `stop` is set before it starts."""
    index = batch % len(self.devices)

    def run():
      if stop.is_set():
        return None
      return decode(self.params[index], rows, self.devices[index])
    return self.pool.submit(run)


def translate_chunk(model, settings: Settings, lanes: Lanes, lines: list[str],
                    first_line: int, done: dict[int, list[str]], stop: Stop,
                    progress: Progress) -> tuple[list[list[int]], dict]:
  """(the chunk's batches, {batch: translations} of those finished: `done`
  and those decoded now, all of them unless `stop` came first).
  first_line: the chunk's first line's index in the input."""
  batches = length_batches(lines, settings.batch_size)
  done = dict(done)

  def decode(params, rows, device):
    return evaluate.decode_rows(
        params, model.model_config, rows, beam_size=settings.beam_size,
        alpha=settings.alpha, max_extra_len=settings.max_extra_len,
        batch_parts=1, device=device,
        forced_id=language_tokenizer.first_id(model.target_tok))

  futures = {}
  for b, batch in enumerate(batches):
    if b not in done:
      rows = evaluate.source_batch(
          model.source_tok, [lines[i] for i in batch],
          [first_line + i + 1 for i in batch],
          batch_size=settings.batch_size,
          max_source_length=settings.max_source_length,
          on_too_long=settings.on_too_long, warn=_warn)
      futures[lanes.submit(b, decode, rows, stop)] = b
  pending = set(futures)
  while pending:
    finished, pending = concurrent.futures.wait(
        pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
    for future in finished:
      tokens, b = future.result(), futures[future]
      if tokens is not None:
        sources_ = [lines[i] for i in batches[b]]
        done[b] = [t.replace('\r', ' ').replace('\n', ' ') for t in
                   evaluate.texts_of(model.target_tok, tokens, sources_)]
        real = [bool(s.strip()) for s in sources_]
        progress.add(len(sources_), int(
            (tokens[:len(real)][real] != model.model_config.pad_id).sum()))
    stop.poll()
  return batches, done


def translate_corpus(model, files: Sequence[str], out: str,
                     settings: Settings, description: dict, stop: Stop
                     ) -> tuple[str, str]:
  """Translates the lines of `files` into `out`, this process's share of
  the chunks (see the module's docstring); every process of the run calls
  it. `model`: params, model_config, source_tok and target_tok (a
  checkpoints.trained.Trained); `description`: what else the manifest
  holds (the model, the settings the command took).

  Returns ('done' when `out` is written, else 'stopped' with what was done
  committed; the final progress line)."""
  plan = Plan(sum(1 for _ in read_lines(files, settings.invalid_utf8)),
              settings.batch_size, settings.chunk_batches)
  parts = Parts(out, plan)
  peers.check_shared_workdir(parts.directory)
  parts.check_manifest(dict(
      description, inputs=[[f, paths.stat(f)[0]] for f in files],
      lines=plan.lines, **dataclasses.asdict(settings)))
  mine = [c for c in plan.owned(jax.process_index(), jax.process_count())
          if not parts.committed(c)]
  progress = Progress(plan.lines, parts.committed_lines())
  status = 'stopped' if mine and stop.poll() else 'done'
  if status == 'done' and mine:
    lanes = Lanes(model.params, jax.local_devices())
    for chunk, lines in chunks_of(read_lines(files, settings.invalid_utf8),
                                  plan, mine):
      batches, done = translate_chunk(
          model, settings, lanes, lines, plan.lines_of(chunk).start,
          parts.kept(chunk), stop, progress)
      if (not parts.commit(chunk, batches, done)
          or (chunk != mine[-1] and stop.poll())):
        status = 'stopped'
        break
    lanes.pool.shutdown()
  statuses = peers.from_every_process('bulk_translate/status', status,
                                      WAIT_SECONDS, 'done|stopped')
  if 'stopped' in statuses:
    stop.poll(every=0)  # Who was stopped, if this process has not heard.
    return 'stopped', progress.line(final=True)
  if jax.process_index() == 0:
    parts.assemble()
  peers.from_every_process('bulk_translate/assembled', 'ok', WAIT_SECONDS,
                           'ok')
  return 'done', progress.line(final=True)


def _warn(text: str) -> None:
  print(text, file=sys.stderr, flush=True)
