"""What `bulk.decode_corpus` makes of a batch of lines: their continuations
by a language model (`Generation`, `jaxformer generate --output`); their
translations (`jaxformer translate --output`) are `translator.Translation`.

A batch decodes as its lines alone decide, so the file is the same
whatever the layout: a continuation with the keys of line i folded from
the seed and i (`generation.generate_ids`' `row_ids`), the samples
`jaxformer generate --input` draws for that line.
"""
from __future__ import annotations

import dataclasses
import json

import jax


from jaxformer.inference import generation, predict
from jaxformer.inference.bulk import Chunking, warn


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateSettings(Chunking):
  max_new_tokens: int | None
  max_len: int  # 0: `predict.generation_positions`' default.
  temperature: float
  top_k: int
  top_p: float
  seed: int
  on_too_long: str = 'truncate'  # or 'error'
  jsonl: bool = False  # {"prompt", "ids", "text"} lines, else prompt + text.


class Generation:
  """A continuation of each prompt line of a batch, as `jaxformer generate`
  prints it (the prompt with its continuation, or with jsonl its record).
  model: a `Trained` language model (params, model_config, config,
  target_tok)."""
  command = 'generate'

  def __init__(self, model, settings: GenerateSettings):
    predict.check_generates(model.config)
    generation.check_settings(settings.temperature, settings.top_k,
                              settings.top_p)
    self.model, self.settings, self.params = model, settings, model.params
    self.tokenizer = model.target_tok
    self.positions = predict.generation_positions(
        model.model_config, model.config, settings.max_len,
        settings.max_new_tokens)
    self.eos_ids = self.tokenizer.eos_ids or (model.model_config.eos_id,)

  def inputs(self, lines: list[str], numbers: list[int]
             ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """(the model inputs, the prompt tokens shown, the line numbers)."""
    inputs, shown = predict.prompt_batch(
        self.tokenizer, self.model.model_config,
        [(n + 1, 0, line) for n, line in zip(numbers, lines)],
        self.positions, self.settings.on_too_long, warn)
    return inputs, shown, numbers

  def decode(self, params, inputs, device: jax.Device) -> list[list[int]]:
    del device  # The jitted search runs where `params` are.
    prompts, _, numbers = inputs
    s = self.settings
    return generation.generate_ids(
        params, self.model.model_config, prompts,
        max_new_tokens=s.max_new_tokens, max_positions=self.positions,
        eos_ids=self.eos_ids, temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p, seed=s.seed, row_ids=numbers)

  def outputs(self, inputs, new: list[list[int]], lines: list[str]
              ) -> tuple[list[str], int]:
    _, shown, _ = inputs
    decode, texts = self.tokenizer.decode, []
    for line, ids, prompt in zip(lines, new, shown):
      out = predict.Generated(line, ids, decode(ids), decode(prompt + ids))
      texts.append(json.dumps(out.record()) if self.settings.jsonl
                   else out.whole)
    return texts, sum(map(len, new))
