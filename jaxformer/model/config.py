"""Model hyperparameters: a frozen dataclass built from an `ml_collections.ConfigDict`.

Presets follow Table 3 of "Attention Is All You Need": `base` and `big`.
"""
import dataclasses
from typing import Any

import jax.numpy as jnp
import ml_collections

from jaxformer.model import backend
from jaxformer.model.backend import ATTENTION_IMPLS

CHOICES = {
    'share_embeddings': ('all', 'target', 'none'),
    'norm_position': ('post', 'pre'),
    'activation': ('relu', 'gelu'),
    'position_embedding': ('sinusoidal', 'learned'),
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
