"""The allowed range of every numeric config key, checked when a config loads
(`config.validate`), so a bad value is named before any work starts.

To cover a new key, add one line to `RANGES` (a key without a line is not
checked; `test_configs` fails for a numeric default key that has none).
"""
import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Range:
  """Numbers in [low, high] (or open at either end), plus `also` values."""
  low: float = -math.inf
  high: float = math.inf
  low_open: bool = False
  high_open: bool = False
  also: tuple = ()

  def __contains__(self, value) -> bool:
    if value in self.also:
      return True
    above = value > self.low if self.low_open else value >= self.low
    below = value < self.high if self.high_open else value <= self.high
    return above and below

  def __str__(self) -> str:
    parts = []
    if self.low > -math.inf and self.high < math.inf:
      parts.append(('in (' if self.low_open else 'in [') + f'{self.low:g}, '
                   f'{self.high:g}' + (')' if self.high_open else ']'))
    elif self.low > -math.inf:
      parts.append(('> ' if self.low_open else '>= ') + f'{self.low:g}')
    elif self.high < math.inf:
      parts.append(('< ' if self.high_open else '<= ') + f'{self.high:g}')
    return ' or '.join([str(v) for v in self.also] + parts)


POSITIVE = Range(1)  # counts and sizes that must be at least 1
NON_NEGATIVE = Range(0)  # counts where 0 means "off", "all" or "none"
ABOVE_ZERO = Range(0, low_open=True)  # rates and scales
PROBABILITY = Range(0, 1, high_open=True)  # dropout, smoothing, Adam betas
UNIT_INTERVAL = Range(0, 1, low_open=True)  # top-p, character coverage
MESH_SIZE = Range(1, also=(-1,))  # -1: all devices not used by other axes

RANGES = {
    'seed': NON_NEGATIVE,
    'model.vocab_size': POSITIVE,
    'model.target_vocab_size': NON_NEGATIVE,
    'model.d_model': POSITIVE,
    'model.num_heads': POSITIVE,
    'model.num_kv_heads': NON_NEGATIVE,  # 0: num_heads
    'model.head_dim': NON_NEGATIVE,  # 0: d_model // num_heads
    'model.d_ff': POSITIVE,
    'model.num_encoder_layers': NON_NEGATIVE,
    'model.num_decoder_layers': NON_NEGATIVE,
    'model.max_len': POSITIVE,
    'model.position_offset': NON_NEGATIVE,
    'model.embedding_dropout': PROBABILITY,
    'model.residual_dropout': PROBABILITY,
    'model.attention_dropout': PROBABILITY,
    'model.ffn_dropout': PROBABILITY,
    'model.layer_norm_epsilon': ABOVE_ZERO,
    'model.rms_norm_epsilon': ABOVE_ZERO,
    'model.rope_theta': ABOVE_ZERO,
    'model.rope_scaling_factor': ABOVE_ZERO,
    'model.rope_low_freq_factor': ABOVE_ZERO,
    'model.rope_high_freq_factor': ABOVE_ZERO,
    'model.rope_original_max_len': POSITIVE,
    'model.type_vocab_size': NON_NEGATIVE,  # 0: no token types
    'model.num_classes': POSITIVE,
    'model.regression_dim': POSITIVE,
    'model.pad_id': NON_NEGATIVE,  # ids of the vocabulary (ModelConfig checks
    'model.eos_id': NON_NEGATIVE,  # they lie inside it)
    'model.decoder_start_id': NON_NEGATIVE,
    'data.builtin.num_train': POSITIVE,
    'data.builtin.num_dev': NON_NEGATIVE,
    'data.builtin.num_test': NON_NEGATIVE,
    'data.builtin.seed': NON_NEGATIVE,
    'data.tokenizer.vocab_size': Range(5),  # 4 special pieces and one more
    'data.tokenizer.target_vocab_size': NON_NEGATIVE,  # 0: vocab_size
    'data.tokenizer.character_coverage': UNIT_INTERVAL,
    'data.tokenizer.sample_size': POSITIVE,
    'data.tokenizer.wait_seconds': NON_NEGATIVE,
    'data.max_source_length': POSITIVE,
    'data.max_target_length': POSITIVE,
    'data.batch_size': POSITIVE,
    'data.tokens_per_batch': POSITIVE,
    'data.shuffle_buffer': NON_NEGATIVE,
    'data.seed': NON_NEGATIVE,
    'data.token_cache_piece_bytes': POSITIVE,
    'data.tokenize_workers': POSITIVE,
    'train.num_steps': POSITIVE,
    'train.learning_rate': ABOVE_ZERO,
    'train.warmup_steps': POSITIVE,  # the rsqrt schedules divide by it
    'train.b1': PROBABILITY,
    'train.b2': PROBABILITY,
    'train.eps': ABOVE_ZERO,
    'train.weight_decay': NON_NEGATIVE,
    'train.grad_clip_norm': NON_NEGATIVE,
    'train.label_smoothing': PROBABILITY,
    'train.grad_accum_steps': POSITIVE,
    'train.log_every': POSITIVE,
    'train.peak_flops': NON_NEGATIVE,
    'train.max_minutes': NON_NEGATIVE,  # 0: no budget
    'mesh.data': MESH_SIZE,
    'mesh.fsdp': MESH_SIZE,
    'mesh.tensor': MESH_SIZE,
    'mesh.dcn_data': POSITIVE,
    'eval.every': NON_NEGATIVE,
    'eval.num_batches': NON_NEGATIVE,
    'eval.bleu_examples': NON_NEGATIVE,
    'eval.show_examples': NON_NEGATIVE,
    'eval.average_last': NON_NEGATIVE,  # 0 or 1: no averaging
    'decode.beam_size': POSITIVE,
    'decode.alpha': NON_NEGATIVE,
    'decode.max_extra_len': NON_NEGATIVE,
    'decode.batch_size': POSITIVE,
    'checkpoint.every': NON_NEGATIVE,
    'checkpoint.keep': POSITIVE,
    'distributed.num_processes': NON_NEGATIVE,
    'distributed.process_id': Range(-1),
    'distributed.initialization_timeout': POSITIVE,
    'distributed.heartbeat_timeout': POSITIVE,
    'distributed.shutdown_timeout': POSITIVE,
}


def _lookup(config, dotted: str):
  value = config
  for name in dotted.split('.'):
    if name not in value:
      return None
    value = value[name]
  return value


def out_of_range(config) -> list[str]:
  """One message per numeric key of `config` outside its range."""
  problems = []
  for dotted, allowed in RANGES.items():
    value = _lookup(config, dotted)
    if value is None or isinstance(value, bool):
      continue
    if not isinstance(value, (int, float)) or math.isnan(value):
      problems.append(f'{dotted}={value!r} is not a number; it must be '
                      f'{allowed}.')
    elif value not in allowed:
      problems.append(f'{dotted}={value!r} is out of range; it must be '
                      f'{allowed}.')
  return problems


def step_span(text: str) -> tuple[int, int] | None:
  """`train.profile_steps`: 'A:B' as (A, B) with 0 < A <= B; '': None."""
  if not text:
    return None
  first, _, last = str(text).partition(':')
  try:
    span = int(first), int(last)
  except ValueError:
    span = (0, 0)
  if not 0 < span[0] <= span[1]:
    raise ValueError(f'train.profile_steps={text!r} is not A:B with '
                     '0 < A <= B (steps to trace, e.g. 10:12).')
  return span
