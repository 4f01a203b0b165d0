"""How a corpus to decode (bulk.py) is cut into chunks of batches (`Plan`,
`length_batches`), from the input alone, and where finished chunks are kept
until they make the output (`Parts`).

`OUT.parts/` holds `manifest.json` (the input and settings the parts belong
to), `chunk-NNNNNNNN.txt` for each finished chunk (its output lines in
input order, a line each) and `chunk-NNNNNNNN.partial.json` for a chunk
stopped part way ({batch: its output lines}). Each file is written whole
(storage/paths.py), so a process killed at any time leaves only whole
files; OUT is written from the chunks in one piece, then OUT.parts removed.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from collections.abc import Sequence

from jaxformer.storage import paths

MANIFEST = 'manifest.json'


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


class Parts:
  """The `OUT.parts` directory of the outputs of `plan` into `out`."""

  def __init__(self, out: str, plan: Plan):
    self.out, self.plan = out, plan
    self.directory = out + '.parts'
    self.present: set[str] = set()

  def look(self) -> None:
    """Notes which files are there now."""
    self.present = set(paths.list_dir(self.directory))

  def _path(self, name: str) -> str:
    return paths.join(self.directory, name)

  def check_manifest(self, manifest: dict) -> None:
    """Writes `manifest` (the input and settings of the parts) unless it
    is there; raises if the directory holds chunks of another run
    (a manifest alone is replaced). Notes which files are there (`look`)."""
    path = self._path(MANIFEST)
    manifest = json.loads(json.dumps(manifest))
    self.look()  # Before reading: a chunk seen is one of the manifest read.
    saved = json.loads(paths.read_text(path)) if paths.exists(path) else {}
    changed = [k for k in sorted(set(saved) | set(manifest))
               if saved.get(k) != manifest.get(k)]
    if not any(name.startswith('chunk-') for name in self.present):
      if changed:
        paths.write_text(path, json.dumps(manifest, indent=1, sort_keys=True))
      return
    if changed:
      key = changed[0]
      raise ValueError(
          f'{self.directory} holds the parts of another run ({key}: '
          f'{saved.get(key)!r} then, {manifest.get(key)!r} now); run that '
          f'command again to finish it, or remove {self.directory} to start '
          'over.')

  def committed(self, chunk: int) -> bool:
    return chunk_name(chunk) in self.present

  def kept(self, chunk: int) -> dict[int, list[str]]:
    """The batches a stopped chunk kept ({} if none, or if they do not fit
    the plan: then they are decoded again)."""
    if partial_name(chunk) not in self.present:
      return {}
    sizes = self.plan.batch_sizes(chunk)
    try:
      saved = json.loads(paths.read_text(self._path(partial_name(chunk))))
      kept = {int(b): texts for b, texts in saved.items()}
    except (OSError, ValueError, AttributeError):
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
        paths.write_text(self._path(partial_name(chunk)), json.dumps(
            {str(b): t for b, t in sorted(done.items())}))
      return False
    outputs = [''] * sum(map(len, batches))
    for b, batch in enumerate(batches):
      for i, text in zip(batch, done[b]):
        outputs[i] = text
    paths.write_bytes(self._path(chunk_name(chunk)),
                      ''.join(t + '\n' for t in outputs).encode('utf-8'))
    paths.remove(self._path(partial_name(chunk)))
    return True

  def assemble(self) -> None:
    """Joins the chunks into `out` (gzip-compressed, without a time stamp,
    if it ends in .gz), then removes the directory."""
    with paths.replacing(self.out) as f:
      sink = (gzip.GzipFile(filename='', mode='wb', fileobj=f, mtime=0)
              if self.out.endswith('.gz') else f)
      for chunk in range(self.plan.chunks):
        sink.write(paths.read_bytes(self._path(chunk_name(chunk))))
      if sink is not f:
        sink.close()
    paths.remove_tree(self.directory)
