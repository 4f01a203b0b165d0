"""Transformer models: encoder, decoder, encoder-decoder (translation),
encoder-only classifier/regressor and decoder-only language model.

Token ids `config.pad_id` are padding; targets are shifted right by one
inside the model, with `config.decoder_start_id` first (jaxformer's own
vocabularies: 0 for both). Segment ids mark packed examples (0 = padding);
positions restart at 0 in each segment.
"""
import jax
import jax.numpy as jnp
from flax import linen as nn

from jaxformer.model import layers
from jaxformer.model.attention import MultiHeadAttention
from jaxformer.model.masks import Segments
from jaxformer.model.config import ModelConfig

REMAT_POLICIES = {
    'full': None,
    'dots': jax.checkpoint_policies.checkpoint_dots,
    'dots_with_no_batch_dims':
        jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def shift_right(targets: jax.Array, segment_ids: jax.Array,
                start_id: int | jax.Array = 0) -> jax.Array:
  """Decoder inputs: targets moved one step right, `start_id` at each
  segment start.

  Args:
    targets, segment_ids: [batch, length] int.
    start_id: an id, or [batch, 1] ids (one a row).
  """
  shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
  previous_segment = jnp.pad(segment_ids, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(segment_ids == previous_segment, shifted, start_id)


def default_segments(tokens, segment_ids, positions, pad_id: int = 0):
  """Unpacked defaults: segment 1 for real tokens (not `pad_id`), positions
  0..length-1."""
  if segment_ids is None:
    segment_ids = (tokens != pad_id).astype(jnp.int32)
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  return segment_ids, positions


def constrain(x):
  return nn.with_logical_constraint(x, ('batch', 'length', 'embed'))


class EncoderLayer(nn.Module):
  """Self-attention and FFN, each with residual + norm."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, mask, positions):
    """x: [batch, s, d_model]; mask: `Segments` [batch, s] x [batch, s];
    positions: [batch, s] int. Returns (x, None)."""
    cfg, det = self.config, self.deterministic
    drop = layers.Dropout(cfg.residual_dropout)
    attend = MultiHeadAttention(cfg, 'self', det, name='self_attention')
    x = layers.residual(x, lambda h: attend(h, h, mask, positions),
                        'self_attention', drop, cfg, det)
    x = layers.residual(x, layers.FeedForward(cfg, det, name='ffn'), 'ffn',
                        drop, cfg, det)
    return constrain(x), None


class DecoderLayer(nn.Module):
  """Causal self-attention, cross-attention (unless decoder-only) and FFN."""
  config: ModelConfig
  deterministic: bool = True
  decode: bool = False
  cross: bool = True

  @nn.compact
  def __call__(self, x, self_mask, positions, encoded, cross_mask):
    """x: [batch, t, d_model]; self_mask: `Segments` [batch, t] x [batch,
    t], causal; positions: [batch, t] int; encoded: [batch, s, d_model]
    (None for decoder-only, or once the decode cache exists); cross_mask:
    `Segments` [batch, t|1] x [batch, s]. Returns (x, None)."""
    cfg, det = self.config, self.deterministic
    drop = layers.Dropout(cfg.residual_dropout)
    self_attend = MultiHeadAttention(cfg, 'causal', det, self.decode,
                                     name='self_attention')
    x = layers.residual(x, lambda h: self_attend(h, h, self_mask, positions),
                        'self_attention', drop, cfg, det)
    if self.cross:
      cross_attend = MultiHeadAttention(cfg, 'cross', det, self.decode,
                                        name='cross_attention')
      x = layers.residual(x, lambda h: cross_attend(h, encoded, cross_mask),
                          'cross_attention', drop, cfg, det)
    x = layers.residual(x, layers.FeedForward(cfg, det, name='ffn'), 'ffn',
                        drop, cfg, det)
    return constrain(x), None


def stack_layers(layer_cls, config: ModelConfig, num_layers: int, **kwargs):
  """Returns fn(x, *args) -> x that runs `num_layers` layers, as a Python
  loop or as one `nn.scan` (compile time independent of depth), with the
  configured rematerialisation. Must be called inside a compact method."""
  if config.remat_policy != 'none':
    layer_cls = nn.remat(layer_cls, policy=REMAT_POLICIES[config.remat_policy],
                         prevent_cse=not config.scan_layers)
  if config.scan_layers:
    def run_scanned(x, *args):
      scanned = nn.scan(
          layer_cls, variable_axes={'params': 0, 'cache': 0,
                                    'intermediates': 0},
          split_rngs={'params': True, 'dropout': True},
          in_axes=(nn.broadcast,) * len(args), length=num_layers,
          metadata_params={nn.PARTITION_NAME: 'layers'})
      return scanned(config, name='layers', **kwargs)(x, *args)[0]
    return run_scanned

  def run_looped(x, *args):
    for i in range(num_layers):
      x, _ = layer_cls(config, name=f'layer_{i}', **kwargs)(x, *args)
    return x
  return run_looped


class Encoder(nn.Module):
  """Embedding + positions + N encoder layers (+ final norm if pre-LN)."""
  config: ModelConfig
  embed: layers.Embed
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs, segment_ids, positions, packed=True,
               token_types=None):
    """inputs, segment_ids, positions: [batch, s] int -> [batch, s, d_model].
    packed=False promises one example per row (see `Segments`);
    token_types: [batch, s] int or None (all 0; model.type_vocab_size)."""
    cfg = self.config
    x = layers.AddPositions(cfg, name='positions')(self.embed(inputs), positions)
    if cfg.type_vocab_size:
      x = layers.TokenTypes(cfg, name='token_types')(x, token_types)
    x = layers.embedding_norm(cfg, x)
    x = layers.Dropout(cfg.embedding_dropout)(x, deterministic=self.deterministic)
    mask = Segments(segment_ids, segment_ids, causal=False, packed=packed)
    x = stack_layers(EncoderLayer, cfg, cfg.num_encoder_layers,
                     deterministic=self.deterministic)(constrain(x), mask,
                                                       positions)
    if cfg.norm_position == 'pre':
      x = layers.norm(cfg, 'final_norm')(x)
    return x


class Decoder(nn.Module):
  """Embedding + positions + N decoder layers + output projection."""
  config: ModelConfig
  embed: layers.Embed
  deterministic: bool = True
  decode: bool = False
  cross: bool = True

  @nn.compact
  def __call__(self, decoder_inputs, segment_ids, positions, encoded=None,
               encoder_segment_ids=None, output_fn=None, packed=True):
    """Logits for the next token at every decoder position.

    Args:
      decoder_inputs, segment_ids, positions: [batch, t] int (t = 1 per call
        in decode mode once the cache exists).
      encoded: [batch, s, d_model] or None (decoder-only).
      encoder_segment_ids: [batch, s] int or None.
      output_fn: computes what is returned instead of the logits, from the
        last hidden states [batch, t, d_model] and the output layer, kernel
        [vocab, d_model] and bias [vocab] (None without one: tied without
        config.output_bias, separate without config.logits_bias), in the
        compute dtype:
        `output_fn(x, kernel, bias)`.
      packed: False promises one example per row, in the decoder and the
        encoder (see `Segments`).

    Returns:
      [batch, t, vocab] float32, or output_fn's result.
    """
    cfg = self.config
    x = layers.AddPositions(cfg, name='positions')(
        self.embed(decoder_inputs), positions)
    x = layers.embedding_norm(cfg, x)
    x = layers.Dropout(cfg.embedding_dropout)(x, deterministic=self.deterministic)
    self_mask = Segments(segment_ids, segment_ids, causal=True, packed=packed)
    cross_mask = None
    if self.cross:
      cross_mask = Segments(segment_ids, encoder_segment_ids, causal=False,
                            packed=packed)
    x = stack_layers(DecoderLayer, cfg, cfg.num_decoder_layers,
                     deterministic=self.deterministic, decode=self.decode,
                     cross=self.cross)(constrain(x), self_mask, positions,
                                       encoded, cross_mask)
    if cfg.norm_position == 'pre':
      x = layers.norm(cfg, 'final_norm')(x)
    if cfg.share_embeddings == 'none':
      head = layers.Linear((cfg.output_vocab_size,), ('vocab', 'embed'), cfg,
                           use_bias=cfg.logits_bias, name='logits')
      if output_fn is not None:
        return output_fn(x, *head.weights((cfg.d_model,))[:2])
      logits = head(x)
    else:
      bias = None
      if cfg.output_bias:
        bias = self.param('output_bias', nn.with_logical_partitioning(
            nn.initializers.zeros, ('vocab',)), (cfg.output_vocab_size,),
                          jnp.float32)
      if output_fn is not None:
        return output_fn(x, self.embed.weights(), None if bias is None
                         else bias.astype(cfg.compute_dtype))
      logits = self.embed.attend(x)
      if bias is not None:
        logits = logits + bias
    return nn.with_logical_constraint(logits.astype(jnp.float32),
                                      ('batch', 'length', 'vocab'))


class EncoderDecoder(nn.Module):
  """The translation Transformer.

  `deterministic=False` turns dropout on (needs a 'dropout' rng);
  `decode=True` runs the decoder one position at a time with a 'cache'.
  """
  config: ModelConfig
  deterministic: bool = True
  decode: bool = False

  def setup(self):
    cfg = self.config
    self.source_embed = layers.Embed(cfg.vocab_size, cfg)
    if cfg.share_embeddings == 'all':
      self.target_embed = self.source_embed
    else:
      self.target_embed = layers.Embed(cfg.output_vocab_size, cfg)
    self.encoder = Encoder(cfg, self.source_embed, self.deterministic)
    self.decoder = Decoder(cfg, self.target_embed, self.deterministic,
                           self.decode)

  def encode(self, inputs, inputs_segment_ids=None, inputs_positions=None):
    """[batch, s] int -> [batch, s, d_model]. Without segment ids, rows are
    single examples (which lets cuDNN attention take them)."""
    packed = inputs_segment_ids is not None
    segment_ids, positions = default_segments(
        inputs, inputs_segment_ids, inputs_positions, self.config.pad_id)
    return self.encoder(inputs, segment_ids, positions, packed)

  def decode_logits(self, encoded, inputs_segment_ids, decoder_inputs,
                    targets_segment_ids, targets_positions, output_fn=None,
                    packed=True):
    """Decoder logits [batch, t, vocab] for already shifted decoder inputs
    (or `output_fn`'s result, see `Decoder`)."""
    return self.decoder(decoder_inputs, targets_segment_ids, targets_positions,
                        encoded, inputs_segment_ids, output_fn, packed)

  def __call__(self, inputs, targets, inputs_segment_ids=None,
               inputs_positions=None, targets_segment_ids=None,
               targets_positions=None, output_fn=None):
    """Teacher-forced logits.

    Args:
      inputs: [batch, s] int source tokens; targets: [batch, t] int target
        tokens (ending in EOS); the *_segment_ids/_positions for packed rows.
      output_fn: see `Decoder`.

    Returns:
      [batch, t, vocab] float32: logits for targets[:, i] given targets[:, :i]
      (or output_fn's result). Without segment ids, rows are single examples
      (see `encode`).
    """
    packed = (inputs_segment_ids is not None
              or targets_segment_ids is not None)
    pad_id = self.config.pad_id
    inputs_segment_ids, inputs_positions = default_segments(
        inputs, inputs_segment_ids, inputs_positions, pad_id)
    targets_segment_ids, targets_positions = default_segments(
        targets, targets_segment_ids, targets_positions, pad_id)
    encoded = self.encoder(inputs, inputs_segment_ids, inputs_positions,
                           packed)
    return self.decode_logits(
        encoded, inputs_segment_ids,
        shift_right(targets, targets_segment_ids,
                    self.config.decoder_start_id),
        targets_segment_ids, targets_positions, output_fn, packed)


class DecoderLM(nn.Module):
  """Decoder-only language model (causal self-attention, no encoder).

  `decode=True` runs it one position at a time with a 'cache', every row at
  the same position; `decode='rows'` each row at its own, after a prefill
  (`MultiHeadAttention`).
  """
  config: ModelConfig
  deterministic: bool = True
  decode: bool | str = False

  def setup(self):
    self.embed = layers.Embed(self.config.vocab_size, self.config)
    self.decoder = Decoder(self.config, self.embed, self.deterministic,
                           self.decode, cross=False)

  def decode_logits(self, decoder_inputs, segment_ids, positions):
    """Logits [batch, t, vocab] for already shifted inputs."""
    return self.decoder(decoder_inputs, segment_ids, positions)

  def __call__(self, targets, targets_segment_ids=None,
               targets_positions=None, output_fn=None, targets_start=None):
    """[batch, t] int -> [batch, t, vocab]: logits for targets[:, i] given
    targets[:, :i] (or output_fn's result, see `Decoder`), after the
    start token: decoder_start_id, or where `targets_start` [batch] (one
    segment a row) is not -1, that row's own."""
    cfg = self.config
    packed = targets_segment_ids is not None
    segment_ids, positions = default_segments(targets, targets_segment_ids,
                                              targets_positions, cfg.pad_id)
    start = cfg.decoder_start_id
    if targets_start is not None:
      start = jnp.where(targets_start < 0, start, targets_start)[:, None]
    return self.decoder(shift_right(targets, segment_ids, start), segment_ids,
                        positions, output_fn=output_fn, packed=packed)


def pool(x: jax.Array, segment_ids: jax.Array, pooling: str) -> jax.Array:
  """[batch, s, d] -> [batch, d]: the first token, or the mean of non-pad
  tokens."""
  if pooling == 'first':
    return x[:, 0]
  weights = (segment_ids != 0).astype(x.dtype)[..., None]
  return (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1)


class PooledEncoder(nn.Module):
  """Encoder whose output is pooled into one vector per example."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs, inputs_segment_ids=None, inputs_positions=None,
               inputs_token_types=None):
    """[batch, s] int -> [batch, d_model] (compute dtype); with
    model.pooler, through the dense layer 'pooler' and tanh."""
    cfg = self.config
    packed = inputs_segment_ids is not None
    segment_ids, positions = default_segments(
        inputs, inputs_segment_ids, inputs_positions, cfg.pad_id)
    embed = layers.Embed(cfg.vocab_size, cfg, name='embed')
    x = Encoder(cfg, embed, self.deterministic, name='encoder')(
        inputs, segment_ids, positions, packed, inputs_token_types)
    pooled = pool(x, segment_ids, cfg.pooling)
    if cfg.pooler:
      pooled = jnp.tanh(layers.Linear((cfg.d_model,), (None, 'embed'), cfg,
                                      name='pooler')(pooled))
    return pooled


def _pooled_head(module: nn.Module, size: int, name: str, inputs,
                 inputs_segment_ids, inputs_positions,
                 inputs_token_types) -> jax.Array:
  """The encoder-only heads' shared body, called inside `module`'s compact
  method: pooled encoder states [batch, d_model] -> [batch, size] float32."""
  cfg = module.config
  pooled = PooledEncoder(cfg, module.deterministic, name='body')(
      inputs, inputs_segment_ids, inputs_positions, inputs_token_types)
  return layers.Linear((size,), (None, 'embed'), cfg, name=name)(
      pooled).astype(jnp.float32)


class EncoderClassifier(nn.Module):
  """Encoder-only classifier: logits [batch, num_classes] float32 (the
  loss takes their log_softmax)."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs, inputs_segment_ids=None, inputs_positions=None,
               inputs_token_types=None):
    return _pooled_head(self, self.config.num_classes, 'classifier', inputs,
                        inputs_segment_ids, inputs_positions,
                        inputs_token_types)


class EncoderRegressor(nn.Module):
  """Encoder-only regressor: values [batch, regression_dim] float32."""
  config: ModelConfig
  deterministic: bool = True

  @nn.compact
  def __call__(self, inputs, inputs_segment_ids=None, inputs_positions=None,
               inputs_token_types=None):
    return _pooled_head(self, self.config.regression_dim, 'regressor', inputs,
                        inputs_segment_ids, inputs_positions,
                        inputs_token_types)
