"""Model hyperparameters: a frozen dataclass built from an `ml_collections.ConfigDict`.

Presets follow Table 3 of "Attention Is All You Need": `base` and `big`.
"""
import dataclasses
from typing import Any

import ml_collections

from jaxformer.model import backend
from jaxformer.model.backend import ATTENTION_IMPLS

CHOICES = {
    'share_embeddings': ('all', 'target', 'none'),
    'norm_position': ('post', 'pre'),
    'activation': ('relu', 'gelu', 'gelu_exact', 'swish'),
    'position_embedding': ('sinusoidal', 'learned'),
    'sinusoid_layout': ('interleaved', 'halves'),
    'dtype': ('float32', 'bfloat16', 'auto'),
    'attention_impl': ATTENTION_IMPLS,
    'pooling': ('first', 'mean'),
    'remat_policy': ('none', 'full', 'dots', 'dots_with_no_batch_dims'),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything that fixes a model's parameters and computation.

  share_embeddings: 'all' ties source embedding, target embedding and output
    projection (the paper); 'target' ties target embedding and output
    projection; 'none' keeps all three separate, with a biased output
    projection (the PyTorch reference).
  activation: of the FFN; 'gelu' is the tanh approximation, 'gelu_exact'
    the erf form (Hugging Face's 'gelu'), 'swish' is SiLU, x * sigmoid(x).
  sinusoid_layout: 'interleaved' (the paper: sin at even features, cos at
    odd ones) or 'halves' (Marian: sin in the first half, cos in the second).
    Positions count from 0 in both.
  scale_embedding: multiply token embeddings by sqrt(d_model).
  output_bias: a learned bias on the output projection also when it is tied
    to an embedding (Marian's final_logits_bias); share_embeddings='none'
    always has one.
  pad_id, eos_id, decoder_start_id: the special ids of the vocabulary the
    model was trained with (`Tokenizer.pad_id` ...): padding, end of
    sentence, and the decoder's first input (targets are shifted right with
    it). jaxformer's own tokenizers use 0, 1, 0 (`token_ids.py`); Marian's
    vocabularies end with the pad id, which also starts the decoder.
  zero_pad_embedding: the pad_id row of every embedding table is held at
    zero in the forward pass (so training never moves it, and with tied
    embeddings the pad logit is the output bias alone): the decoder then
    starts from the zero vector (plus position 0), as Marian and CTranslate2
    assume.
  """
  vocab_size: int = 8000
  target_vocab_size: int = 0  # 0: same as vocab_size.
  d_model: int = 512
  num_heads: int = 8
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  max_len: int = 512
  share_embeddings: str = 'all'
  norm_position: str = 'post'
  activation: str = 'relu'
  position_embedding: str = 'sinusoidal'
  sinusoid_layout: str = 'interleaved'
  scale_embedding: bool = True
  output_bias: bool = False
  pad_id: int = 0
  eos_id: int = 1
  decoder_start_id: int = 0
  zero_pad_embedding: bool = False
  embedding_dropout: float = 0.1
  residual_dropout: float = 0.1
  attention_dropout: float = 0.0
  ffn_dropout: float = 0.0
  layer_norm_epsilon: float = 1e-6
  use_bias: bool = True
  dtype: str = 'float32'  # 'auto': see backend.compute_dtype.
  attention_impl: str = 'auto'  # See backend.attention_kernel.
  scan_layers: bool = False
  remat_policy: str = 'none'
  # Encoder-only heads.
  num_classes: int = 2
  regression_dim: int = 1
  pooling: str = 'first'

  def __post_init__(self):
    for key, allowed in CHOICES.items():
      if getattr(self, key) not in allowed:
        raise ValueError(
            f'model.{key}={getattr(self, key)!r} is not one of {allowed}.')
    if self.d_model % self.num_heads:
      raise ValueError(
          f'model.d_model={self.d_model} must be divisible by '
          f'model.num_heads={self.num_heads}.')
    if self.share_embeddings == 'all' and self.target_vocab_size not in (
        0, self.vocab_size):
      raise ValueError(
          "model.share_embeddings='all' needs one vocabulary: set "
          'model.target_vocab_size=0 or share_embeddings to target/none.')
    for key, size in (('pad_id', self.vocab_size),
                      ('eos_id', self.output_vocab_size),
                      ('decoder_start_id', self.output_vocab_size)):
      if not 0 <= getattr(self, key) < size:
        raise ValueError(f'model.{key}={getattr(self, key)} is outside the '
                         f'vocabulary [0, {size}).')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def output_vocab_size(self) -> int:
    return self.target_vocab_size or self.vocab_size

  @property
  def compute_dtype(self) -> Any:
    """The activations' dtype; read while tracing (for 'auto')."""
    return backend.compute_dtype(self.dtype)

  def replace(self, **changes) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)


def from_config_dict(config: ml_collections.ConfigDict) -> ModelConfig:
  """Builds a ModelConfig; an unknown key is an error that names it."""
  known = {f.name for f in dataclasses.fields(ModelConfig)}
  values = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
  unknown = sorted(set(values) - known)
  if unknown:
    raise ValueError(
        f'Unknown model config key(s) {unknown}; valid keys are {sorted(known)}.')
  return ModelConfig(**values)


def to_config_dict(config: ModelConfig) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dataclasses.asdict(config))


def base() -> ml_collections.ConfigDict:
  """Transformer (base) of Table 3: 65M parameters with a 37k shared vocabulary."""
  return to_config_dict(ModelConfig(
      vocab_size=37000, d_model=512, num_heads=8, d_ff=2048,
      num_encoder_layers=6, num_decoder_layers=6,
      embedding_dropout=0.1, residual_dropout=0.1))


def big() -> ml_collections.ConfigDict:
  """Transformer (big) of Table 3: 213M parameters with a 37k shared vocabulary."""
  return to_config_dict(ModelConfig(
      vocab_size=37000, d_model=1024, num_heads=16, d_ff=4096,
      num_encoder_layers=6, num_decoder_layers=6,
      embedding_dropout=0.3, residual_dropout=0.3))
