"""Using trained encoder-only and decoder-only models: labels or values of
texts (`jaxformer predict`) and continuations of prompts (`jaxformer generate`)."""
from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence

import jax
import ml_collections
import numpy as np

from jaxformer.inference import search
from jaxformer.data import task_batches
from jaxformer.data.tokenizer import Tokenizer, cut_to_tokens
from jaxformer.model import ModelConfig
from jaxformer.train.tasks import get_task


def _predictor(model_config: ModelConfig, config: ml_collections.ConfigDict):
  """(task, its model's jit-compiled apply) for `predict`."""
  task = get_task(config.task)
  if task.prediction is None:
    raise ValueError(f'`predict` needs a classification or regression run; '
                     f'this workdir trained task={config.task!r} (use '
                     '`jaxformer generate` or `jaxformer translate`).')
  return task, jax.jit(task.model(model_config).apply)


def _predictions(predictor, params, config: ml_collections.ConfigDict,
                 tokenizer: Tokenizer, texts: Sequence[str]) -> list:
  task, apply = predictor
  width = config.data.max_source_length
  inputs = task_batches.pad_token_rows(
      tokenizer.encode([cut_to_tokens(t, width + 1) for t in texts]), width)
  return task.prediction(apply({'params': params}, **inputs), config)


def predict(params, model_config: ModelConfig, config: ml_collections.ConfigDict,
            tokenizer: Tokenizer, texts: Sequence[str]) -> list:
  """Class names (classification) or [regression_dim] float lists
  (regression) of `texts`, cut to data.max_source_length tokens."""
  return _predictions(_predictor(model_config, config), params, config,
                      tokenizer, texts)


def predict_lines(params, model_config: ModelConfig,
                  config: ml_collections.ConfigDict, tokenizer: Tokenizer,
                  lines: Iterable[str], batch_size: int) -> Iterator:
  """`predict`'s outputs of `lines`, in order, read and predicted
  `batch_size` at a time: one batch of the input is held, never all."""
  lines, predictor = iter(lines), None
  while batch := list(itertools.islice(lines, batch_size)):
    predictor = predictor or _predictor(model_config, config)
    yield from _predictions(predictor, params, config, tokenizer, batch)


def generate(params, model_config: ModelConfig, config: ml_collections.ConfigDict,
             tokenizer: Tokenizer, prompts: Sequence[str], *, seed: int = 0,
             max_len: int = 0, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0) -> list[str]:
  """Texts continuing `prompts` (prompt included), sampled from a language
  model; max_len (tokens, 0: data.max_target_length) bounds each result."""
  if not get_task(config.task).generates:
    raise ValueError(f'`generate` needs a language_model run; this workdir '
                     f'trained task={config.task!r} (use `jaxformer predict` '
                     'or `jaxformer translate`).')
  max_len = max_len or config.data.max_target_length
  prompt_ids = [[t for t in ids if t != tokenizer.eos_id] for ids in
                tokenizer.encode([cut_to_tokens(p, max_len) for p in prompts])]
  width = max(1, max(len(ids) for ids in prompt_ids))
  if width >= max_len:
    raise ValueError(f'a prompt has {width} tokens, not fewer than '
                     f'--max-len={max_len}; shorten it or raise --max-len.')
  tokens = np.full((len(prompt_ids), width), model_config.pad_id, np.int32)
  for row, ids in enumerate(prompt_ids):
    tokens[row, :len(ids)] = ids
  samples = search.sample(params, model_config, tokens,
                          jax.random.PRNGKey(seed), max_decode_len=max_len,
                          temperature=temperature, top_k=top_k, top_p=top_p)
  return tokenizer.decode_batch(np.asarray(samples))
