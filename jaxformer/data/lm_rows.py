"""The rows of a language model (`data.lm_rows`), from any tokenizer:
jaxformer's own (whose `encode` ends every text with EOS) or a Hugging Face
one (`hf_tokenizer.HFTokenizer`: BOS where the model has one, no EOS).

The model puts its start token (`decoder_start_id`: an imported model's
BOS) before each row's first target, so a row holds no BOS of its own:
a Llama model then trains on [BOS, text] -> [text, EOS], as Hugging Face's
does, and `generate` feeds the prompt with its BOS at position 0. A model
whose tokenizer adds no BOS (Qwen2's) reads a prompt from its first token,
as Hugging Face's does: its prompt/response rows start with that token
('targets_start', below), so that it trains on [prompt, response] ->
[prompt[1:], response, EOS] and `generate` feeds what it trained on.

  'packed'           one document per line: each is text + EOS, the
                     documents concatenated and cut into rows; every token
                     is trained on.
  'prompt_response'  'prompt<TAB>response' lines: one pair per row,
                     prompt + response + EOS (as Hugging Face chat
                     fine-tuning makes them; the response is encoded on
                     its own), padded, cut at the row's width; the loss
                     falls on the response and its EOS only: 'LOSS_MASK'
                     [rows, width] int32 is 1 there, 0 elsewhere;
                     'targets_start' [rows] int32 is each row's first
                     input: -1 (the model's start token), or, without a
                     BOS, the prompt's first token (the row's targets then
                     begin with its second).
  'chat'             one conversation a line, JSON {"messages": [...]}
                     (data.source=text; or records whose 'messages' field
                     holds the list, data.source=jsonl or parquet),
                     rendered with the tokenizer's chat
                     template (data/chat_template.py): one per row, laid
                     out as 'prompt_response', the loss on the assistant's
                     tokens (as apply_chat_template's assistant mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxformer.data import chat_template, sources

LM_ROWS = ('packed', 'prompt_response', 'chat')
# The layouts whose rows carry LOSS_MASK and ROW_START.
MASKED_LAYOUTS = ('prompt_response', 'chat')
# The batch key of the per-token loss mask (1: trained on, 0: not).
LOSS_MASK = 'targets_loss_mask'
# The batch key of each row's first input (-1: the model's start token).
ROW_START = 'targets_start'


def _without_eos(tokenizer, ids: list[int]) -> list[int]:
  return ids[:-1] if ids[-1:] == [tokenizer.eos_id] else ids


def _without_bos(tokenizer, ids: list[int]) -> list[int]:
  bos = tokenizer.bos_id
  return ids[1:] if bos is not None and ids[:1] == [bos] else ids


def document_ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  """Token ids of each text as `tokenizer.encode` makes them, without the
  BOS a Hugging Face tokenizer adds (the model's start token stands for
  it), each ending with one EOS."""
  return [_without_eos(tokenizer, _without_bos(tokenizer, ids))
          + [tokenizer.eos_id] for ids in tokenizer.encode(texts)]


def pair_ids(tokenizer, prompts: Sequence[str], responses: Sequence[str]
             ) -> list[tuple[list[int], int]]:
  """(prompt + response + EOS, where the response starts) of each pair:
  each encoded as a text without BOS, the prompt without its EOS."""
  return [(prompt[:-1] + response, len(prompt) - 1)
          for prompt, response in zip(document_ids(tokenizer, prompts),
                                      document_ids(tokenizer, responses))]


def pack_documents(token_lists: Sequence[Sequence[int]], width: int
                   ) -> dict[str, np.ndarray]:
  """'targets', 'targets_segment_ids', 'targets_positions' [rows, width] int32:
  the documents concatenated and cut into rows; segment k + 1 of a row is its
  k-th (piece of a) document, positions restart at each segment."""
  lengths = np.array([len(ids) for ids in token_lists], np.int64)
  flat = np.fromiter((t for ids in token_lists for t in ids), np.int32,
                     int(lengths.sum()))
  num_rows = -(-len(flat) // width)
  document = np.repeat(np.arange(len(lengths)), lengths)
  document_start = np.repeat(np.cumsum(lengths) - lengths, lengths)
  index = np.arange(len(flat))
  row_start = index // width * width
  first_document_of_row = document[row_start]
  segment = document - first_document_of_row + 1
  position = index - np.maximum(document_start, row_start)

  def lay_out(values):
    out = np.zeros(num_rows * width, np.int32)
    out[:len(flat)] = values
    return out.reshape(num_rows, width)

  return {'targets': lay_out(flat), 'targets_segment_ids': lay_out(segment),
          'targets_positions': lay_out(position)}


def first_token_is_input(tokenizer) -> bool:
  """Whether a text's first token is the model's first input (a Hugging
  Face tokenizer that adds no BOS), not its first target."""
  return tokenizer.first_token_is_input


def pair_rows(pairs: Sequence[tuple[list[int], int]], width: int,
              first_is_input: bool = False) -> dict[str, np.ndarray]:
  """`masked_rows` of (ids, response start) pairs: the mask 1 from the
  response on."""
  return masked_rows([(ids, [0] * start + [1] * (len(ids) - start))
                      for ids, start in pairs], width, first_is_input)


def masked_rows(examples: Sequence[tuple[list[int], list[int]]], width: int,
                first_is_input: bool = False) -> dict[str, np.ndarray]:
  """'targets', its segment ids and positions, and LOSS_MASK [examples,
  width] int32, and ROW_START [examples] int32: one (ids, loss mask)
  example per row, cut at `width`, segment id 1 on its tokens (0:
  padding). With `first_is_input`, an example's first token is its row's
  start instead of its first target."""
  rows = {key: np.zeros((len(examples), width), np.int32) for key in (
      'targets', 'targets_segment_ids', 'targets_positions', LOSS_MASK)}
  rows[ROW_START] = np.full(len(examples), -1, np.int32)
  for row, (ids, mask) in enumerate(examples):
    if first_is_input and ids:
      rows[ROW_START][row] = ids[0]
      ids, mask = ids[1:], mask[1:]
    ids, mask = ids[:width], mask[:width]
    rows['targets'][row, :len(ids)] = ids
    rows['targets_segment_ids'][row, :len(ids)] = 1
    rows['targets_positions'][row, :len(ids)] = np.arange(len(ids))
    rows[LOSS_MASK][row, :len(ids)] = mask
  return rows


def chat_example(tokenizer, template: str, messages: Sequence[dict]
                 ) -> tuple[list[int], list[int]]:
  """(ids, assistant mask) of a checked conversation, without the BOS the
  template writes (the model's start token stands for it)."""
  ids, mask = chat_template.conversation_ids(tokenizer, template, messages)
  if len(_without_bos(tokenizer, ids)) < len(ids):
    ids, mask = ids[1:], mask[1:]
  return ids, mask


def chat_examples(tokenizer, lines: Sequence[str], split: str
                  ) -> list[tuple[list[int], list[int]]]:
  """`chat_example` of each conversation line."""
  template = chat_template.template_of(tokenizer)
  return [chat_example(tokenizer, template, messages)
          for messages in chat_template.read_conversations(lines, split)]


def language_model_rows(data_config, texts: Sequence[str],
                        labels: Sequence[str], split: str, tokenizer
                        ) -> dict[str, np.ndarray]:
  """The rows of a split of (text, label) pairs as `data.lm_rows` says."""
  width = data_config.max_target_length
  layout = data_config.get('lm_rows', 'packed')
  if layout == 'packed':
    return pack_documents(document_ids(tokenizer, texts), width)
  if layout == 'chat':
    return masked_rows(chat_examples(tokenizer, texts, split), width,
                       first_token_is_input(tokenizer))
  if layout != 'prompt_response':
    raise sources.DataError(f'data.lm_rows={layout!r} is not one of '
                            f'{list(LM_ROWS)}')
  empty = [number for number, label in enumerate(labels, 1) if not label]
  if empty:
    raise sources.DataError(
        f'{split} example {empty[0]}: no response; data.lm_rows='
        "'prompt_response' reads 'prompt<TAB>response' lines "
        '(data.source=tsv)')
  return pair_rows(pair_ids(tokenizer, texts, labels), width,
                   first_token_is_input(tokenizer))
