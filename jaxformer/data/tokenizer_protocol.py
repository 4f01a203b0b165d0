"""What every tokenizer of jaxformer is: one interface that its own
SentencePiece models (tokenizer.py), imported vocabularies
(vocab_tokenizer.py), Hugging Face tokenizers (hf_tokenizer.py) and the
language-token wrapper of many-to-many models (language_tokenizer.py) all
implement, so that callers use it without probing for attributes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class TokenizerLike(Protocol):
  """Ids, pieces, special ids, sentence pairs and a vocabulary's bytes.

  pad_id, eos_id, unk_id: the special ids (unk None where there is none);
  bos_id: the beginning-of-text id a text's encoding may start with (None:
  none); eos_ids: the ids a generated text ends at (() : the model's
  eos_id); first_token_is_input: a text's first token is the model's first
  input, not its first target (a Hugging Face tokenizer that adds no BOS).
  """
  pad_id: int
  eos_id: int
  unk_id: int | None
  bos_id: int | None
  eos_ids: tuple[int, ...]
  first_token_is_input: bool

  @property
  def vocab_size(self) -> int: ...

  def serialized_model_proto(self) -> bytes: ...

  def id_to_piece(self, token_id: int) -> str: ...

  def encode(self, texts: Sequence[str]) -> list[list[int]]: ...

  def encode_pairs(self, pairs: Sequence[tuple[str, str | None]]
                   ) -> list[tuple[list[int], list[int]]]:
    """(ids, token types) of each sentence pair (b None: a text alone)."""

  def decode(self, ids: Iterable[int]) -> str: ...

  def decode_batch(self, ids: np.ndarray) -> list[str]: ...

  def hf_files(self) -> dict[str, bytes]:
    """The files of a Hugging Face tokenizer folder ({}: not one)."""
