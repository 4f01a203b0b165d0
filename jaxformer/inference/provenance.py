"""What made a bulk output (bulk.py): the fingerprint of a run and the
digests that tie each committed chunk to its input lines and to its own
bytes (chunks.py).

A run's fingerprint is a flat dict: the model's identity (`model_identity`:
a digest of its parameters, of its tokenizers, its languages and step) and
every field of the decoder's settings (beam, lengths, temperature, seed,
and whatever a decoder adds, such as a target prefix or constraints), so
that a chunk decoded under another fingerprint is never joined into the
file. Digests are SHA-256, in hex.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

import jax
import numpy as np
from flax.core import meta


def lines_digest(lines: Iterable[str]) -> str:
  """The digest of `lines`, each ended by a newline."""
  digest = hashlib.sha256()
  for line in lines:
    digest.update(line.encode('utf-8', 'surrogatepass') + b'\n')
  return digest.hexdigest()


def bytes_digest(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def chunk_digests(lines: Iterable[str], chunk_lines: int
                  ) -> tuple[int, list[str]]:
  """(how many `lines` there are, the digest of each run of `chunk_lines`
  consecutive lines, the last one maybe shorter)."""
  count, digests, batch = 0, [], []
  for line in lines:
    batch.append(line)
    count += 1
    if len(batch) == chunk_lines:
      digests.append(lines_digest(batch))
      batch = []
  if batch:
    digests.append(lines_digest(batch))
  return count, digests


def params_digest(params) -> str:
  """A digest of every parameter: its path, dtype, shape and values, in
  the order of the sorted paths (the same parameters anywhere give the
  same digest)."""
  leaves = jax.tree_util.tree_flatten_with_path(meta.unbox(params))[0]
  digest = hashlib.sha256()
  for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(
      item[0])):
    array = np.ascontiguousarray(jax.device_get(leaf))
    digest.update(f'{jax.tree_util.keystr(path)}|{array.dtype.str}|'
                  f'{array.shape}|'.encode())
    digest.update(array.reshape(-1).view(np.uint8))  # No copy.
  return digest.hexdigest()


def tokenizer_digest(*tokenizers) -> str:
  """A digest of the tokenizers' serialized models (with the language a
  many-to-many tokenizer is bound to, where it holds one)."""
  digest = hashlib.sha256()
  for tokenizer in tokenizers:
    digest.update(bytes_digest(tokenizer.serialized_model_proto()).encode())
  return digest.hexdigest()


def model_identity(model) -> dict:
  """What a fingerprint says of a `checkpoints.trained.Trained`: its
  parameters' and tokenizers' digests, its languages and step (not its
  path: a model moved is the same model, another one in the same
  workdir is not)."""
  data = model.config.data
  return dict(model_params=params_digest(model.params),
              tokenizers=tokenizer_digest(model.source_tok, model.target_tok),
              source_lang=data.get('source_lang') or None,
              target_lang=data.get('target_lang') or None,
              step=model.step)


def canonical(value) -> dict:
  """`value` as JSON would give it back (tuples as lists...)."""
  return json.loads(json.dumps(value, sort_keys=True))


def first_change(then: dict, now: dict) -> str | None:
  """The first key (in name order) whose value differs, if any."""
  changed = [k for k in sorted(set(then) | set(now))
             if then.get(k) != now.get(k)]
  return changed[0] if changed else None


def change_line(then: dict, now: dict) -> str:
  """'KEY: THEN then, NOW now' of the first change (digests shortened)."""
  key = first_change(then, now)
  shown = [then.get(key), now.get(key)]
  if key in ('model_params', 'tokenizers'):
    shown = [v[:12] if isinstance(v, str) else v for v in shown]
  return f'{key}: {shown[0]!r} then, {shown[1]!r} now'
