"""SentencePiece tokenizers: training, loading, and the fixed special ids.

Special ids are the same in every model jaxformer trains or accepts: those
of `jaxformer.data.token_ids` (PAD 0, EOS 1, UNK 2, BOS 3), re-exported here.

Models live as `<workdir>/tokenizer/joint.model` (one model for both sides)
or `source.model` and `target.model`.  In a multi-process run only process 0
trains or copies a model; the others wait for the file.  Files are written
whole (jaxformer.storage.paths.write_bytes), so a waiting process never reads half a
model.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import time
from collections.abc import Iterable, Iterator, Sequence

import ml_collections
import numpy as np
import sentencepiece as spm

from jaxformer.storage import paths
from jaxformer.data import input_errors
from jaxformer.data import labelled
from jaxformer.data import mixture
from jaxformer.data import sources
from jaxformer.data.token_ids import (BOS_ID, EOS_ID, PAD_ID, UNK_ID,
                                     joined_pair)

_SPECIAL_IDS = {'pad': PAD_ID, 'eos': EOS_ID, 'unk': UNK_ID, 'bos': BOS_ID}
_SPECIAL_PIECES = {'pad': '<pad>', 'eos': '</s>', 'unk': '<unk>', 'bos': '<s>'}
_POLL_SECONDS = 1.0
# A hex sha256: the form of what process 0 sends through the runtime's
# key-value store (a path component, once a cache key), checked on receipt.
SHA256 = '[0-9a-f]{64}'

# Where only the first N tokens of a text are used, only its first
# N * CHARS_PER_TOKEN characters are encoded, so that a long line costs no
# more than a short one. A SentencePiece piece has at most 16 characters
# (the trainer's default max_sentencepiece_length): the cut keeps every
# token used, except after long runs of spaces (which normalisation drops).
CHARS_PER_TOKEN = 32


def cut_to_tokens(text: str, max_tokens: int) -> str:
  """The start of `text` that its first `max_tokens` tokens come from
  (CHARS_PER_TOKEN characters each), to encode instead of all of it."""
  return text[:max(max_tokens, 1) * CHARS_PER_TOKEN]


class Tokenizer:
  """A SentencePiece model whose special ids are PAD/EOS/UNK/BOS = 0/1/2/3."""

  def __init__(self, processor: spm.SentencePieceProcessor, name: str = 'model'):
    actual = {'pad': processor.pad_id(), 'eos': processor.eos_id(),
              'unk': processor.unk_id(), 'bos': processor.bos_id()}
    if actual != _SPECIAL_IDS:
      raise sources.DataError(
          f'{name}: special ids {actual} differ from jaxformer\'s '
          f'{_SPECIAL_IDS}; retrain it with pad_id=0 eos_id=1 unk_id=2 '
          'bos_id=3, or leave data.tokenizer.model_path empty so that '
          'jaxformer trains one')
    self._processor = processor

  @classmethod
  def from_serialized(cls, model_proto: bytes, name: str = 'model') -> Tokenizer:
    """The inverse of `serialized_model_proto()`, e.g. from a checkpoint."""
    processor = spm.SentencePieceProcessor()
    try:
      processor.LoadFromSerializedProto(model_proto)
    except RuntimeError as e:
      raise sources.DataError(f'{name}: not a SentencePiece model ({e})') from None
    return cls(processor, name)

  @property
  def vocab_size(self) -> int:
    return self._processor.vocab_size()

  # The special ids of this vocabulary (a model carries them too:
  # ModelConfig.pad_id, eos_id, decoder_start_id).
  pad_id = PAD_ID
  eos_id = EOS_ID
  unk_id = UNK_ID
  bos_id = BOS_ID
  eos_ids = ()  # A generated text ends at the model's eos_id.
  first_token_is_input = False

  def serialized_model_proto(self) -> bytes:
    return self._processor.serialized_model_proto()

  @property
  def sentencepiece_model(self) -> bytes:
    """The SentencePiece model (as `VocabTokenizer.sentencepiece_model`)."""
    return self._processor.serialized_model_proto()

  def id_to_piece(self, token_id: int) -> str:
    return self._processor.id_to_piece(int(token_id))

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, each list ending with EOS_ID."""
    return self._processor.encode(list(texts), out_type=int, add_eos=True,
                                  num_threads=os.cpu_count() or 1)

  def encode_pair(self, text_a: str, text_b: str | None = None
                  ) -> tuple[list[int], list[int]]:
    """(ids, token types) of a sentence pair: a's pieces + EOS, then b's
    pieces + EOS; types 0 for a and its EOS, 1 for b and its EOS.
    Without text_b, a's ids + EOS, types 0."""
    return joined_pair(*self.encode(
        [text_a] if text_b is None else [text_a, text_b]))

  def encode_pairs(self, pairs: Sequence[tuple[str, str | None]]
                   ) -> list[tuple[list[int], list[int]]]:
    return [self.encode_pair(a, b) for a, b in pairs]

  def hf_files(self) -> dict[str, bytes]:
    return {}  # Not a Hugging Face tokenizer.

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` [length] up to the first EOS, ignoring padding."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    eos_positions = np.flatnonzero(ids == self.eos_id)
    if eos_positions.size:
      ids = ids[:eos_positions[0]]
    return self._processor.decode(ids[ids != self.pad_id].tolist())

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    """Texts of each row of `ids` [batch, length]."""
    return [self.decode(row) for row in ids]


def _trainer_arguments(tok_config: ml_collections.ConfigDict) -> dict:
  arguments = dict(
      model_type=tok_config.type,
      vocab_size=tok_config.vocab_size,
      character_coverage=tok_config.character_coverage,
      num_threads=os.cpu_count() or 1,
  )
  for name, token_id in _SPECIAL_IDS.items():
    arguments[f'{name}_id'] = token_id
    arguments[f'{name}_piece'] = _SPECIAL_PIECES[name]
  return arguments


def train_tokenizer(texts: Iterable[str], model_prefix: str,
                    tok_config: ml_collections.ConfigDict) -> Tokenizer:
  """Trains a model on `texts` and writes it to `model_prefix + '.model'`."""
  model = io.BytesIO()
  try:
    with open(os.devnull, 'w') as quiet:
      spm.SentencePieceTrainer.train(
          sentence_iterator=iter(texts), model_writer=model, logstream=quiet,
          **_trainer_arguments(tok_config))
  except RuntimeError as e:
    raise sources.DataError(
        f'training the tokenizer {model_prefix}.model failed: {e}; if the '
        'vocabulary is too large for the data, lower '
        'data.tokenizer.vocab_size') from None
  paths.write_bytes(f'{model_prefix}.model', model.getvalue())
  return Tokenizer.from_serialized(model.getvalue(), f'{model_prefix}.model')


def from_serialized(data: bytes, name: str = 'model'):
  """A `Tokenizer` (a SentencePiece model with jaxformer's ids), a
  `vocab_tokenizer.VocabTokenizer` (pieces with their own vocabulary, e.g.
  an imported Marian model's), an `hf_tokenizer.HFTokenizer` (an imported
  Llama-family model's) or a `language_tokenizer.LanguageTokenizer` (an
  imported M2M100 or NLLB model's) from its `serialized_model_proto()`."""
  from jaxformer.data import hf_tokenizer, language_tokenizer
  if language_tokenizer.is_serialized(data):
    return language_tokenizer.LanguageTokenizer.from_serialized(
        data, name, inner_from_serialized=from_serialized)
  if hf_tokenizer.is_serialized(data):
    return hf_tokenizer.HFTokenizer.from_serialized(data, name)
  if data[:1] == b'{':  # JSON; a SentencePiece proto starts with field 1.
    from jaxformer.data.vocab_tokenizer import VocabTokenizer
    return VocabTokenizer.from_serialized(data, name)
  return Tokenizer.from_serialized(data, name)


def load_tokenizer(path: str) -> Tokenizer:
  """Reads a tokenizer file (local or gs://): a SentencePiece model, or a
  serialized `VocabTokenizer` or `HFTokenizer`."""
  return from_serialized(sources.read_bytes(path), path)


def _check_vocab_size(tokenizer: Tokenizer, path: str, expected: int) -> None:
  if tokenizer.vocab_size != expected:
    raise sources.DataError(
        f'{path} has a vocabulary of {tokenizer.vocab_size} pieces but '
        f'data.tokenizer.vocab_size is {expected}; set '
        f'data.tokenizer.vocab_size={tokenizer.vocab_size}, or use another '
        'model (a trained model in the workdir is reused on resume)')


def _given_model_paths(tok_config: ml_collections.ConfigDict) -> tuple[str, ...]:
  if tok_config.joint:
    return (tok_config.model_path,)
  return (tok_config.get('source_model_path', ''),
          tok_config.get('target_model_path', ''))


def _counted_train_pairs(data_config: ml_collections.ConfigDict,
                         with_labels: bool = False
                         ) -> tuple[int, Iterable[input_errors.Pair]]:
  """(how many, the pairs) of the train split; files are counted now and
  read when the pairs are. `with_labels`: the split's examples are texts
  or sentence pairs with a label (`labelled.read_split`); their texts are
  the pairs ('' for a single text's second), the labels left out."""
  if with_labels:
    texts, _ = labelled.read_split(data_config, 'train')
    pairs = [text if isinstance(text, tuple) else (text, '')
             for text in texts]
    return len(pairs), pairs
  if sources.split_files(data_config, 'train'):
    return (sources.count_pairs(data_config, 'train'),
            sources.iter_split(data_config, 'train'))
  pairs = sources.read_split(data_config, 'train')  # 'builtin', 'tfds'
  return len(pairs), pairs


def _sample(data_config: ml_collections.ConfigDict, with_labels: bool = False
            ) -> Iterator[input_errors.Pair]:
  """A seeded sample of data.tokenizer.sample_size train pairs (of all the
  sources of a mixture together), in split order.  Files are read in two
  streaming passes (count, then collect), so only the sample is ever in
  memory."""
  configs = mixture.train_configs(data_config, checked=True)
  counted = [_counted_train_pairs(config, with_labels) for config in configs]
  num_pairs = sum(count for count, _ in counted)
  pairs = itertools.chain.from_iterable(pairs for _, pairs in counted)
  sample_size = min(data_config.tokenizer.sample_size, num_pairs)
  rng = np.random.default_rng(data_config.seed)
  chosen = np.sort(rng.choice(num_pairs, sample_size, replace=False)).tolist()
  chosen.append(-1)  # Past the last one.
  next_chosen = 0
  for index, pair in enumerate(pairs):
    if index == chosen[next_chosen]:
      next_chosen += 1
      yield pair
  if next_chosen < sample_size:
    raise sources.DataError(
        f'the train split had {num_pairs} pairs when counted, then fewer; '
        'was it changed while the tokenizer was trained? Train again')


def _training_texts(data_config: ml_collections.ConfigDict,
                    with_labels: bool = False) -> tuple[list[str], ...]:
  """A seeded sample of train sentences per model: (joint,) or (source,
  target); with labels, every model learns the examples' texts alone."""
  source_texts, target_texts = [], []
  for source, target in _sample(data_config, with_labels):
    source_texts.append(source)
    target_texts.append(target)
  # Language modelling pairs, and single labelled texts, have '' targets.
  texts = [text for text in source_texts + target_texts if text]
  if data_config.tokenizer.joint:
    return (texts,)
  return (texts, texts) if with_labels else (source_texts, target_texts)


def _create_models(data_config: ml_collections.ConfigDict,
                   destinations: Sequence[str], with_labels: bool) -> None:
  """Copies the configured models to `destinations`, or trains them there."""
  tok_config = data_config.tokenizer
  given_paths = _given_model_paths(tok_config)
  if any(given_paths) and not all(given_paths):
    raise sources.DataError(
        'data.tokenizer.joint is False, so set both source_model_path and '
        'target_model_path, or neither (to train both)')
  if all(given_paths):
    for given, destination in zip(given_paths, destinations):
      tokenizer = load_tokenizer(given)
      _check_vocab_size(tokenizer, given, tok_config.vocab_size)
      paths.write_bytes(destination, tokenizer.serialized_model_proto())
    return
  for texts, path in zip(_training_texts(data_config, with_labels),
                         destinations):
    train_tokenizer(texts, path[:-len('.model')], tok_config)


def wait_for_process_0(path: str, timeout_seconds: float,
                       what: str = '') -> None:
  """Returns once `path` exists (process 0 writes it); a TimeoutError after
  `timeout_seconds` names `what` (a phrase ending in a space) and `path`."""
  deadline = time.monotonic() + timeout_seconds
  while not paths.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(
          f'waited {timeout_seconds:.0f}s for process 0 to write {what}{path}; '
          "check process 0's log, or raise data.tokenizer.wait_seconds")
    time.sleep(_POLL_SECONDS)


def _sha256_of(path: str) -> str:
  return hashlib.sha256(paths.read_bytes(path)).hexdigest()


def _check_same_as_process_0(path: str, expected: str, workdir: str) -> None:
  try:
    seen = _sha256_of(path)
  except FileNotFoundError:
    seen = None
  if seen != expected:
    raise sources.DataError(
        f'{path}: ' + ('missing here' if seen is None else
                       f'sha256 {seen[:12]} here') +
        f', but process 0 wrote the tokenizer model with sha256 '
        f'{expected[:12]}; the workdir {workdir} must be shared by all hosts '
        '(a gs:// bucket or a shared file system)')


def model_paths(data_config: ml_collections.ConfigDict, workdir: str) -> tuple[str, ...]:
  """Where a run keeps its tokenizer models: (joint,) or (source, target)."""
  names = ('joint',) if data_config.tokenizer.joint else ('source', 'target')
  return tuple(paths.join(workdir, 'tokenizer', f'{name}.model') for name in names)


def get_or_train(data_config: ml_collections.ConfigDict, workdir: str, *,
                 process_index: int | None = None, agree=None,
                 with_labels: bool = False) -> tuple[Tokenizer, Tokenizer]:
  """(source, target) tokenizers of a run: reused, copied, or trained.

  Order of preference: models already in `workdir/tokenizer/` (a resumed
  run), then `data.tokenizer.model_path` (or source_/target_model_path when
  not joint), then a model trained on a sample of the train split
  (`with_labels`: of its labelled examples' texts, for classification and
  regression).  For a joint model both returned tokenizers are the same
  object.  In multi-host runs `workdir` must be shared by all hosts (e.g.
  gs://): processes other than 0 wait for process 0's files there. With
  `agree(name, compute, pattern=...)` (process 0's `compute()` on every
  process, refused unless it matches the regular expression), they wait for
  process 0 to publish the models' sha256, then read the files at once and
  check that they hold those bytes.
  """
  if process_index is None:
    import jax
    process_index = jax.process_index()
  tok_config = data_config.tokenizer
  models = model_paths(data_config, workdir)
  if process_index == 0 and not all(map(paths.exists, models)):
    _create_models(data_config, models, with_labels)
  expected = None
  if agree is not None:
    hashes = lambda: ','.join(_sha256_of(path) for path in models)
    expected = agree('tokenizer_sha256', hashes,
                     pattern=f'{SHA256}(,{SHA256})*').split(',')
  tokenizers = []
  sizes = (tok_config.vocab_size,
           tok_config.get('target_vocab_size', 0) or tok_config.vocab_size)
  for index, (path, size) in enumerate(zip(models, sizes)):
    if expected is None:
      wait_for_process_0(path, tok_config.get('wait_seconds', 3600))
    else:
      _check_same_as_process_0(path, expected[index], workdir)
    tokenizers.append(load_tokenizer(path))
    _check_vocab_size(tokenizers[-1], path, size)
  if tok_config.joint:
    return tokenizers[0], tokenizers[0]
  return tokenizers[0], tokenizers[1]
