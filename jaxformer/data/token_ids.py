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
