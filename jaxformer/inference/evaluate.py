"""Using a trained translator: batched decoding of sentences, BLEU and chrF
(sacrebleu's standard settings, on detokenised text) and exact match."""
import math
from collections.abc import Sequence

import jax
import ml_collections
import numpy as np
import sacrebleu
from jax.experimental import multihost_utils

from jaxformer.inference import beam_search
from jaxformer.inference import search
from jaxformer.inference import target_prefix
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.data import language_tokenizer, pipeline
from jaxformer.data import sources
from jaxformer.data.tokenizer import Tokenizer, cut_to_tokens
from jaxformer.model.config import ModelConfig


def corpus_scores(hypotheses: Sequence[str],
                  references: Sequence[str]) -> dict[str, float]:
  """Corpus BLEU and chrF (sacrebleu defaults) and exact match, in percent."""
  if len(hypotheses) != len(references):
    raise ValueError(f'{len(hypotheses)} hypotheses for {len(references)} '
                     'references.')
  if not references:
    return {'bleu': 0.0, 'chrf': 0.0, 'exact_match': 0.0}
  exact = np.mean([h.strip() == r.strip()
                   for h, r in zip(hypotheses, references)])
  return {
      # force: the text is detokenised; a ' .' ending is just a word here.
      'bleu': sacrebleu.corpus_bleu(hypotheses, [references],
                                    force=True).score,
      'chrf': sacrebleu.corpus_chrf(hypotheses, [references]).score,
      'exact_match': 100.0 * float(exact),
  }


def decode_tokens(params, model_config: ModelConfig, inputs, *,
                  beam_size: int, alpha: float, max_decode_len: int,
                  eos_id: int | None = None,
                  batch_parts: int | None = None,
                  forced=None) -> jax.Array:
  """Best translation's tokens [batch, max_decode_len] (greedy if beam 1);
  batch_parts as the searches take it (None: their default); forced: every
  translation's first token (a many-to-many model's target language), or
  each row's first tokens [batch, p] (-1 past its target prefix), None for
  none."""
  forced = -1 if forced is None else forced
  if beam_size <= 1:
    return search.greedy_decode(params, model_config, inputs,
                                max_decode_len=max_decode_len, eos_id=eos_id,
                                batch_parts=batch_parts, forced_ids=forced)
  tokens, _ = beam_search.beam_search(
      params, model_config, inputs, beam_size=beam_size, alpha=alpha,
      max_decode_len=max_decode_len, eos_id=eos_id, batch_parts=batch_parts,
      forced_ids=forced)
  return tokens[:, 0]


def _round_up(n: int, multiple: int = 16) -> int:
  return int(math.ceil(n / multiple) * multiple)


def encode_sources(source_tok: Tokenizer, sentences: Sequence[str],
                   max_length: int, on_too_long: str = 'truncate',
                   line_numbers: Sequence[int] | None = None
                   ) -> tuple[np.ndarray, list[int]]:
  """Token rows [len(sentences), width] (width a multiple of 16, so few
  shapes compile) and the indices of truncated sentences. An empty line
  becomes an all-padding row (the tokenizer's pad_id). Only the start of a
  long sentence is encoded (`cut_to_tokens`). line_numbers: the sentences'
  numbers in their input, for the error (default: 1, 2, ...)."""
  cut = [cut_to_tokens(s, max_length + 1) for s in sentences]
  ids = [source_tok.encode([s])[0] if s.strip() else [] for s in cut]
  more = ['+' if len(c) < len(s) else '' for c, s in zip(cut, sentences)]
  too_long = [i for i, row in enumerate(ids)
              if len(row) > max_length or more[i]]
  if too_long and on_too_long == 'error':
    first = too_long[0]
    number = line_numbers[first] if line_numbers else first + 1
    raise ValueError(
        f'Line {number} has {len(ids[first])}{more[first]} tokens, more '
        f'than the model maximum {max_length}; shorten it or drop '
        '--on-too-long=error to truncate.')
  width = _round_up(max(1, max((min(len(r), max_length) for r in ids),
                               default=1)))
  width = min(width, max(max_length, 1))
  rows = np.full((len(ids), width), source_tok.pad_id, np.int32)
  for i, row in enumerate(ids):
    row = row[:max_length]
    if row and len(row) == max_length and row[-1] != source_tok.eos_id:
      row[-1] = source_tok.eos_id
    rows[i, :len(row)] = row
  return rows, too_long


def source_batch(source_tok: Tokenizer, sentences: Sequence[str],
                 line_numbers: Sequence[int], *, batch_size: int,
                 max_source_length: int, on_too_long: str = 'truncate',
                 warn=print) -> np.ndarray:
  """[batch_size, width] int32 source rows of `sentences` (at most
  batch_size), all-padding rows after them; a truncated sentence is named
  by its number in `line_numbers` through `warn`."""
  rows, truncated = encode_sources(source_tok, sentences, max_source_length,
                                   on_too_long, line_numbers)
  for i in truncated:
    warn(f'warning: line {line_numbers[i]} is longer than '
         f'{max_source_length} tokens and was truncated.')
  padded = np.full((batch_size, rows.shape[1]), source_tok.pad_id, np.int32)
  padded[:len(rows)] = rows
  return padded


def decode_rows(params, model_config: ModelConfig, rows: np.ndarray, *,
                beam_size: int, alpha: float, max_extra_len: int,
                batch_parts: int | None = None,
                device: jax.Device | None = None,
                forced=None) -> np.ndarray:
  """Best tokens [batch, length] of source rows [batch, s], decoding up to
  max_extra_len tokens beyond the batch's longest source or target prefix
  (rounded up to a multiple of 16), so the batch alone decides its
  program; on `device` (where `params` are) if given. forced: as
  `decode_tokens` takes it."""
  longest = max(int((rows != model_config.pad_id).sum(1).max(initial=0)),
                target_prefix.width(forced))
  decode_len = search.decode_length(longest, max_extra_len,
                                    model_config.max_len, multiple=16)
  if device is not None:
    rows = jax.device_put(rows, device)
  return np.asarray(decode_tokens(params, model_config, rows,
                                  beam_size=beam_size, alpha=alpha,
                                  max_decode_len=decode_len,
                                  batch_parts=batch_parts,
                                  forced=forced))


def texts_of(target_tok: Tokenizer, tokens: np.ndarray,
             sentences: Sequence[str]) -> list[str]:
  """The translations of `sentences` from their rows of `tokens`; an empty
  sentence's is empty."""
  return [target_tok.decode(t) if s.strip() else ''
          for t, s in zip(tokens[:len(sentences)], sentences)]


def decode_split(params, model_config: ModelConfig,
                 config: ml_collections.ConfigDict, source_tok: Tokenizer,
                 target_tok: Tokenizer, split: str, mesh, *,
                 max_examples: int = 0, beam_size: int | None = None,
                 alpha: float | None = None):
  """(scores, hypotheses in split order) for `split`."""
  beam_size = config.decode.beam_size if beam_size is None else beam_size
  alpha = config.decode.alpha if alpha is None else alpha
  references = [target for _, target in sources.read_split(config.data, split)]
  if max_examples:
    references = references[:max_examples]
  hypotheses: dict[int, str] = {}
  decode_len = search.decode_length(config.data.max_target_length,
                                    config.decode.max_extra_len,
                                    model_config.max_len)
  params = mesh_lib.gathered(params, 'fsdp')  # Once, not at every token.
  batch_rows = mesh_lib.row_shards(mesh)
  batch_size = math.ceil(config.decode.batch_size / batch_rows) * batch_rows
  batches = pipeline.translation_eval_batches(
      config.data, source_tok, target_tok, split,
      batch_size=batch_size, process_index=jax.process_index(),
      share=mesh_lib.row_share(mesh))
  for local in batches:
    # The pipeline pads with 0 (segment id 0); decoding wants the pad id.
    source_rows = np.where(local['inputs_segment_ids'] > 0, local['inputs'],
                           model_config.pad_id).astype(np.int32)
    inputs = mesh_lib.global_batch({'inputs': source_rows,
                                    'index': local['example_index']}, mesh)
    tokens = decode_tokens(params, model_config, inputs['inputs'],
                           beam_size=beam_size, alpha=alpha,
                           max_decode_len=decode_len,
                           forced=language_tokenizer.first_id(target_tok))
    tokens = multihost_utils.process_allgather(tokens, tiled=True)
    indices = multihost_utils.process_allgather(inputs['index'], tiled=True)
    for index, row in zip(np.asarray(indices), np.asarray(tokens)):
      if 0 <= index < len(references):
        hypotheses[int(index)] = target_tok.decode(row)
    if len(hypotheses) >= len(references):
      break
  ordered = [hypotheses[i] for i in range(len(references))]
  return corpus_scores(ordered, references), ordered
