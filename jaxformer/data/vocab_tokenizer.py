"""A SentencePiece segmenter with its own piece -> id vocabulary: how Marian
(OPUS-MT) models tokenise, and equal to `transformers.MarianTokenizer`.

The SentencePiece model only cuts text into pieces; the ids are those of a
separate vocabulary (Marian's vocab.json: '</s>' 0, '<unk>' 1, ..., '<pad>'
last). A piece outside the vocabulary is the unknown id. A text starting
with a language code '>>xx<<' keeps the code as one piece. Decoding maps
ids to pieces, drops the special ones (eos, pad, unk: what
`MarianTokenizer.decode(..., skip_special_tokens=True)` drops) and joins the
rest with the decoding model (Marian decodes a shared vocabulary with the
source model).

It is used like `Tokenizer` everywhere (encode, decode, the special ids,
serialized bytes in checkpoints): `tokenizer.from_serialized` tells the two
apart by the bytes.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import sentencepiece as spm

from jaxformer.data import sources
from jaxformer.data.token_ids import joined_pair

FORMAT = 'jaxformer-vocab-tokenizer-1'
SPECIAL_PIECES = {'eos': '</s>', 'unk': '<unk>', 'pad': '<pad>'}


def _processor(model_proto: bytes, name: str) -> spm.SentencePieceProcessor:
  processor = spm.SentencePieceProcessor()
  try:
    processor.LoadFromSerializedProto(model_proto)
  except RuntimeError as e:
    raise sources.DataError(f'{name}: not a SentencePiece model ({e})') from None
  return processor


def vocabulary_list(vocab: Mapping[str, int], name: str) -> list[str]:
  """The pieces of a piece -> id mapping in id order; the ids must be
  0..n-1, each once, and the special pieces present."""
  pieces = [None] * len(vocab)
  for piece, index in vocab.items():
    if not isinstance(index, int) or not 0 <= index < len(vocab) or (
        pieces[index] is not None):
      raise sources.DataError(
          f'{name}: id {index!r} of {piece!r} is not one of 0..{len(vocab) - 1}'
          ' once each; is it a Marian vocab.json?')
    pieces[index] = piece
  missing = [p for p in SPECIAL_PIECES.values() if p not in vocab]
  if missing:
    raise sources.DataError(f'{name}: no {missing} piece; a Marian vocabulary '
                            "has '</s>', '<unk>' and '<pad>'")
  return pieces


class VocabTokenizer:
  """Pieces from `encode_model`, ids from `pieces` (id -> piece); text from
  `decode_model` (default: the encoding one)."""

  bos_id = None
  eos_ids = ()  # A generated text ends at the model's eos_id.
  first_token_is_input = False

  def __init__(self, encode_model: bytes, pieces: Sequence[str],
               decode_model: bytes | None = None, name: str = 'vocabulary'):
    self._encode_proto, self._decode_proto = encode_model, decode_model
    self._encoder = _processor(encode_model, name)
    self._decoder = (self._encoder if decode_model is None
                     else _processor(decode_model, name))
    self._pieces = list(pieces)
    self._ids = {piece: i for i, piece in enumerate(self._pieces)}
    self.name = name
    for key, piece in SPECIAL_PIECES.items():
      if piece not in self._ids:
        raise sources.DataError(f'{name}: no {piece!r} piece in the vocabulary')
      setattr(self, f'{key}_id', self._ids[piece])
    self._special = np.array([self.eos_id, self.pad_id, self.unk_id])

  @classmethod
  def from_serialized(cls, data: bytes, name: str = 'model') -> VocabTokenizer:
    """The inverse of `serialized_model_proto()`."""
    try:
      fields = json.loads(data)
      assert fields['format'] == FORMAT
      decode_model = fields.get('decode_model')
      return cls(base64.b64decode(fields['encode_model']), fields['pieces'],
                 None if decode_model is None else base64.b64decode(
                     decode_model), name)
    except (ValueError, KeyError, AssertionError, TypeError):
      raise sources.DataError(f'{name}: not a jaxformer vocabulary tokenizer '
                              f'(format {FORMAT})') from None

  def serialized_model_proto(self) -> bytes:
    """The whole tokenizer as bytes (JSON), kept in checkpoints and
    exports."""
    fields = {'format': FORMAT, 'pieces': self._pieces,
              'encode_model': base64.b64encode(self._encode_proto).decode()}
    if self._decode_proto is not None:
      fields['decode_model'] = base64.b64encode(self._decode_proto).decode()
    return json.dumps(fields).encode()

  @property
  def vocab_size(self) -> int:
    return len(self._pieces)

  @property
  def sentencepiece_model(self) -> bytes:
    """The SentencePiece model that cuts text into pieces (what exports
    ship as source.spm / target.spm)."""
    return self._encode_proto

  def id_to_piece(self, token_id: int) -> str:
    return self._pieces[int(token_id)]

  def _pieces_of(self, text: str) -> list[str]:
    code = []
    if text.startswith('>>') and (end := text.find('<<')) != -1:
      code, text = [text[:end + 2]], text[end + 2:]
    return code + self._encoder.encode(text, out_type=str)

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, each list ending with eos_id."""
    return [[self._ids.get(piece, self.unk_id)
             for piece in self._pieces_of(text)] + [self.eos_id]
            for text in texts]

  def encode_pair(self, text_a: str, text_b: str | None = None
                  ) -> tuple[list[int], list[int]]:
    """(ids, token types) of a sentence pair: a's pieces + eos_id, then b's
    pieces + eos_id; types 0 for a and its eos, 1 for b and its eos.
    Without text_b, a's ids + eos_id, types 0."""
    return joined_pair(*self.encode(
        [text_a] if text_b is None else [text_a, text_b]))

  def encode_pairs(self, pairs: Sequence[tuple[str, str | None]]
                   ) -> list[tuple[list[int], list[int]]]:
    return [self.encode_pair(a, b) for a, b in pairs]

  def hf_files(self) -> dict[str, bytes]:
    return {}  # Not a Hugging Face tokenizer.

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` [length] up to the first eos_id, without the special
    pieces."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    eos_positions = np.flatnonzero(ids == self.eos_id)
    if eos_positions.size:
      ids = ids[:eos_positions[0]]
    ids = ids[~np.isin(ids, self._special)]
    text = self._decoder.decode_pieces([self._pieces[i] for i in ids])
    return text.replace('\u2581', ' ').strip()

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    """Texts of each row of `ids` [batch, length]."""
    return [self.decode(row) for row in ids]


def read_json(path: str) -> dict:
  """The JSON of the file `path`, read only if it holds at most
  `sources.MAX_FILE_BYTES`; else, or if it is not JSON, a DataError."""
  data = sources.read_bytes(path)
  try:
    return json.loads(data)
  except ValueError as e:
    raise sources.DataError(f'{path} is not JSON ({e})') from None


def from_marian_folder(folder: str) -> tuple[VocabTokenizer, VocabTokenizer]:
  """(source, target) tokenizers of a Hugging Face Marian folder: source.spm,
  target.spm, vocab.json and, for separate vocabularies, target_vocab.json.
  Raises DataError naming a missing or unusable file."""
  def path(name):
    full = os.path.join(folder, name)
    if not os.path.isfile(full):
      raise sources.DataError(f'{full} is missing; a Marian folder has '
                              'source.spm, target.spm and vocab.json')
    return full

  def vocab(name):
    mapping = read_json(path(name))
    if not isinstance(mapping, dict):
      raise sources.DataError(f'{path(name)}: not a JSON piece -> id mapping')
    return vocabulary_list(mapping, path(name))

  source_model, target_model = (sources.read_bytes(path('source.spm')),
                                 sources.read_bytes(path('target.spm')))
  source_pieces = vocab('vocab.json')
  separate = os.path.isfile(os.path.join(folder, 'target_vocab.json'))
  if separate:
    return (VocabTokenizer(source_model, source_pieces, name='source.spm'),
            VocabTokenizer(target_model, vocab('target_vocab.json'),
                           name='target.spm'))
  source = VocabTokenizer(source_model, source_pieces, name='source.spm')
  # MarianTokenizer decodes a shared vocabulary with the source model.
  return source, VocabTokenizer(target_model, source_pieces, source_model,
                                name='target.spm')
