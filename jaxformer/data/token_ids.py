"""The special token ids every part of jaxformer agrees on.

The tokenizers are trained with them (`data/tokenizer.py` rejects a model
with other ids), the model takes 0 as padding (segment id 0) and as the
decoder's start token, and decoding stops at EOS (`decode.py`). They live
here, below both the data and the model layers, so that each imports the
one definition.

  PAD_ID = 0  padding; also the decoder's start token: targets are shifted
              right inside the model, with 0 at the start of each segment.
  EOS_ID = 1  ends every encoded sequence (source and target).
  UNK_ID = 2  pieces outside the vocabulary.
  BOS_ID = 3  reserved, unused by translation.
"""
PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
BOS_ID = 3


def joined_pair(ids_a: list[int], ids_b: list[int] | None = None
                ) -> tuple[list[int], list[int]]:
  """A sentence pair as jaxformer's own tokenizers encode it (`encode_pair`):
  (a's ids, each text's ending with its EOS, then b's; the token types, 0
  for a's ids and 1 for b's); without b, a's ids and types."""
  ids_b = [] if ids_b is None else ids_b
  return list(ids_a) + list(ids_b), [0] * len(ids_a) + [1] * len(ids_b)
