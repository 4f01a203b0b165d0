"""The tokenizer of a Hugging Face Llama-family folder (Llama, Qwen2,
Mistral), equal to `transformers.AutoTokenizer` on that folder.

What AutoTokenizer builds from the folder (tokenizer.json, or tokenizer.model
converted to a byte-fallback BPE; the added and special tokens of the chat
template; BOS/EOS added by the post-processor as tokenizer_config.json says)
is a `tokenizers.Tokenizer`: it is kept whole, as JSON, with what
AutoTokenizer does beside it in Python (the special ids, the cleanup of
spaces in decoded text). interop/hf_folders.py makes one from a folder;
this module needs only the `tokenizers` library.

It is used like `Tokenizer` everywhere (encode, decode, the special ids,
serialized bytes in checkpoints and exports): `tokenizer.from_serialized`
tells the kinds apart by the bytes. Unlike jaxformer's own tokenizers,
`encode` adds what Hugging Face adds (BOS for Llama, nothing for Qwen2),
not an EOS after every text; `decode` reads generated ids as `generate`
output is read: up to the first of `eos_ids`, special tokens skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxformer.data import sources

FORMAT = 'jaxformer-hf-tokenizer-1'
# How the serialized bytes start (json.dumps writes 'format' first).
MARKER = json.dumps({'format': FORMAT})[:-1].encode()
INSTALL = 'pip install -e ".[interop]"'
# PreTrainedTokenizerBase.clean_up_tokenization, in order.
CLEAN_UP = ((' .', '.'), (' ?', '?'), (' !', '!'), (' ,', ','), (" ' ", "'"),
            (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
            (" 're", "'re"))


def is_serialized(data: bytes) -> bool:
  """Whether `data` is an `HFTokenizer.serialized_model_proto()`."""
  return data.startswith(MARKER)


def backend(tokenizer_json: str, name: str):
  """The `tokenizers.Tokenizer` of its JSON; a DataError naming the install
  command when the library is missing, or `name` when the JSON is bad."""
  try:
    import tokenizers
  except ImportError:
    raise sources.DataError(f'{name}: a Hugging Face tokenizer needs the '
                            f'`tokenizers` library: {INSTALL}') from None
  try:
    return tokenizers.Tokenizer.from_str(tokenizer_json)
  except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception.
    raise sources.DataError(f'{name}: not a `tokenizers` tokenizer ({e})'
                            ) from None


def clean_up_spaces(text: str) -> str:
  """Hugging Face's clean_up_tokenization: ' .' -> '.', " n't" -> "n't"..."""
  for before, after in CLEAN_UP:
    text = text.replace(before, after)
  return text


class HFTokenizer:
  """A Hugging Face tokenizer: its `tokenizers` JSON and special ids.

  bos_id, unk_id: None where the tokenizer has none (Qwen2 has no BOS,
  byte-level BPE no unknown token). eos_id: the tokenizer's EOS (what
  add_eos_token appends), else the first of `eos_ids`: the ids that end
  generation (generation_config.json's eos_token_id, one or several).
  pad_id: the pad token, else what `generate` pads with (the generation
  config's pad_token_id, else the first of eos_ids). `clean_up`: decoded
  text goes through `clean_up_spaces` (as AutoTokenizer does where
  clean_up_tokenization_spaces is set and the model is not BPE).
  `files`: the folder's other tokenizer files ({name: text}, e.g.
  tokenizer_config.json with the chat template), for exports.
  """

  def __init__(self, tokenizer_json: str, *, eos_ids: Sequence[int],
               pad_id: int, eos_id: int | None = None,
               bos_id: int | None = None, unk_id: int | None = None,
               clean_up: bool = False, split_special_tokens: bool = False,
               files: Mapping[str, str] | None = None,
               name: str = 'tokenizer.json'):
    self._json = tokenizer_json
    self._backend = backend(tokenizer_json, name)
    # AutoTokenizer encodes without the padding and truncation a
    # tokenizer.json may carry, and matches added tokens in the text unless
    # split_special_tokens (a flag the JSON does not keep).
    self._backend.no_padding()
    self._backend.no_truncation()
    self._backend.encode_special_tokens = split_special_tokens
    self.split_special_tokens = split_special_tokens
    if not eos_ids:
      raise sources.DataError(f'{name}: no EOS id')
    self.eos_ids = tuple(int(i) for i in eos_ids)
    self.eos_id = self.eos_ids[0] if eos_id is None else int(eos_id)
    self.pad_id, self.bos_id, self.unk_id = pad_id, bos_id, unk_id
    self.clean_up = clean_up
    self.files = dict(files or {})
    self.name = name
    self._vocab_size = 1 + max(
        self._backend.get_vocab(with_added_tokens=True).values(), default=-1)
    outside = [i for i in (*self.eos_ids, self.eos_id, pad_id, bos_id, unk_id)
               if i is not None and not 0 <= i < self._vocab_size]
    if outside:
      raise sources.DataError(f'{name}: special id {outside[0]} is not one of '
                              f'the tokenizer\'s ids 0..{self._vocab_size - 1}')

  # ------------------------------------------------------ serialized form ---

  def _fields(self) -> dict:
    return {'format': FORMAT, 'tokenizer': self._json,
            'eos_ids': list(self.eos_ids), 'eos_id': self.eos_id,
            'pad_id': self.pad_id, 'bos_id': self.bos_id,
            'unk_id': self.unk_id, 'clean_up': self.clean_up,
            'split_special_tokens': self.split_special_tokens,
            'files': self.files}

  def serialized_model_proto(self) -> bytes:
    """The whole tokenizer as bytes (JSON starting with MARKER), kept in
    checkpoints and exports."""
    return json.dumps(self._fields()).encode()

  @classmethod
  def from_serialized(cls, data: bytes, name: str = 'model') -> HFTokenizer:
    """The inverse of `serialized_model_proto()`."""
    try:
      fields = json.loads(data)
      assert fields.pop('format') == FORMAT
      tokenizer_json = fields.pop('tokenizer')
      assert isinstance(tokenizer_json, str)
      return cls(tokenizer_json, name=name, **fields)
    except sources.DataError:
      raise
    except (ValueError, KeyError, AssertionError, TypeError):
      raise sources.DataError(f'{name}: not a jaxformer Hugging Face '
                              f'tokenizer (format {FORMAT})') from None

  def hf_files(self) -> dict[str, bytes]:
    """The files of a Hugging Face folder that AutoTokenizer reads back as
    this tokenizer: tokenizer.json and the folder's other tokenizer files,
    tokenizer_config.json naming the class that takes tokenizer.json as it
    is (a model's own class, LlamaTokenizer, may rebuild its normalizer)."""
    files = {name: text.encode() for name, text in self.files.items()}
    files['tokenizer.json'] = self._backend.to_str(pretty=True).encode()
    settings = json.loads(self.files.get('tokenizer_config.json', '{}'))
    if 'tokenizer_config.json' not in self.files:
      settings.update({f'{name}_token': self.id_to_piece(i) for name, i in (
          ('bos', self.bos_id), ('eos', self.eos_id), ('unk', self.unk_id),
          ('pad', self.pad_id)) if i is not None})
    settings['tokenizer_class'] = 'PreTrainedTokenizerFast'
    files['tokenizer_config.json'] = json.dumps(
        settings, indent=2, ensure_ascii=False).encode()
    return files

  # -------------------------------------------------------------- the ids ---

  @property
  def first_token_is_input(self) -> bool:
    """Without a BOS, a text's first token is the model's first input."""
    return self.bos_id is None

  @property
  def vocab_size(self) -> int:
    """1 + the largest id the tokenizer has (added tokens included)."""
    return self._vocab_size

  def id_to_piece(self, token_id: int) -> str:
    return self._backend.id_to_token(int(token_id)) or ''

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, as `AutoTokenizer(texts)['input_ids']`."""
    return [encoding.ids for encoding in self._backend.encode_batch(
        list(texts), add_special_tokens=True)]

  def encode_pair(self, text_a: str, text_b: str | None = None,
                  max_length: int | None = None
                  ) -> tuple[list[int], list[int]]:
    """(token ids, token type ids) of a sentence pair (or of `text_a`
    alone), as `AutoTokenizer(text_a, text_b)`: [CLS] a [SEP] b [SEP] for
    BERT, <s> a </s></s> b </s> for RoBERTa; with `max_length`, cut as
    truncation=True (longest_first) cuts them."""
    return self.encode_pairs([(text_a, text_b)], max_length)[0]

  def encode_pairs(self, pairs: Sequence[tuple[str, str | None]],
                   max_length: int | None = None
                   ) -> list[tuple[list[int], list[int]]]:
    """`encode_pair` of each (text_a, text_b), in one batch."""
    # AutoTokenizer reads an empty text_b as none.
    inputs = [(a, b) if b else a for a, b in pairs]
    if max_length is not None:
      self._backend.enable_truncation(max_length, strategy='longest_first')
    try:
      encodings = self._backend.encode_batch(inputs, add_special_tokens=True)
    finally:
      self._backend.no_truncation()
    return [(e.ids, e.type_ids) for e in encodings]

  def _cut(self, ids: Iterable[int]) -> list[int]:
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ends = np.flatnonzero(np.isin(ids, self.eos_ids))
    if ends.size:
      ids = ids[:ends[0]]
    return ids[ids != self.pad_id].tolist()

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` [length] up to the first of eos_ids, without padding,
    as `AutoTokenizer.decode(ids, skip_special_tokens=True)`."""
    text = self._backend.decode(self._cut(ids), skip_special_tokens=True)
    return clean_up_spaces(text) if self.clean_up else text

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    """Texts of each row of `ids` [batch, length]."""
    texts = self._backend.decode_batch([self._cut(row) for row in ids],
                                       skip_special_tokens=True)
    return [clean_up_spaces(t) for t in texts] if self.clean_up else texts
