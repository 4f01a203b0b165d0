"""Model hyperparameters: a frozen dataclass built from an `ml_collections.ConfigDict`.

Presets follow Table 3 of "Attention Is All You Need": `base` and `big`.
"""
import dataclasses
from typing import Any

import ml_collections

from jaxformer.model import backend
from jaxformer.model import lora as lora_lib
from jaxformer.model.backend import ATTENTION_IMPLS

CHOICES = {
    'share_embeddings': ('all', 'target', 'none'),
    'norm_position': ('post', 'pre'),
    'norm_type': ('layer', 'rms'),
    'activation': ('relu', 'gelu', 'gelu_exact', 'swish', 'swiglu', 'geglu'),
    'position_embedding': ('sinusoidal', 'learned', 'rope'),
    'rope_scaling': ('none', 'linear', 'llama3'),
    'sinusoid_layout': ('interleaved', 'halves', 'tensor2tensor'),
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
  norm_type: 'layer' (LayerNorm, the paper; with a bias unless
    norm_bias=False) or 'rms' (RMSNorm: x / sqrt(mean(x^2) + eps) * scale,
    no bias). Pre-norm stacks (norm_position='pre') end with one more norm
    after the last layer, 'final_norm'; post-norm stacks have none.
  activation: of the FFN; 'gelu' is the tanh approximation, 'gelu_exact'
    the erf form (Hugging Face's 'gelu'), 'swish' is SiLU, x * sigmoid(x).
    'swiglu' and 'geglu' are gated (Shazeer 2020): act(x W_0) * (x W_1),
    then W_o, with SiLU (Llama) and tanh-approximated GELU (Gemma, T5 v1.1)
    respectively; d_ff is the width of W_0 and W_1 as given.
  position_embedding: 'sinusoidal' (the paper) or 'learned', added to the
    embeddings; or 'rope', rotary positions applied to the queries and keys
    of self-attention (Su et al. 2021; cross-attention takes none), with
    rope_theta as the base of the rotation periods and rope_scaling 'none',
    'linear' (frequencies divided by rope_scaling_factor) or 'llama3'
    (rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor and
    rope_original_max_len, as Hugging Face's rope_scaling of Llama 3.1).
  num_kv_heads: key/value heads, dividing num_heads (grouped-query
    attention; 1 is multi-query attention); 0 means num_heads.
  head_dim: features of each head; 0 means d_model // num_heads.
  sinusoid_layout: 'interleaved' (the paper: sin at even features, cos at
    odd ones), 'halves' (Marian: sin in the first half, cos in the second)
    or 'tensor2tensor' (halves, with the periods spread over d/2 - 1 steps
    instead of d/2: tensor2tensor's timing signal, kept by fairseq and
    M2M100).
  position_offset: added to every position before the lookup of sinusoidal
    or learned positions (RoBERTa and M2M100 count from padding_idx + 1 =
    2); a learned table has max_len + position_offset rows.
  scale_embedding: multiply token embeddings by sqrt(d_model).
  use_bias: biases on the projections of attention and the FFN (the key
    projection has one only with rope, the one case it counts: otherwise it
    adds the same number to every logit of a query, which softmax ignores).
  qkv_bias: biases on the query, key and value projections also with
    use_bias=False (Qwen2).
  norm_bias: LayerNorm's bias (RMSNorm has none).
  output_bias: a learned bias on the output projection also when it is tied
    to an embedding (Marian's final_logits_bias).
  logits_bias: a bias on the separate output projection of
    share_embeddings='none' (False for Llama's untied lm_head). With
    use_bias=False, norm_type='rms' (or norm_bias=False) and
    logits_bias=False a model has no bias anywhere.
  pad_id, eos_id, decoder_start_id: the special ids of the vocabulary the
    model was trained with (`Tokenizer.pad_id` ...): padding, end of
    sentence, and the decoder's first input (targets are shifted right with
    it). jaxformer's own tokenizers use 0, 1, 0 (`token_ids.py`); Marian's
    vocabularies end with the pad id, which also starts the decoder.
  type_vocab_size: 0 for none, else a table of that many token-type
    (segment A/B) embeddings added to the encoder's token and position
    embeddings; inputs_token_types (None: all 0) pick the rows.
  embedding_norm: a norm (config.norm_type, its epsilon) of the embeddings
    (tokens + positions + token types), before their dropout.
  pooler: encoder-only heads pass the pooled vector through a d_model ->
    d_model dense layer and tanh before the classifier or regressor.
  lora: low-rank adapters on projections of attention and the FFN, which
    then train alone (`model/lora.py` LoraConfig; targets='' for none).
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
  num_kv_heads: int = 0  # 0: num_heads.
  head_dim: int = 0  # 0: d_model // num_heads.
  d_ff: int = 2048
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  max_len: int = 512
  share_embeddings: str = 'all'
  norm_position: str = 'post'
  norm_type: str = 'layer'
  activation: str = 'relu'
  position_embedding: str = 'sinusoidal'
  sinusoid_layout: str = 'interleaved'
  position_offset: int = 0
  rope_theta: float = 10000.0
  rope_scaling: str = 'none'
  rope_scaling_factor: float = 1.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_len: int = 8192
  scale_embedding: bool = True
  output_bias: bool = False
  logits_bias: bool = True
  pad_id: int = 0
  eos_id: int = 1
  decoder_start_id: int = 0
  zero_pad_embedding: bool = False
  type_vocab_size: int = 0
  embedding_norm: bool = False
  embedding_dropout: float = 0.1
  residual_dropout: float = 0.1
  attention_dropout: float = 0.0
  ffn_dropout: float = 0.0
  layer_norm_epsilon: float = 1e-6
  rms_norm_epsilon: float = 1e-6
  norm_bias: bool = True
  use_bias: bool = True
  qkv_bias: bool = False
  dtype: str = 'float32'  # 'auto': see backend.compute_dtype.
  attention_impl: str = 'auto'  # See backend.attention_kernel.
  scan_layers: bool = False
  remat_policy: str = 'none'
  # Encoder-only heads.
  num_classes: int = 2
  regression_dim: int = 1
  pooling: str = 'first'
  pooler: bool = False
  lora: lora_lib.LoraConfig = lora_lib.LoraConfig()

  def __post_init__(self):
    # A config dict's model.lora arrives as a dict.
    object.__setattr__(self, 'lora', lora_lib.from_dict(self.lora))
    lora_lib.check(self.lora)
    for key, allowed in CHOICES.items():
      if getattr(self, key) not in allowed:
        raise ValueError(
            f'model.{key}={getattr(self, key)!r} is not one of {allowed}.')
    if self.type_vocab_size < 0:
      raise ValueError(f'model.type_vocab_size={self.type_vocab_size} must '
                       'be 0 (no token types) or more.')
    if self.position_offset < 0:
      raise ValueError(f'model.position_offset={self.position_offset} must '
                       'be 0 or more.')
    if not self.head_dim and self.d_model % self.num_heads:
      raise ValueError(
          f'model.d_model={self.d_model} must be divisible by '
          f'model.num_heads={self.num_heads}, or set model.head_dim.')
    if self.num_heads % self.kv_heads:
      raise ValueError(
          f'model.num_kv_heads={self.num_kv_heads} must divide '
          f'model.num_heads={self.num_heads}.')
    if self.position_embedding == 'rope' and self.head_features % 2:
      raise ValueError(f'model.position_embedding=rope rotates pairs of '
                       f'features: the head dimension {self.head_features} '
                       'must be even.')
    if self.rope_scaling == 'llama3' and not (
        self.rope_low_freq_factor < self.rope_high_freq_factor):
      raise ValueError(
          "model.rope_scaling='llama3' needs model.rope_low_freq_factor "
          f'({self.rope_low_freq_factor}) below model.rope_high_freq_factor '
          f'({self.rope_high_freq_factor}).')
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
  def head_features(self) -> int:
    """Features of each attention head (model.head_dim resolved)."""
    return self.head_dim or self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Key/value heads (model.num_kv_heads resolved)."""
    return self.num_kv_heads or self.num_heads

  @property
  def gated_ffn(self) -> bool:
    return self.activation in ('swiglu', 'geglu')

  @property
  def lora_targets(self) -> frozenset[str]:
    """The projections that carry adapters (none without model.lora)."""
    return lora_lib.target_set(self.lora, self.gated_ffn)

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
