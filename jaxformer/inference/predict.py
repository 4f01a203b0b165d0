"""Using trained encoder-only and decoder-only models: labels or values of
texts (`jaxformer predict`) and continuations of prompts (`jaxformer
generate`; the search itself is `generation.py`'s)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import jax
import ml_collections
import numpy as np

from jaxformer.inference import generation
from jaxformer.data import chat_template, labelled
from jaxformer.data.hf_tokenizer import HFTokenizer
from jaxformer.data.tokenizer import Tokenizer, cut_to_tokens
from jaxformer.model import ModelConfig
from jaxformer.train.tasks import get_task


def _predictor(model_config: ModelConfig, config: ml_collections.ConfigDict):
  """(task, its model's jit-compiled apply, the model config) for
  `predict`."""
  task = get_task(config.task)
  if task.prediction is None:
    raise ValueError(f'`predict` needs a classification or regression run; '
                     f'this workdir trained task={config.task!r} (use '
                     '`jaxformer generate` or `jaxformer translate`).')
  return task, jax.jit(task.model(model_config).apply), model_config


def _pair(line: str) -> tuple[str, str | None]:
  """(text_a, text_b) of an input line: a tab splits a pair."""
  if '\t' not in line:
    return line, None
  a, b = line.split('\t', 1)
  return a, b


def _bucket(rows: Sequence[Sequence[int]], width: int) -> int:
  """The padded width of a batch: its longest row rounded up to a power of
  two (at least 16), at most `width`; a few compiled shapes, not one per
  batch, and short texts not padded to the model's positions."""
  longest = max((len(row) for row in rows), default=1)
  return min(width, max(16, 1 << (longest - 1).bit_length()))


def encode_rows(tokenizer: Tokenizer, model_config: ModelConfig,
                texts: Sequence[str], width: int,
                warn: Callable[[str], None] | None = None) -> dict:
  """The model's inputs [len(texts), <= width] of `texts`: with a
  tokenizer that encodes pairs (`encode_pair`) and a model with token
  types, each text (a pair where a tab splits it) as Hugging Face's
  tokenizer gives it, cut as truncation=True cuts it (with a warning), and
  'inputs_token_types'; else jaxformer's tokens cut to `width`."""
  if not model_config.type_vocab_size:
    ids = tokenizer.encode([cut_to_tokens(t, width + 1) for t in texts])
    return labelled.pad_token_rows(ids, _bucket(ids, width))
  pairs = [_pair(text) for text in texts]
  encoded = tokenizer.encode_pairs(pairs)
  for i, row_and_types in enumerate(encoded):
    row = row_and_types[0]
    if len(row) > width:
      if warn is not None:
        warn(f'warning: an input of {len(row)} tokens is longer than the '
             f'{width} positions of the model; it was cut as Hugging Face '
             'cuts it (truncation=True).')
      encoded[i] = (tokenizer.encode_pair(*pairs[i], max_length=width)
                    if isinstance(tokenizer, HFTokenizer)
                    else labelled.cut_pair(*row_and_types, width))
  ids, types = [row for row, _ in encoded], [t for _, t in encoded]
  padded = _bucket(ids, width)
  rows = labelled.pad_token_rows(ids, padded)
  rows['inputs_token_types'] = labelled.pad_token_rows(
      types, padded)['inputs']
  return rows


def records(task_name: str, outputs, config: ml_collections.ConfigDict
            ) -> list[dict]:
  """What `predict --jsonl` prints per text: {"label", "logits"} of a
  classifier (its raw logits), {"values"} of a regressor."""
  outputs = np.asarray(outputs, np.float64).tolist()
  if task_name == 'regression':
    return [{'values': row} for row in outputs]
  labels = config.data.labels
  return [{'label': labels[i] if labels else str(i), 'logits': row}
          for row, i in zip(outputs, np.argmax(outputs, axis=-1))]


def _predictions(predictor, params, config: ml_collections.ConfigDict,
                 tokenizer: Tokenizer, texts: Sequence[str],
                 jsonl: bool = False, warn=None) -> list:
  task, apply, model_config = predictor
  inputs = encode_rows(tokenizer, model_config, texts,
                       config.data.max_source_length, warn)
  outputs = apply({'params': params}, **inputs)
  if jsonl:
    return records(task.name, outputs, config)
  return task.prediction(outputs, config)


def predict(params, model_config: ModelConfig, config: ml_collections.ConfigDict,
            tokenizer: Tokenizer, texts: Sequence[str]) -> list:
  """Class names (classification) or [regression_dim] float lists
  (regression) of `texts`, cut to data.max_source_length tokens."""
  return _predictions(_predictor(model_config, config), params, config,
                      tokenizer, texts)


def predict_lines(params, model_config: ModelConfig,
                  config: ml_collections.ConfigDict, tokenizer: Tokenizer,
                  lines: Iterable[str], batch_size: int, jsonl: bool = False,
                  warn: Callable[[str], None] | None = None) -> Iterator:
  """`predict`'s outputs of `lines` (with `jsonl`, `records`), in order,
  read and predicted `batch_size` at a time: one batch of the input is
  held, never all."""
  lines, predictor = iter(lines), None
  while batch := list(itertools.islice(lines, batch_size)):
    predictor = predictor or _predictor(model_config, config)
    yield from _predictions(predictor, params, config, tokenizer, batch,
                            jsonl, warn)


# ------------------------------------------------------------- generate ---

class Generated(NamedTuple):
  """One prompt's continuation: `ids` the new tokens (ending with EOS if
  one came), `text` their decoded text, `whole` the decoded prompt and
  continuation together."""
  prompt: str
  ids: list[int]
  text: str
  whole: str

  def record(self) -> dict:
    """What `generate --jsonl` prints."""
    return {'prompt': self.prompt, 'ids': self.ids, 'text': self.text}


def prompt_tokens(tokenizer: Tokenizer, texts: Sequence[str]
                  ) -> list[list[int]]:
  """The tokens of prompt texts as the model continues them: a Hugging
  Face tokenizer's ids as it encodes them (BOS where it adds one), as
  Hugging Face's `generate` takes them; jaxformer's own tokenizers' ids
  without the EOS they end every text with."""
  ids = tokenizer.encode(list(texts))
  if isinstance(tokenizer, HFTokenizer):
    return ids
  return [row[:-1] if row[-1:] == [tokenizer.eos_id] else row for row in ids]


def model_inputs(tokenizer: Tokenizer, model_config: ModelConfig,
                 tokens: list[int]) -> list[int]:
  """A prompt's inputs from position 0: `tokens`, after the model's
  decoder_start_id where jaxformer trained it (a shifted sequence)."""
  if isinstance(tokenizer, HFTokenizer):
    return tokens
  return [model_config.decoder_start_id] + tokens


def check_generates(config: ml_collections.ConfigDict) -> None:
  if not get_task(config.task).generates:
    raise ValueError(f'`generate` needs a language_model run; this workdir '
                     f'trained task={config.task!r} (use `jaxformer predict` '
                     'or `jaxformer translate`).')


def generation_positions(model_config: ModelConfig,
                         config: ml_collections.ConfigDict, max_len: int,
                         max_new_tokens: int | None) -> int:
  """The positions a prompt and its continuation may take: max_len, by
  default the model's max_len with max_new_tokens, else
  data.max_target_length."""
  if not max_len:
    max_len = (model_config.max_len if max_new_tokens is not None
               else config.data.max_target_length)
  if max_len > model_config.max_len:
    raise ValueError(f'--max-len={max_len} exceeds the model\'s '
                     f'{model_config.max_len} positions (its max_len).')
  return max_len


def _fitted(inputs: list[int], positions: int, cut: bool, number: int,
            on_too_long: str, warn: Callable[[str], None] | None
            ) -> list[int]:
  """`inputs` of prompt `number` (1-based), cut to `positions` ids with a
  warning (none if `warn` is None), or a ValueError with
  on_too_long='error'; `cut`: the text was longer than what was encoded."""
  if len(inputs) <= positions and not cut:
    return inputs
  count = f'{len(inputs)}{"+" if cut else ""}'
  if on_too_long == 'error':
    raise ValueError(f'Prompt {number} has {count} tokens, more than the '
                     f'{positions} positions of the model (or --max-len); '
                     'shorten it or drop --on-too-long=error to truncate.')
  if warn is not None:
    warn(f'warning: prompt {number} has {count} tokens, more than the '
         f'{positions} positions of the model (or --max-len); it was cut to '
         f'its first {positions}.')
  return inputs[:positions]


def chat_prompt_tokens(tokenizer: Tokenizer,
                       batch: Sequence[tuple[int, int, str]]
                       ) -> list[list[int]]:
  """The ids of (number, copy, line) prompts, each a conversation (JSON)
  or a user's text, rendered with the tokenizer's chat template and its
  generation prompt (`generate --chat`)."""
  template = chat_template.template_of(tokenizer)
  return [chat_template.prompt_ids(tokenizer, template,
                                   chat_template.prompt_messages(
                                       text, f'prompt {number}'))
          for number, _, text in batch]


def prompt_batch(tokenizer: Tokenizer, model_config: ModelConfig,
                 batch: Sequence[tuple[int, int, str]], positions: int,
                 on_too_long: str, warn: Callable[[str], None],
                 chat: bool = False
                 ) -> tuple[list[list[int]], list[list[int]]]:
  """(the model inputs, the prompt tokens shown with the continuation) of
  (number, copy, text) rows (`chat`: conversations, `chat_prompt_tokens`);
  a too-long prompt is reported at its first copy."""
  if chat:
    texts = [text for _, _, text in batch]
    token_lists = chat_prompt_tokens(tokenizer, batch)
  else:
    texts = [cut_to_tokens(text, positions + 1) for _, _, text in batch]
    token_lists = prompt_tokens(tokenizer, texts)
  inputs, shown = [], []
  for tokens, cut_text, (number, copy, text) in zip(
      token_lists, texts, batch):
    full = model_inputs(tokenizer, model_config, tokens)
    fitted = _fitted(full, positions, len(cut_text) < len(text), number,
                     on_too_long, None if copy else warn)
    inputs.append(fitted)
    shown.append(fitted[len(full) - len(tokens):])
  return inputs, shown


def generate_lines(params, model_config: ModelConfig,
                   config: ml_collections.ConfigDict, tokenizer: Tokenizer,
                   prompts: Iterable[str], *, batch_size: int = 32,
                   samples: int = 1, max_new_tokens: int | None = None,
                   max_len: int = 0, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0,
                   on_too_long: str = 'truncate',
                   warn: Callable[[str], None] = print,
                   chat: bool = False) -> Iterator[Generated]:
  """`samples` continuations of each of `prompts`, in order, generated
  `batch_size` at a time as the prompts come (`generation.generate_ids`).

  A prompt and its continuation take at most max_len positions (0: see
  `generation_positions`); a longer prompt is cut to them, with a warning,
  or with on_too_long='error' is a ValueError. A row ends at the first of
  the tokenizer's EOS ids (Hugging Face's `eos_ids`; the model's eos_id for
  jaxformer's own), or after max_new_tokens (None: no bound but the
  positions).
  """
  check_generates(config)
  generation.check_settings(temperature, top_k, top_p)
  positions = generation_positions(model_config, config, max_len,
                                   max_new_tokens)
  eos_ids = tokenizer.eos_ids or (model_config.eos_id,)
  rows = ((number, copy, text) for number, text in enumerate(prompts, 1)
          for copy in range(samples))
  done = 0
  while batch := list(itertools.islice(rows, batch_size)):
    inputs, shown = prompt_batch(tokenizer, model_config, batch, positions,
                                 on_too_long, warn, chat)
    new = generation.generate_ids(
        params, model_config, inputs, max_new_tokens=max_new_tokens,
        max_positions=positions, eos_ids=eos_ids, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, first_row=done)
    for (_, _, text), ids, prompt in zip(batch, new, shown):
      yield Generated(text, ids, tokenizer.decode(ids),
                      tokenizer.decode(prompt + ids))
    done += len(batch)
