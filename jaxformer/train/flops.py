"""Model FLOPs for MFU: what the model needs, not what the hardware ran
(recomputation from remat does not count)."""
from jaxformer.model.config import ModelConfig


def _layer_matmul_params(cfg: ModelConfig, attention_blocks: int) -> int:
  return attention_blocks * 4 * cfg.d_model * cfg.d_model + 2 * cfg.d_model * cfg.d_ff


def training_flops_per_step(cfg: ModelConfig, task: str, rows: int,
                            source_length: int, target_length: int) -> float:
  """6 x (matmul parameters touched per token) per token, plus attention.

  A matmul with P parameters costs 2P FLOPs per token forward and 4P
  backward. Attention scores and their weighted sum cost 2 x 2 x d_model
  FLOPs per (query, key) pair forward, 3x that with the backward pass.
  Embedding lookups are free; the output projection is a d_model x vocab
  matmul per target token.
  """
  d, forward = cfg.d_model, 0.0
  encoder_tokens = rows * source_length
  decoder_tokens = rows * target_length
  logits = cfg.d_model * (cfg.output_vocab_size if task in (
      'translation', 'language_model') else cfg.num_classes)
  if task in ('translation', 'classification', 'regression'):
    forward += 2 * encoder_tokens * cfg.num_encoder_layers * _layer_matmul_params(cfg, 1)
    forward += cfg.num_encoder_layers * rows * 4 * d * source_length ** 2
  if task == 'translation':
    forward += 2 * decoder_tokens * cfg.num_decoder_layers * _layer_matmul_params(cfg, 2)
    forward += cfg.num_decoder_layers * rows * 4 * d * (
        target_length ** 2 + target_length * source_length)
    forward += 2 * decoder_tokens * logits
  elif task == 'language_model':
    forward += 2 * decoder_tokens * cfg.num_decoder_layers * _layer_matmul_params(cfg, 1)
    forward += cfg.num_decoder_layers * rows * 4 * d * target_length ** 2
    forward += 2 * decoder_tokens * logits
  else:
    forward += 2 * rows * logits
  return 3.0 * forward
