"""A corpus decoded into one file, a line of output per line of input, on
every host at once: `jaxformer translate --input FILES --output OUT` and
`jaxformer generate --input FILES --output OUT`. This module is the chunk
engine; what a batch of lines becomes is its `Decoder`'s
(bulk_decoders.py: translations, continuations).

The work is cut from the input alone, so the file written is the same bytes
whatever the number of processes and devices:
- the lines are cut into chunks of `chunk_batches` x `batch_size`
  consecutive lines; inside a chunk they are grouped by length (sorted by
  their number of characters, ties in input order) into batches of
  `batch_size`, each decoded as its lines alone decide (a translation as far
  as its batch's longest source allows, a sample with keys folded from the
  line's index);
- chunk c belongs to process c % process_count;
- a process decodes each of its batches whole on one of its devices
  (several batches at a time), so the program that decodes a batch depends
  on the batch alone, not on how many devices or processes share the work.

Each process commits its chunks as they finish, and SIGTERM (`Stop`) makes
it commit the batches it finished (`chunks.Parts`), so the same command
started again decodes only what is missing. Once every chunk is there,
process 0 joins them into OUT. Each chunk records what made it (the input
lines' digest, the model's, the tokenizers', every decode setting:
provenance.py), so a resume or the join never takes a chunk of other
input, another model or other settings. Every file goes through
storage/paths.py: the input and OUT may be on gs://.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import gzip
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import jax
import numpy as np
from flax.core import meta

from jaxformer.data import sources
from jaxformer.inference import provenance
from jaxformer.inference.chunks import Parts, Plan, chunk_name, length_batches
from jaxformer.parallel import peers
from jaxformer.storage import paths

# How long a process waits for the others' shares; a process that dies ends
# the run sooner (the runtime's heartbeats).
WAIT_SECONDS = 7 * 24 * 3600
STOP_KEY, PROGRESS_KEY = 'bulk/stop', 'bulk/progress'
UTF8_FIX = (', or pass --invalid-utf8=replace to replace undecodable bytes '
            'with U+FFFD')


def warn(text: str) -> None:
  """A decoder's warning on a line (one too long): one line on stderr."""
  print(text, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chunking:
  """How a corpus is cut (see the module's docstring) and read; a
  decoder's settings extend it."""
  batch_size: int
  chunk_batches: int
  invalid_utf8: str = 'error'  # or 'replace'


class Decoder(Protocol):
  """What a batch of lines becomes (bulk_decoders.py)."""
  command: str  # Names the progress lines.
  settings: Chunking  # With the decoder's own; the manifest holds them.
  params: Any

  def inputs(self, lines: list[str], numbers: list[int]) -> Any:
    """The batch's inputs, on the host, of `lines` of the input at
    `numbers` (0-based); called in input order, so warnings come so."""

  def decode(self, params, inputs, device: jax.Device) -> Any:
    """The batch decoded on `device`, where `params` are (a lane's
    thread)."""

  def outputs(self, inputs, decoded, lines: list[str]
              ) -> tuple[list[str], int]:
    """(an output line for each of `lines`, the new tokens among them)."""


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
  0 prints a line on stderr ('COMMAND: ...') at most every `every`
  seconds."""

  def __init__(self, total: int, committed: int, command: str,
               every: float = 10.0):
    self.total, self.committed, self.every = total, committed, every
    self.command = command
    self.start = self._printed = time.monotonic()
    self.lines = self.tokens = 0

  def add(self, lines: int, tokens: int) -> None:
    self.lines += lines
    self.tokens += tokens
    peers.post(PROGRESS_KEY, f'{self.lines},{self.tokens}')
    if (jax.process_index() == 0
        and time.monotonic() - self._printed >= self.every):
      self._printed = time.monotonic()
      print(f'{self.command}: {self.line()}', file=sys.stderr, flush=True)

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


def decode_chunk(decoder: Decoder, lanes: Lanes, lines: list[str],
                 first_line: int, done: dict[int, list[str]], stop: Stop,
                 progress: Progress) -> tuple[list[list[int]], dict]:
  """(the chunk's batches, {batch: output lines} of those finished: `done`
  and those decoded now, all of them unless `stop` came first).
  first_line: the chunk's first line's index in the input."""
  batches = length_batches(lines, decoder.settings.batch_size)
  done = dict(done)
  futures = {}
  for b, batch in enumerate(batches):
    if b not in done:
      inputs = decoder.inputs([lines[i] for i in batch],
                              [first_line + i for i in batch])
      futures[lanes.submit(b, decoder.decode, inputs, stop)] = b, inputs
  pending = set(futures)
  while pending:
    finished, pending = concurrent.futures.wait(
        pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
    for future in finished:
      decoded, (b, inputs) = future.result(), futures[future]
      if decoded is not None:
        texts, tokens = decoder.outputs(inputs, decoded,
                                        [lines[i] for i in batches[b]])
        done[b] = [t.replace('\r', ' ').replace('\n', ' ') for t in texts]
        progress.add(len(texts), tokens)
    stop.poll()
  return batches, done


def decode_corpus(decoder: Decoder, files: Sequence[str], out: str,
                  description: dict, stop: Stop) -> tuple[str, str]:
  """Decodes the lines of `files` into `out`, this process's share of the
  chunks (see the module's docstring); every process of the run calls it.
  `description`: the model's part of the run's fingerprint
  (`provenance.model_identity`); the decoder's settings are the rest.

  A chunk committed before (a stopped run of the same command) is kept
  only if its record matches (chunks.Parts.mismatch): else it is decoded
  again, with a line on stderr saying why.

  Returns ('done' when `out` is written, else 'stopped' with what was done
  committed; the final progress line)."""
  settings = decoder.settings
  check_not_an_input(files, out)
  chunk_lines = settings.batch_size * settings.chunk_batches
  lines, digests = provenance.chunk_digests(
      read_lines(files, settings.invalid_utf8), chunk_lines)
  plan = Plan(lines, settings.batch_size, settings.chunk_batches)
  fingerprint = dict(description, **dataclasses.asdict(settings))
  parts = Parts(out, plan, fingerprint, digests)
  peers.check_shared_workdir(parts.directory)
  parts.check_manifest(dict(fingerprint, inputs=list(files),
                            lines=plan.lines))
  mine = [c for c in plan.owned(jax.process_index(), jax.process_count())
          if not kept_chunk(parts, c)]
  progress = Progress(plan.lines, parts.committed_lines(), decoder.command)
  status = 'stopped' if mine and stop.poll() else 'done'
  if status == 'done' and mine:
    lanes = Lanes(decoder.params, jax.local_devices())
    for chunk, lines in chunks_of(read_lines(files, settings.invalid_utf8),
                                  plan, mine):
      batches, done = decode_chunk(
          decoder, lanes, lines, plan.lines_of(chunk).start,
          parts.kept(chunk), stop, progress)
      if (not parts.commit(chunk, batches, done)
          or (chunk != mine[-1] and stop.poll())):
        status = 'stopped'
        break
    lanes.pool.shutdown()
  statuses = peers.from_every_process('bulk/status', status, WAIT_SECONDS,
                                      'done|stopped')
  if 'stopped' in statuses:
    stop.poll(every=0)  # Who was stopped, if this process has not heard.
    return 'stopped', progress.line(final=True)
  if jax.process_index() == 0:
    parts.assemble()
  peers.from_every_process('bulk/assembled', 'ok', WAIT_SECONDS, 'ok')
  return 'done', progress.line(final=True)


def check_not_an_input(files: Sequence[str], out: str) -> None:
  """Raises if `out` (or its parts' directory) is one of the input files."""
  written = {paths.absolute(out), paths.absolute(out + '.parts')}
  for path in files:
    same = paths.absolute(path) in written or (
        not paths.is_remote(path) and paths.exists(out)
        and os.path.samefile(path, out))
    if same:
      raise ValueError(f'--output {out} is also an --input file; write the '
                       'output to another file.')


def kept_chunk(parts: Parts, chunk: int) -> bool:
  """Whether `chunk`'s committed file is kept (says on stderr why one that
  is there is decoded again)."""
  if not parts.committed(chunk):
    return False
  why = parts.mismatch(chunk)
  if why:
    print(f'{chunk_name(chunk)} in {parts.directory} is decoded again: '
          f'{why}.', file=sys.stderr, flush=True)
    parts.present.discard(chunk_name(chunk))
  return not why
