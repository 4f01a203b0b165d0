"""Model FLOPs for MFU: what the model needs, not what the hardware ran
(recomputation from remat does not count).

XLA's own count (`compiled.cost_analysis()['flops']`, which `jaxformer
compile` prints) agrees for an unrolled model on one device: 1.7% above
`training_flops_per_step` for the train step (elementwise work included),
0.7% for the forward pass alone (d_model 256, 2+2 layers, 32 x (64+64), CPU).
It is lower wherever the program loops, because XLA's cost analysis counts a
while loop's body once, whatever its trip count:
  * `model.scan_layers`: one layer of each stack is counted, not all.
  * FSDP on TPU: XLA fuses a parameter all-gather or a gradient
    reduce-scatter with its matmul into a windowed einsum, a loop that
    multiplies one shard per step while the next travels around the ring
    (`collective-permute`s); one step of the loop is counted. `big` bf16,
    128 x (128+128), fsdp=16 on a v5p-32: XLA counts 15.6 TFLOP per step
    (0.97 per chip), this formula 21.5; with 1+1 layers 4.94 against 6.69,
    and 6.75 (1% above the formula) once windowed einsums are turned off
    (LIBTPU_INIT_ARGS='--xla_tpu_enable_windowed_einsum_for_all_gather=false
    --xla_tpu_enable_windowed_einsum_for_reduce_scatter=false').
So MFU uses this formula, never XLA's count.
"""
from jaxformer.model.config import ModelConfig

# Dense bf16 FLOP/s of one chip (both TensorCores of a megacore TPU chip):
# `jaxformer compile`'s TPU chips, and MFU's peak on TPUs and GPUs.
TPU_PEAK_FLOPS = {'v4': 275e12, 'v5e': 197e12, 'v5p': 459e12, 'v6e': 918e12}
# `jax.Device.device_kind` -> peak, the first that the kind contains.
DEVICE_PEAK_FLOPS = (
    ('TPU v4', TPU_PEAK_FLOPS['v4']),
    ('TPU v5 lite', TPU_PEAK_FLOPS['v5e']), ('TPU v5e', TPU_PEAK_FLOPS['v5e']),
    ('TPU v5', TPU_PEAK_FLOPS['v5p']),
    ('TPU v6', TPU_PEAK_FLOPS['v6e']),
    ('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12),
    ('GH200', 989e12), ('B200', 2250e12), ('A100', 312e12),
    ('L40S', 362e12), ('L4', 121e12), ('A10', 125e12),
)


def device_peak_flops(device_kind: str) -> float | None:
  """The table's peak for a device kind ('TPU v5 lite', 'NVIDIA H100 80GB
  HBM3'); None for others (CPUs)."""
  for name, peak in DEVICE_PEAK_FLOPS:
    if name in device_kind:
      return peak
  return None


def _layer_matmul_params(cfg: ModelConfig, attention_blocks: int) -> int:
  """Query and output projections of n heads, key and value projections of
  k heads (grouped-query attention: k <= n), and the FFN's two or three
  (gated) matrices."""
  query_features = cfg.num_heads * cfg.head_features
  kv_features = cfg.kv_heads * cfg.head_features
  attention = 2 * cfg.d_model * (query_features + kv_features)
  ffn = (3 if cfg.gated_ffn else 2) * cfg.d_model * cfg.d_ff
  return attention_blocks * attention + ffn


def training_flops_per_step(cfg: ModelConfig, task, rows: int,
                            source_length: int, target_length: int) -> float:
  """6 x (matmul parameters touched per token) per token, plus attention.

  `task` is a `tasks.Task`: an encoder reads its 'inputs', a decoder its
  'targets' (attending to the encoder too when there is one); a task without
  'targets' has one output row per example.

  A matmul with P parameters costs 2P FLOPs per token forward and 4P
  backward. Attention scores and their weighted sum cost 2 x 2 x heads x
  head features (d_model in the paper) FLOPs per (query, key) pair forward,
  3x that with the backward pass.
  Embedding lookups are free; the output projection is a d_model x vocab
  matmul per target token.
  """
  d, forward = cfg.num_heads * cfg.head_features, 0.0
  encoder_tokens = rows * source_length
  decoder_tokens = rows * target_length
  encoder = 'inputs' in task.batch_keys
  decoder = 'targets' in task.batch_keys
  logits = cfg.d_model * (cfg.output_vocab_size if decoder
                          else cfg.num_classes)
  if encoder:
    forward += 2 * encoder_tokens * cfg.num_encoder_layers * _layer_matmul_params(cfg, 1)
    forward += cfg.num_encoder_layers * rows * 4 * d * source_length ** 2
  if decoder:
    attended = target_length ** 2 + (target_length * source_length
                                     if encoder else 0)
    forward += 2 * decoder_tokens * cfg.num_decoder_layers * _layer_matmul_params(
        cfg, 2 if encoder else 1)
    forward += cfg.num_decoder_layers * rows * 4 * d * attended
    forward += 2 * decoder_tokens * logits
  else:
    forward += 2 * rows * logits
  return 3.0 * forward
