"""The examples of classification and regression: a text, or a sentence
pair, with its label; and their tokens.

A 'tsv' file of these tasks holds lines 'text<TAB>label' or, for sentence
pairs, 'text_a<TAB>text_b<TAB>label'. Its first line sets how many columns
every line has; a line with another count is an error naming it. The other
sources give one text per example (`sources.read_split`'s pairs).

A pair is encoded by the tokenizer's `encode_pair` (ids and token types:
0 for the first text and its end token, 1 for the second and its end
token, for jaxformer's own tokenizers) and cut to the row width longest
first, as Hugging Face's `truncation='longest_first'`: a token at a time
from the longer part (from the second on a tie), each part keeping its own
last token.
"""
from __future__ import annotations

from collections.abc import Sequence

import ml_collections
import numpy as np

from jaxformer.data import sources

Text = str | tuple[str, str]  # A text, or a sentence pair.
COLUMNS = {2: "'text<TAB>label'", 3: "'text_a<TAB>text_b<TAB>label'"}


def _tsv_examples(path: str) -> tuple[list[Text], list[str]]:
  texts, labels, columns = [], [], None
  for number, line in enumerate(sources.iter_lines(path), start=1):
    fields = line.split('\t')
    if columns is None and len(fields) not in COLUMNS:
      raise sources.DataError(
          f'{path}:1: {len(fields)} column(s); labelled lines are '
          f'{" or ".join(COLUMNS.values())}, with tabs between the columns '
          'and none inside them')
    columns = columns or len(fields)
    if len(fields) != columns:
      raise sources.DataError(
          f'{path}:{number}: {len(fields)} column(s), but line 1 has '
          f'{columns}; a file holds {COLUMNS[2]} lines or {COLUMNS[3]} lines '
          '(sentence pairs), not both (remove tabs inside texts)')
    texts.append(fields[0] if columns == 2 else (fields[0], fields[1]))
    labels.append(fields[-1])
  return texts, labels


def read_split(data_config: ml_collections.ConfigDict, split: str
               ) -> tuple[list[Text], list[str]]:
  """(texts or pairs, labels) of `split`: a 'tsv' file's texts are pairs
  when its lines have three columns."""
  files = sources.split_files(data_config, split)
  if data_config.source == 'tsv' and files:
    return _tsv_examples(files[0])
  pairs = sources.read_split(data_config, split)
  return [text for text, _ in pairs], [label for _, label in pairs]


def cut_pair(ids: Sequence[int], types: Sequence[int], width: int
             ) -> tuple[list[int], list[int]]:
  """`ids` and `types` of an encoded pair cut to `width` tokens longest
  first (the parts are where the type changes; with one type, the end is
  cut but for the last token)."""
  ids, types = list(ids), list(types)
  if len(ids) <= width:
    return ids, types
  split = next((i for i, t in enumerate(types) if t != types[0]), len(ids))
  if split == len(ids):
    return ids[:width - 1] + ids[-1:], types[:width - 1] + types[-1:]
  keep = [split, len(ids) - split]
  while sum(keep) > width and max(keep) > 1:
    keep[0 if keep[0] > keep[1] else 1] -= 1
  parts = [(0, split, keep[0]), (split, len(ids), keep[1])]
  chosen = [i for start, end, kept in parts
            for i in list(range(start, start + kept - 1)) + [end - 1]]
  return [ids[i] for i in chosen], [types[i] for i in chosen]


def encode(tokenizer, texts: Sequence[Text], width: int
           ) -> tuple[list[list[int]], list[list[int]]]:
  """(ids, token types) of each text or pair (types all 0 for a text),
  pairs cut to `width` tokens (`cut_pair`)."""
  if not texts or isinstance(texts[0], str):
    ids = tokenizer.encode(texts)
    return ids, [[0] * len(each) for each in ids]
  encoded = [cut_pair(*tokenizer.encode_pair(a, b), width) for a, b in texts]
  return [ids for ids, _ in encoded], [types for _, types in encoded]


def _padded(lists: Sequence[Sequence[int]], width: int) -> np.ndarray:
  """[examples, width] int32: each list cut to `width` (still ending with
  its last item), then padded with 0."""
  rows = np.zeros((len(lists), width), np.int32)
  for row, items in enumerate(lists):
    cut = list(items[:width])
    if cut and len(items) > width:
      cut[-1] = items[-1]
    rows[row, :len(cut)] = cut
  return rows


def pad_token_rows(token_lists: Sequence[Sequence[int]], width: int,
                   token_types: Sequence[Sequence[int]] | None = None
                   ) -> dict[str, np.ndarray]:
  """'inputs', 'inputs_segment_ids', 'inputs_positions' [examples, width]
  int32: one example per row, cut to `width` tokens (still ending with its
  last token, EOS); segment id 0 marks padding. With `token_types` (a list
  per example, as long as its tokens) 'inputs_token_types' too."""
  lengths = np.array([[min(len(ids), width)] for ids in token_lists],
                     np.int32).reshape(-1, 1)
  present = np.arange(width) < lengths
  positions = np.where(present, np.arange(width, dtype=np.int32), 0)
  rows = {'inputs': _padded(token_lists, width),
          'inputs_segment_ids': present.astype(np.int32),
          'inputs_positions': positions}
  if token_types is not None:
    rows['inputs_token_types'] = _padded(token_types, width)
  return rows
