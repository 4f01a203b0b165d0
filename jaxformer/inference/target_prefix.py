"""Target prefixes (`translate --target-prefix`), as CTranslate2's
`target_prefix`: each translation starts with the prefix's tokens and the
search continues from them, greedy or beam.

A prefix is forced the way a many-to-many model's target language token is
(`search.forcing_prefix`): the searches take forced ids [batch, p], -1
where a row's prefix has ended. A model with language tokens forces its
language token first, then the prefix.
"""
from collections.abc import Sequence

import numpy as np

from jaxformer.data import language_tokenizer
from jaxformer.data.tokenizer import Tokenizer


def text_ids(target_tok: Tokenizer, text: str) -> list[int]:
  """The target tokens of `text`, without the EOS that ends an encoded text
  (nor a language token)."""
  inner = getattr(target_tok, 'inner', target_tok)
  pieces = inner.encode([text])[0]
  return pieces[:-1] if pieces and pieces[-1] == inner.eos_id else pieces


def prefix_ids(target_tok: Tokenizer, text: str | None) -> list[int]:
  """The tokens a translation starts with: the target language's (a
  many-to-many model's), then those of `text`."""
  first = language_tokenizer.first_id(target_tok)
  ids = [] if first is None else [first]
  return ids + (text_ids(target_tok, text) if text else [])


def forced_ids(target_tok: Tokenizer, prefixes: Sequence[str | None] | None,
               rows: int):
  """What the searches force for `rows` rows whose first ones have
  `prefixes` (None: no prefix; the rows after them none either): [rows, p]
  int32, -1 past each row's prefix; or, without any prefix, the target
  language token (one id), or None where there is none."""
  if not prefixes or not any(prefixes):
    return language_tokenizer.first_id(target_tok)
  forced = [prefix_ids(target_tok, text) for text in prefixes]
  width = max(map(len, forced))
  out = np.full((rows, width), -1, np.int32)
  first = language_tokenizer.first_id(target_tok)
  if first is not None:
    out[:, 0] = first
  for row, ids in enumerate(forced):
    out[row, :len(ids)] = ids
  return out


def width(forced) -> int:
  """How many leading positions `forced` (as `forced_ids` returns it) may
  fix."""
  return 1 if forced is None or np.ndim(forced) < 2 else np.shape(forced)[1]
