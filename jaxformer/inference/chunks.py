"""How a corpus to decode (bulk.py) is cut into chunks of batches (`Plan`,
`length_batches`), from the input alone, and where finished chunks are kept
until they make the output (`Parts`).

`OUT.parts/` holds `manifest.json` (the input files, their line count and
the run's fingerprint: provenance.py), `chunk-NNNNNNNN.txt` for each
finished chunk and `chunk-NNNNNNNN.partial.json` for a chunk stopped part
way ({"record": ..., "batches": {batch: its output lines}}). A chunk file's
first line is its record, `#jaxformer-chunk {JSON}`: the run's
fingerprint, the digest of the chunk's input lines, and the count and
digest of the output lines that follow (in input order, a line each). A
resumed run decodes again any chunk whose record does not match its input
lines, its fingerprint or its own lines; OUT is joined only from chunks
that match. Each file is written whole and synced (storage/paths.py), so a
process killed at any time leaves only whole files; OUT is written from the
chunks in one piece, then OUT.parts removed.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Sequence

from jaxformer.inference import provenance
from jaxformer.storage import paths

MANIFEST = 'manifest.json'
RECORD = b'#jaxformer-chunk '


@dataclasses.dataclass(frozen=True)
class Plan:
  """`lines` input lines cut into chunks of `chunk_batches` batches of
  `batch_size` consecutive lines."""
  lines: int
  batch_size: int
  chunk_batches: int

  @property
  def chunk_lines(self) -> int:
    return self.batch_size * self.chunk_batches

  @property
  def chunks(self) -> int:
    return -(-self.lines // self.chunk_lines)

  def lines_of(self, chunk: int) -> range:
    start = chunk * self.chunk_lines
    return range(start, min(start + self.chunk_lines, self.lines))

  def batch_sizes(self, chunk: int) -> list[int]:
    """The sizes of the chunk's batches (`length_batches`)."""
    size = len(self.lines_of(chunk))
    return [min(self.batch_size, size - i)
            for i in range(0, size, self.batch_size)]

  def owned(self, process: int, count: int) -> list[int]:
    """The chunks of process `process` of `count`."""
    return list(range(process, self.chunks, count))


def length_batches(lines: Sequence[str], batch_size: int) -> list[list[int]]:
  """Indices of `lines` in batches of `batch_size` (the last one may be
  smaller), by length in characters, ties in order."""
  order = sorted(range(len(lines)), key=lambda i: (len(lines[i]), i))
  return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def chunk_name(chunk: int) -> str:
  return f'chunk-{chunk:08d}.txt'


def partial_name(chunk: int) -> str:
  return f'chunk-{chunk:08d}.partial.json'


def chunk_file(record: dict, outputs: Sequence[str]) -> bytes:
  """A chunk file's bytes: `record` (with the count and digest of
  `outputs` added) on its first line, then the output lines."""
  body = ''.join(t + '\n' for t in outputs).encode('utf-8')
  record = dict(record, lines=len(outputs),
                output=provenance.bytes_digest(body))
  return RECORD + json.dumps(record, sort_keys=True).encode() + b'\n' + body


def read_chunk_file(data: bytes) -> tuple[dict, bytes]:
  """(the record, the output lines' bytes) of a chunk file; ValueError if
  it has no record."""
  first, _, body = data.partition(b'\n')
  if not first.startswith(RECORD):
    raise ValueError('it has no record line')
  record = json.loads(first[len(RECORD):])
  if not isinstance(record, dict):
    raise ValueError('its record is not an object')
  return record, body


class Parts:
  """The `OUT.parts` directory of the outputs of `plan` into `out`, made by
  the run of `fingerprint` from input lines whose chunks have the digests
  `inputs` (provenance.chunk_digests)."""

  def __init__(self, out: str, plan: Plan, fingerprint: dict,
               inputs: Sequence[str]):
    self.out, self.plan = out, plan
    self.fingerprint = provenance.canonical(fingerprint)
    self.inputs = list(inputs)
    self.directory = out + '.parts'
    self.present: set[str] = set()

  def look(self) -> None:
    """Notes which files are there now."""
    self.present = set(paths.list_dir(self.directory))

  def _path(self, name: str) -> str:
    return paths.join(self.directory, name)

  def _record(self, chunk: int) -> dict:
    """What chunk `chunk` of this run records of its making."""
    return dict(fingerprint=self.fingerprint, input=self.inputs[chunk])

  def check_manifest(self, manifest: dict) -> None:
    """Writes `manifest` (the input and settings of the parts) unless it
    is there; raises if the directory holds chunks of another run
    (a manifest alone is replaced). Notes which files are there (`look`)."""
    path = self._path(MANIFEST)
    manifest = provenance.canonical(manifest)
    self.look()  # Before reading: a chunk seen is one of the manifest read.
    saved = json.loads(paths.read_text(path)) if paths.exists(path) else {}
    changed = provenance.first_change(saved, manifest)
    if not any(name.startswith('chunk-') for name in self.present):
      if changed:
        paths.write_text(path, json.dumps(manifest, indent=1, sort_keys=True))
      return
    if changed:
      raise ValueError(
          f'{self.directory} holds the parts of another run '
          f'({provenance.change_line(saved, manifest)}); run that '
          f'command again to finish it, or remove {self.directory} to start '
          'over.')

  def committed(self, chunk: int) -> bool:
    """Whether the chunk's file is there (`look`), matching or not."""
    return chunk_name(chunk) in self.present

  def mismatch(self, chunk: int) -> str | None:
    """Why the committed file of `chunk` cannot be joined into OUT (its
    record is not this run's, its input lines changed, its lines are not
    those it records), or None if it can."""
    try:
      data = paths.read_bytes(self._path(chunk_name(chunk)))
    except OSError as error:
      return f'it cannot be read ({error})'
    return self._mismatch_of(chunk, data)

  def _mismatch_of(self, chunk: int, data: bytes) -> str | None:
    """`mismatch`, of the chunk file's bytes `data`."""
    try:
      record, body = read_chunk_file(data)
    except (ValueError, UnicodeDecodeError) as error:
      return f'it cannot be read ({error})'
    if record.get('fingerprint') != self.fingerprint:
      then = record.get('fingerprint')
      then = then if isinstance(then, dict) else {}
      return (f'another run made it ('
              f'{provenance.change_line(then, self.fingerprint)})')
    if record.get('input') != self.inputs[chunk]:
      return 'its input lines changed'
    lines, wanted = body.count(b'\n'), len(self.plan.lines_of(chunk))
    if (record.get('lines') != wanted or lines != wanted
        or record.get('output') != provenance.bytes_digest(body)):
      return (f'its lines are not those it records ({lines} lines, '
              f'{wanted} recorded)')
    return None

  def kept(self, chunk: int) -> dict[int, list[str]]:
    """The batches a stopped chunk kept ({} if none, or if they are not
    this run's, of these input lines, or do not fit the plan: then they
    are decoded again)."""
    if partial_name(chunk) not in self.present:
      return {}
    sizes = self.plan.batch_sizes(chunk)
    try:
      saved = json.loads(paths.read_text(self._path(partial_name(chunk))))
      if saved.get('record') != self._record(chunk):
        return {}
      kept = {int(b): texts for b, texts in saved['batches'].items()}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
      return {}
    if all(0 <= b < len(sizes) and isinstance(t, list) and len(t) == sizes[b]
           and all(isinstance(x, str) for x in t) for b, t in kept.items()):
      return kept
    return {}

  def committed_lines(self) -> int:
    """How many lines the finished and stopped chunks hold."""
    return sum(len(self.plan.lines_of(c)) if self.committed(c) else
               sum(map(len, self.kept(c).values()))
               for c in range(self.plan.chunks))

  def commit(self, chunk: int, batches: Sequence[Sequence[int]],
             done: dict[int, list[str]]) -> bool:
    """Writes the chunk's file if all its `batches` are `done` (and removes
    its partial), else the partial; whether the chunk is finished."""
    if len(done) < len(batches):
      if done:
        paths.write_text(self._path(partial_name(chunk)), json.dumps(dict(
            record=self._record(chunk),
            batches={str(b): t for b, t in sorted(done.items())})))
      return False
    outputs = [''] * sum(map(len, batches))
    for b, batch in enumerate(batches):
      for i, text in zip(batch, done[b]):
        outputs[i] = text
    paths.write_bytes(self._path(chunk_name(chunk)),
                      chunk_file(self._record(chunk), outputs))
    paths.remove(self._path(partial_name(chunk)))
    return True

  def assemble(self) -> None:
    """Joins the chunks into `out` (gzip-compressed, without a time stamp,
    if it ends in .gz), then removes the directory. Each chunk is checked
    as it is read (`mismatch`); one that fails leaves `out` as it was and
    the directory whole, and raises naming it."""
    with paths.replacing(self.out) as f:
      sink = (gzip.GzipFile(filename='', mode='wb', fileobj=f, mtime=0)
              if self.out.endswith('.gz') else f)
      for chunk in range(self.plan.chunks):
        data = paths.read_bytes(self._path(chunk_name(chunk)))
        why = self._mismatch_of(chunk, data)
        if why:
          raise ValueError(
              f'{self._path(chunk_name(chunk))} cannot be joined into '
              f'{self.out}: {why}; run the same command again to decode it '
              'again.')
        sink.write(read_chunk_file(data)[1])
      if sink is not f:
        sink.close()
    paths.remove_tree(self.directory)
