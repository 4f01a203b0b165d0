"""The tokenizer of a many-to-many translator (M2M100, NLLB-200): a
tokenizer of text (`inner`) and language tokens, equal to Hugging Face's
`M2M100Tokenizer` / `NllbTokenizer` with `tok.src_lang = code`.

A source is `[language] + pieces + [</s>]` (NLLB's legacy_behaviour:
`pieces + [</s>, language]`); decoding generates the target language token
first (forced, as `forced_bos_token_id`), and `decode` drops it with the
other special ids. `inner` is a `VocabTokenizer` (M2M100: SentencePiece
pieces looked up in vocab.json) or an `HFTokenizer` (NLLB's
tokenizer.json, its post-processor reduced to `$A </s>`); either encodes
`pieces + [</s>]`. Ids past the inner vocabulary (M2M100's language
tokens, and up to the model's vocabulary fairseq's unused 'madeupwordN'
ids) are named by `pieces`.

A tokenizer is bound to one source language (`language`);
`with_language(code)` gives one bound to another (same vocabulary).
"""

from __future__ import annotations

import base64
import difflib
import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from jaxformer.data import sources

FORMAT = 'jaxformer-language-tokenizer-1'
MARKER = json.dumps({'format': FORMAT})[:-1].encode()
LAYOUTS = ('prefix', 'suffix')


def is_serialized(data: bytes) -> bool:
  return data.startswith(MARKER)


class LanguageTokenizer:
  """`inner` with `languages` ({code: token id}); `pieces` names the ids
  past the inner vocabulary ({id: piece}) up to `vocab_size`."""

  def __init__(self, inner, languages: Mapping[str, int], *, vocab_size: int,
               language: str, pieces: Mapping[int, str] | None = None,
               layout: str = 'prefix', name: str = 'tokenizer'):
    if layout not in LAYOUTS:
      raise sources.DataError(f'{name}: layout {layout!r} is not one of '
                              f'{LAYOUTS}')
    self.inner, self.name, self.layout = inner, name, layout
    self.languages = {str(k): int(v) for k, v in languages.items()}
    self._pieces = {int(k): str(v) for k, v in (pieces or {}).items()}
    self._vocab_size = int(vocab_size)
    if not self.languages:
      raise sources.DataError(f'{name}: no language tokens')
    outside = [i for i in self.languages.values()
               if not 0 <= i < self._vocab_size]
    if outside:
      raise sources.DataError(f'{name}: language id {outside[0]} is not below '
                              f'the vocabulary size {self._vocab_size}')
    self.eos_id, self.pad_id = inner.eos_id, inner.pad_id
    self.unk_id = inner.unk_id
    self.bos_id, self.eos_ids = inner.bos_id, inner.eos_ids
    self.first_token_is_input = inner.first_token_is_input
    self._dropped = np.array(sorted(
        {*self.languages.values(), self.pad_id, self.unk_id,
         *([] if self.bos_id is None else [self.bos_id])}), np.int64)
    self.language = language
    self.language_id(language)

  # ------------------------------------------------------------ languages ---

  def language_id(self, code: str) -> int:
    """The token id of the language `code` ('de', 'deu_Latn'); a DataError
    naming the close codes when the tokenizer has no such language."""
    if code in self.languages:
      return self.languages[code]
    close = difflib.get_close_matches(code, list(self.languages), n=5,
                                      cutoff=0.5)
    hint = (f'close ones: {", ".join(close)}' if close else
            f'it has {len(self.languages)}, e.g. '
            f'{", ".join(list(self.languages)[:5])}')
    raise sources.DataError(f'language code {code!r} is not one of this '
                            f'tokenizer\'s ({hint})')

  @property
  def first_id(self) -> int:
    """The token a text of this tokenizer's language starts with: what
    decoding into this language forces first."""
    return self.languages[self.language]

  def with_language(self, code: str) -> LanguageTokenizer:
    """This tokenizer, encoding sources in the language `code`."""
    self.language_id(code)
    other = object.__new__(LanguageTokenizer)
    other.__dict__.update(self.__dict__, language=code)
    return other

  # ------------------------------------------------------ serialized form ---

  def serialized_model_proto(self) -> bytes:
    """The whole tokenizer as bytes (JSON starting with MARKER)."""
    return json.dumps({
        'format': FORMAT, 'inner': base64.b64encode(
            self.inner.serialized_model_proto()).decode(),
        'languages': self.languages, 'vocab_size': self._vocab_size,
        'language': self.language, 'pieces': self._pieces,
        'layout': self.layout}).encode()

  @classmethod
  def from_serialized(cls, data: bytes, name: str = 'model', *,
                      inner_from_serialized) -> LanguageTokenizer:
    """The inverse of `serialized_model_proto()`; `inner_from_serialized`
    (`tokenizer.from_serialized`, which dispatches here) reads the inner
    tokenizer's bytes."""
    fields = {}
    if is_serialized(data):
      try:
        fields = json.loads(data)
        fields['inner'] = base64.b64decode(fields['inner'])
      except (ValueError, KeyError, TypeError):
        fields = {}
    if set(fields) != {'format', 'inner', 'languages', 'vocab_size',
                       'language', 'pieces', 'layout'}:
      raise sources.DataError(f'{name}: not a jaxformer language tokenizer '
                              f'(format {FORMAT})')
    del fields['format']
    inner = inner_from_serialized(fields.pop('inner'), name)
    return cls(inner, name=name, **fields)

  # -------------------------------------------------------------- the ids ---

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def sentencepiece_model(self) -> bytes:
    return self.inner.sentencepiece_model

  def id_to_piece(self, token_id: int) -> str:
    token_id = int(token_id)
    if token_id in self._pieces:
      return self._pieces[token_id]
    return self.inner.id_to_piece(token_id)

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text in `language`, as Hugging Face's tokenizer
    with src_lang = language."""
    language = [self.languages[self.language]]
    rows = self.inner.encode(texts)
    if self.layout == 'prefix':
      return [language + row for row in rows]
    return [row + language for row in rows]

  def encode_pairs(self, pairs: Sequence[tuple[str, str | None]]
                   ) -> list[tuple[list[int], list[int]]]:
    raise sources.DataError(
        f'{self.name}: a many-to-many translator\'s tokenizer encodes no '
        'sentence pairs; give one text per line')

  def hf_files(self) -> dict[str, bytes]:
    return self.inner.hf_files()

  def decode(self, ids: Iterable[int]) -> str:
    """Text of `ids` [length] up to the first EOS, without the language
    tokens and the other special ids."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    ends = np.flatnonzero(ids == self.eos_id)
    if ends.size:
      ids = ids[:ends[0]]
    keep = ~np.isin(ids, self._dropped) & (ids < self.inner.vocab_size)
    return self.inner.decode(ids[keep])

  def decode_batch(self, ids: np.ndarray) -> list[str]:
    return [self.decode(row) for row in ids]


def bind_pair(source_tok, target_tok, data_config):
  """(source_tok, target_tok) in the languages data_config.source_lang and
  target_lang, which a many-to-many model's tokenizers need and others'
  must not have; a DataError naming the key otherwise."""
  pair = {key: data_config.get(key, '') for key in ('source_lang',
                                                     'target_lang')}
  if not isinstance(source_tok, LanguageTokenizer):
    named = [key for key, code in pair.items() if code]
    if named:
      raise sources.DataError(
          f'data.{named[0]}={pair[named[0]]!r}: this model has no language '
          'tokens (only many-to-many models, M2M100 and NLLB, take a pair)')
    return source_tok, target_tok
  for key, code in pair.items():
    if not code:
      flag = key.replace('_lang', '-lang')
      raise sources.DataError(
          f'this many-to-many model needs its language pair: --{flag} CODE '
          f'(config data.{key}), one of {len(source_tok.languages)} codes '
          f'such as {", ".join(list(source_tok.languages)[:4])}')
  return (source_tok.with_language(pair['source_lang']),
          target_tok.with_language(pair['target_lang']))


def first_id(target_tok) -> int | None:
  """The id decoding with `target_tok` forces first (its language's token),
  None for a tokenizer without languages."""
  return target_tok.first_id if isinstance(target_tok, LanguageTokenizer) \
      else None
