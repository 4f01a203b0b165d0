"""Tokenised splits: each split tokenised once, kept as sharded .npy files.

A split's token ids live in a folder of the cache directory (by default
`<workdir>/tokenizer/token_cache`, see `directory`):

  <split>-<key>/00000.source.npy          [tokens] uint16 (int32 for
                00000.source_lengths.npy  [examples] int32   vocabularies
                00000.target.npy, 00000.target_lengths.npy   over 65535)
                00001...                  SHARD_EXAMPLES examples a shard
                manifest.json             written last

The manifest is the commit marker: a folder without one is an unfinished
write (a killed run) and is written again; every file is written whole
(`paths.write_bytes`), so a reader never sees part of one.

The key is a hash of the cache format, the split, how the split is read
(`data.source` and its settings for 'builtin' and 'tfds'; for files, each
file's path, size and modification time), and the tokenizers' model bytes.
A file's size and modification time change whenever it is rewritten or
replaced (on GCS the modification time is the object's update time);
hashing its content instead would read the whole corpus at every start,
which is the cost the cache exists to avoid.  Changed data or a different
tokenizer give another key, so a stale cache is never read.

Process 0 writes the cache shard by shard as it reads the data (the corpus
is never whole in memory; SentencePiece encodes each chunk with all cores);
the other processes wait for the manifest.  In a multi-host run
(`SharedCache`) every process uses process 0's key, so hosts holding their
own copies of the data files (other paths or modification times) still
read process 0's folder.  Readers load the lengths of
all examples (4 bytes per example and side) and read token ids only for
the examples they are asked for, memory-mapped from local disk.  A remote
cache (gs://) is first copied to the host's disk, one download per file
(`local_copy`): batches draw their examples from the whole split, so a host
reads every shard, and reading them example by example would cost a
request per example and side at every step.  The copy is kept for later
runs and restarts on the host (the key names its content).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import hashlib
import io
import itertools
import json
import os
from collections.abc import Callable, Iterable, Iterator

import ml_collections
import numpy as np

from jaxformer.storage import paths
from jaxformer.data import input_errors
from jaxformer.data import source_pieces
from jaxformer.data import sources
from jaxformer.data import token_shards
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.data.ragged_tokens import SIDES, RaggedTokens, TokenizedSplit

FORMAT = 1
SHARD_EXAMPLES = 1 << 20
ENCODE_CHUNK = 1 << 15  # pairs per SentencePiece call: bounds Python lists
MANIFEST = 'manifest.json'
_LOCAL_WRITE_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS)
_IN_MEMORY = 4  # splits kept open per process


# ------------------------------------------------------------------ encoding


def _token_dtype(*tokenizers: tokenizer_lib.Tokenizer) -> np.dtype:
  vocab = max(tok.vocab_size for tok in tokenizers)
  return np.dtype(np.uint16 if vocab <= np.iinfo(np.uint16).max + 1 else np.int32)


def _encode(texts: list[str], tok: tokenizer_lib.Tokenizer, dtype
            ) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [total] dtype, lengths [texts] int32), each text ending with EOS."""
  token_lists = tok.encode(texts)
  lengths = np.fromiter(map(len, token_lists), np.int32, len(token_lists))
  tokens = np.fromiter(itertools.chain.from_iterable(token_lists), dtype,
                       int(lengths.sum()))
  return tokens, lengths


def _chunks(items: Iterable, size: int) -> Iterator[list]:
  iterator = iter(items)
  while chunk := list(itertools.islice(iterator, size)):
    yield chunk


def encoded_shards(pairs: Iterable[input_errors.Pair],
                   source_tok: tokenizer_lib.Tokenizer,
                   target_tok: tokenizer_lib.Tokenizer,
                   ) -> Iterator[dict[str, np.ndarray]]:
  """Shards of SHARD_EXAMPLES encoded pairs: 'source', 'source_lengths',
  'target', 'target_lengths' (see the module docstring)."""
  dtype = _token_dtype(source_tok, target_tok)
  for shard_pairs in _chunks(pairs, SHARD_EXAMPLES):
    parts = collections.defaultdict(list)
    for chunk in _chunks(shard_pairs, ENCODE_CHUNK):
      for side, tok, texts in zip(SIDES, (source_tok, target_tok), zip(*chunk)):
        tokens, lengths = _encode(list(texts), tok, dtype)
        parts[side].append(tokens)
        parts[f'{side}_lengths'].append(lengths)
    yield {name: np.concatenate(arrays) for name, arrays in parts.items()}


def _from_shards(shards: list[dict], folder: str | None = None
                 ) -> TokenizedSplit:
  return TokenizedSplit(*(RaggedTokens.from_shards(
      [shard[side] for shard in shards],
      [shard[f'{side}_lengths'] for shard in shards]) for side in SIDES),
      folder=folder)


# --------------------------------------------------------------- the cache


def directory(data_config: ml_collections.ConfigDict, workdir: str | None
              ) -> str | None:
  """Where a run keeps its token cache: data.token_cache_dir, else
  <workdir>/tokenizer/token_cache; None when data.token_cache is off or
  there is no workdir (the splits are then tokenised in memory)."""
  if not data_config.get('token_cache', True):
    return None
  if data_config.get('token_cache_dir'):
    return paths.absolute(data_config.token_cache_dir)
  return None if workdir is None else paths.join(
      paths.absolute(workdir), 'tokenizer', 'token_cache')


@dataclasses.dataclass(frozen=True)
class SharedCache:
  """A cache directory shared by the processes of a multi-host run.

  `agree(name, compute, pattern=...)` returns process 0's `compute()` on
  every process (the others never call it: they need not hold the data
  files), refused unless it matches the regular expression `pattern`.
  """
  directory: str
  agree: Callable[[str, Callable[[], str]], str]
  process_count: int = 0  # processes tokenizing a split; 0: JAX's count

  def processes(self) -> int:
    if self.process_count:
      return self.process_count
    import jax  # pylint: disable=g-import-not-at-top (a run's processes)
    return jax.process_count()


def _file_identity(path: str) -> list:
  try:
    return [paths.absolute(path), *paths.stat(path)]
  except FileNotFoundError:
    raise input_errors.MissingFileError(
        f'{path}: no such file; check the path in the data config') from None


def cache_key(data_config: ml_collections.ConfigDict, split: str,
              source_tok: tokenizer_lib.Tokenizer,
              target_tok: tokenizer_lib.Tokenizer) -> str:
  """Hex sha256 of what the split's token ids depend on (module docstring)."""
  files = sources.split_files(data_config, split)
  reading = ([_file_identity(path) for path in files] if files else
             data_config.to_dict().get(data_config.source))
  digest = hashlib.sha256(json.dumps(
      [FORMAT, split, data_config.source, reading], sort_keys=True,
      default=str).encode())
  digest.update(hashlib.sha256(source_tok.serialized_model_proto()).digest())
  digest.update(hashlib.sha256(target_tok.serialized_model_proto()).digest())
  return digest.hexdigest()


def rows_key(data_config: ml_collections.ConfigDict, split: str,
             encoding: str, tokenizer: tokenizer_lib.Tokenizer,
             piece_bytes: int) -> str:
  """Hex sha256 of what a split's rows cache (`token_shards.py`) depends
  on: its format, the split, the source's settings and each of its files'
  path, size and modification time, the task's encoding, the pieces' size
  and the tokenizer's bytes."""
  settings = data_config.to_dict().get(data_config.source)
  files = ([_file_identity(path) for path in
            source_pieces.split_paths(data_config, split)]
           if data_config.source in source_pieces.FILE_SOURCES else [])
  digest = hashlib.sha256(json.dumps(
      ['rows', token_shards.FORMAT, split, data_config.source, settings,
       files, encoding, piece_bytes], sort_keys=True, default=str).encode())
  digest.update(hashlib.sha256(tokenizer.serialized_model_proto()).digest())
  return digest.hexdigest()


def _save_npy(path: str, array: np.ndarray) -> None:
  buffer = io.BytesIO()
  np.save(buffer, array, allow_pickle=False)
  paths.write_bytes(path, buffer.getvalue())


def write(folder: str, shards: Iterable[dict[str, np.ndarray]], key: str) -> None:
  """Writes `shards` into `folder`, then the manifest that commits them."""
  counts = []
  for number, shard in enumerate(shards):
    for name, array in shard.items():
      _save_npy(paths.join(folder, f'{number:05d}.{name}.npy'), array)
    counts.append(len(shard['source_lengths']))
  paths.write_text(paths.join(folder, MANIFEST), json.dumps(
      dict(format=FORMAT, key=key, shard_examples=counts), indent=1))


def local_root() -> str:
  """Where remote caches are copied on this host: $JAXFORMER_TOKEN_CACHE_LOCAL,
  else ~/.cache/jaxformer/token_cache (under $XDG_CACHE_HOME if set)."""
  cache_home = os.environ.get('XDG_CACHE_HOME') or os.path.join(
      os.path.expanduser('~'), '.cache')
  return os.environ.get('JAXFORMER_TOKEN_CACHE_LOCAL') or os.path.join(
      cache_home, 'jaxformer', 'token_cache')


def _shard_files(manifest: dict) -> list[str]:
  return [f'{number:05d}.{side}{part}.npy'
          for number in range(len(manifest['shard_examples']))
          for side in SIDES for part in ('', '_lengths')]


def local_copy(folder: str, manifest: dict,
               names: list[str] | None = None) -> str:
  """A local folder holding the shard files (`names`, by default those of
  a translation split) of the remote cache `folder`: each file downloaded
  whole unless a copy is there (each appears whole, by rename, and the
  folder's key names its content)."""
  local = os.path.join(local_root(), os.path.basename(folder.rstrip('/')))
  for name in names if names is not None else _shard_files(manifest):
    target = os.path.join(local, name)
    if os.path.exists(target):
      continue
    try:
      paths.copy_to_local(paths.join(folder, name), target)
    except OSError as e:
      if e.errno not in _LOCAL_WRITE_ERRORS:
        raise
      raise paths.StorageError(
          f'Cannot copy the token cache {folder} to {local} ({e}); free '
          'disk space there, or set JAXFORMER_TOKEN_CACHE_LOCAL to a folder '
          'with room for it.') from e
  return local


def read(folder: str) -> TokenizedSplit:
  """The split committed in `folder`: lengths in memory, tokens memory-
  mapped (from a local copy when `folder` is remote)."""
  manifest = json.loads(paths.read_text(paths.join(folder, MANIFEST)))
  if manifest.get('format') != FORMAT:
    raise sources.DataError(
        f'{folder}: token cache format {manifest.get("format")}, not '
        f'{FORMAT}; delete the folder to tokenise again')
  files = local_copy(folder, manifest) if paths.is_remote(folder) else folder
  shards = []
  for number in range(len(manifest['shard_examples'])):
    shard = {}
    for side in SIDES:
      prefix = os.path.join(files, f'{number:05d}.{side}')
      shard[side] = paths.memory_map_npy(f'{prefix}.npy')
      shard[f'{side}_lengths'] = np.load(io.BytesIO(
          paths.read_bytes(f'{prefix}_lengths.npy')), allow_pickle=False)
    shards.append(shard)
  return _from_shards(shards, folder)


_open_splits: collections.OrderedDict[tuple, TokenizedSplit] = (
    collections.OrderedDict())


def tokenized_split(data_config: ml_collections.ConfigDict, split: str,
                    source_tok: tokenizer_lib.Tokenizer,
                    target_tok: tokenizer_lib.Tokenizer,
                    cache_dir: str | SharedCache | None = None, *,
                    process_index: int = 0, name: str = '') -> TokenizedSplit:
  """A whole split, tokenised once: into `cache_dir` (written by process 0,
  reused while its key matches; a `SharedCache`: under process 0's key,
  agreed under the split and `name`, one per source of a mixture) or,
  without one, in this process's memory. The last few splits stay open per
  process."""
  compute_key = lambda: cache_key(data_config, split, source_tok, target_tok)
  if isinstance(cache_dir, SharedCache):
    agreed = f'token_cache/{split}' + (f'/{name}' if name else '')
    key = cache_dir.agree(agreed, compute_key,
                          pattern=tokenizer_lib.SHA256)
    cache_dir = cache_dir.directory
  else:
    key = compute_key()
  if (key, cache_dir) in _open_splits:
    _open_splits.move_to_end((key, cache_dir))
    return _open_splits[key, cache_dir]
  pairs = lambda: sources.iter_split(data_config, split)
  if cache_dir is None:
    examples = _from_shards(list(encoded_shards(pairs(), source_tok, target_tok)))
  else:
    folder = paths.join(cache_dir, f'{split}-{key[:24]}')
    manifest = paths.join(folder, MANIFEST)
    if not paths.exists(manifest):
      if process_index == 0:
        write(folder, encoded_shards(pairs(), source_tok, target_tok), key)
      else:
        tokenizer_lib.wait_for_process_0(
            manifest, data_config.tokenizer.get('wait_seconds', 3600),
            'the token cache ')
    examples = read(folder)
  _open_splits[key, cache_dir] = examples
  while len(_open_splits) > _IN_MEMORY:
    _open_splits.popitem(last=False)
  return examples
