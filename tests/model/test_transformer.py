"""The model family on tiny configs: shapes, masking, cached decoding,
equivalent execution options, training and parameter metadata."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from jaxformer.model import (DecoderLM, EncoderClassifier, EncoderDecoder,
                             EncoderRegressor, ModelConfig, shift_right)

TINY = ModelConfig(vocab_size=50, d_model=32, num_heads=4, d_ff=64,
                   num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                   num_classes=3, regression_dim=2)
# One layer per stack where a test compiles a backward pass.
SHALLOW = TINY.replace(num_encoder_layers=1, num_decoder_layers=1)
# Today's blocks: rotary positions, RMSNorm before each sublayer and after
# the stack, SwiGLU, grouped-query attention with heads of their own width,
# q/k/v biases only, an untied output layer without bias.
MODERN = TINY.replace(position_embedding='rope', rope_theta=500.0,
                      norm_type='rms', norm_position='pre',
                      activation='swiglu', num_kv_heads=2, head_dim=12,
                      use_bias=False, qkv_bias=True, share_embeddings='none',
                      logits_bias=False, scale_embedding=False)
CONFIGS = pytest.mark.parametrize('config', [TINY, MODERN],
                                  ids=['paper', 'modern'])
KEY = jax.random.PRNGKey(0)

# A padded batch: token 0 is padding.
INPUTS = jnp.array([[5, 9, 13, 2, 7, 0, 0, 0],
                    [4, 8, 15, 16, 23, 42, 3, 1]])
TARGETS = jnp.array([[11, 12, 3, 1, 0, 0, 0],
                     [21, 22, 23, 24, 25, 26, 1]])


def segments(tokens):
  return (tokens != 0).astype(jnp.int32)


def init(model, *args):
  return nn.unbox(model.init(KEY, *args)['params'])


def stacked(params):
  """Loop parameters (layer_0, layer_1, ...) as scan_layers parameters."""
  def convert(tree):
    if not isinstance(tree, dict):
      return tree
    names = sorted(k for k in tree if k.startswith('layer_'))
    out = {k: convert(v) for k, v in tree.items() if k not in names}
    if names:
      out['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs),
                                   *[tree[n] for n in names])
    return out
  return convert(params)


def replace_padding(tokens, seed):
  """The same row with different (non-zero) tokens under the padding."""
  noise = jax.random.randint(jax.random.PRNGKey(seed), tokens.shape, 1, 50)
  return jnp.where(tokens == 0, noise, tokens)


# Shapes.


@pytest.mark.slow
def test_encoder_decoder_gives_float32_logits_per_target_position():
  model = EncoderDecoder(TINY)
  params = init(model, INPUTS, TARGETS)
  logits = model.apply({'params': params}, INPUTS, TARGETS)
  assert logits.shape == (2, 7, 50) and logits.dtype == jnp.float32


@pytest.mark.slow
def test_separate_target_vocabulary():
  config = TINY.replace(target_vocab_size=30, share_embeddings='none')
  model = EncoderDecoder(config)
  params = init(model, INPUTS, TARGETS)
  assert params['decoder']['logits']['kernel'].shape == (30, 32)
  assert params['target_embed']['embedding'].shape == (30, 32)
  assert model.apply({'params': params}, INPUTS, TARGETS).shape == (2, 7, 30)


def test_decoder_lm_gives_logits_per_position():
  model = DecoderLM(TINY)
  params = init(model, TARGETS)
  logits = model.apply({'params': params}, TARGETS)
  assert logits.shape == (2, 7, 50) and logits.dtype == jnp.float32


@pytest.mark.parametrize('pooling', ['first', 'mean'])
def test_classifier_gives_logits(pooling):
  model = EncoderClassifier(TINY.replace(pooling=pooling))
  params = init(model, INPUTS)
  logits = model.apply({'params': params}, INPUTS)
  assert logits.shape == (2, 3) and logits.dtype == jnp.float32
  # Raw logits (the loss takes their log_softmax), not log-probabilities.
  assert not np.allclose(jnp.exp(logits).sum(-1), 1.0, rtol=1e-3)


def test_token_types_embedding_norm_and_pooler():
  """model.type_vocab_size adds a row per token type (None: row 0),
  model.embedding_norm normalises the embeddings, model.pooler adds a
  tanh dense layer to the pooled vector."""
  config = TINY.replace(type_vocab_size=2, embedding_norm=True, pooler=True)
  model = EncoderClassifier(config)
  params = init(model, INPUTS)
  body = params['body']
  assert body['encoder']['token_types']['embedding'].shape == (2, 32)
  assert 'embedding_norm' in body['encoder'] and 'pooler' in body
  types = jnp.zeros_like(INPUTS)
  default = model.apply({'params': params}, INPUTS)
  np.testing.assert_allclose(
      model.apply({'params': params}, INPUTS, inputs_token_types=types),
      default, atol=1e-6)
  assert not np.allclose(model.apply({'params': params}, INPUTS,
                                     inputs_token_types=types.at[:, 2:].set(1)),
                         default, atol=1e-4)


def test_regressor_gives_values():
  model = EncoderRegressor(TINY)
  params = init(model, INPUTS)
  values = model.apply({'params': params}, INPUTS)
  assert values.shape == (2, 2) and values.dtype == jnp.float32


# Masking: padding, causality, packed segments.


@pytest.mark.slow
def test_encoder_decoder_ignores_tokens_under_padding():
  model = EncoderDecoder(TINY)
  params = init(model, INPUTS, TARGETS)
  seg_in, seg_tgt = segments(INPUTS), segments(TARGETS)
  logits = model.apply({'params': params}, INPUTS, TARGETS, seg_in, None,
                       seg_tgt)
  changed = model.apply({'params': params}, replace_padding(INPUTS, 1),
                        replace_padding(TARGETS, 2), seg_in, None, seg_tgt)
  real = np.asarray(seg_tgt, bool)
  np.testing.assert_allclose(changed[real], logits[real], atol=1e-5)
  # The padding was really changed and padding queries do see it.
  assert not np.allclose(changed[~real], logits[~real], atol=1e-3)


def test_decoder_lm_ignores_tokens_under_padding():
  model = DecoderLM(TINY)
  params = init(model, TARGETS)
  seg = segments(TARGETS)
  logits = model.apply({'params': params}, TARGETS, seg)
  changed = model.apply({'params': params}, replace_padding(TARGETS, 1), seg)
  real = np.asarray(seg, bool)
  np.testing.assert_allclose(changed[real], logits[real], atol=1e-5)


@pytest.mark.slow
@CONFIGS
@pytest.mark.parametrize('model_cls', [EncoderClassifier, EncoderRegressor])
@pytest.mark.parametrize('pooling', ['first', 'mean'])
def test_encoder_only_models_ignore_tokens_under_padding(model_cls, pooling,
                                                         config):
  model = model_cls(config.replace(pooling=pooling))
  params = init(model, INPUTS)
  seg = segments(INPUTS)
  out = model.apply({'params': params}, INPUTS, seg)
  changed = model.apply({'params': params}, replace_padding(INPUTS, 1), seg)
  np.testing.assert_allclose(changed, out, atol=1e-5)


def test_encoder_decoder_logits_do_not_see_future_targets():
  model = EncoderDecoder(TINY)
  params = init(model, INPUTS, TARGETS)
  future = TARGETS.at[:, 3:].set(TARGETS[:, 3:] % 40 + 5)
  logits = model.apply({'params': params}, INPUTS, TARGETS)
  changed = model.apply({'params': params}, INPUTS, future)
  # logits[:, i] predicts targets[:, i] from targets[:, :i].
  np.testing.assert_allclose(changed[:, :4], logits[:, :4], atol=1e-5)
  assert not np.allclose(changed[1, 4:], logits[1, 4:], atol=1e-3)


def test_decoder_lm_logits_do_not_see_future_tokens():
  model = DecoderLM(TINY)
  params = init(model, TARGETS)
  future = TARGETS.at[:, 3:].set(TARGETS[:, 3:] % 40 + 5)
  logits = model.apply({'params': params}, TARGETS)
  changed = model.apply({'params': params}, future)
  np.testing.assert_allclose(changed[:, :4], logits[:, :4], atol=1e-5)
  assert not np.allclose(changed[1, 4:], logits[1, 4:], atol=1e-3)


# Two examples, a and b, packed into one row in both orders, and each alone.
SRC_A, TGT_A = [5, 9, 13], [11, 12, 3, 1]
SRC_B, TGT_B = [4, 8, 15, 16], [21, 22, 1]


def packed(rows, length):
  """Rows of concatenated examples -> tokens, segment ids, positions."""
  tokens, seg, pos = [], [], []
  for examples in rows:
    pad = length - sum(map(len, examples))
    tokens.append(sum(examples, []) + [0] * pad)
    seg.append(sum(([i + 1] * len(e) for i, e in enumerate(examples)), [])
               + [0] * pad)
    pos.append(sum((list(range(len(e))) for e in examples), []) + [0] * pad)
  return jnp.array(tokens), jnp.array(seg), jnp.array(pos)


@pytest.mark.slow
@CONFIGS
def test_packed_examples_do_not_see_each_other_in_encoder_decoder(config):
  model = EncoderDecoder(config)
  params = init(model, INPUTS, TARGETS)
  src, src_seg, src_pos = packed([[SRC_A, SRC_B], [SRC_B, SRC_A]], 8)
  tgt, tgt_seg, tgt_pos = packed([[TGT_A, TGT_B], [TGT_B, TGT_A]], 7)
  together = model.apply({'params': params}, src, tgt, src_seg, src_pos,
                         tgt_seg, tgt_pos)
  alone = model.apply({'params': params}, packed([[SRC_A], [SRC_B]], 8)[0],
                      packed([[TGT_A], [TGT_B]], 7)[0])
  a, b = alone[0, :4], alone[1, :3]
  np.testing.assert_allclose(together[0, :4], a, atol=1e-5)
  np.testing.assert_allclose(together[0, 4:7], b, atol=1e-5)
  np.testing.assert_allclose(together[1, :3], b, atol=1e-5)
  np.testing.assert_allclose(together[1, 3:7], a, atol=1e-5)


@pytest.mark.slow
@CONFIGS
def test_packed_examples_do_not_see_each_other_in_decoder_lm(config):
  model = DecoderLM(config)
  params = init(model, TARGETS)
  tgt, seg, pos = packed([[TGT_A, TGT_B], [TGT_B, TGT_A]], 7)
  together = model.apply({'params': params}, tgt, seg, pos)
  alone = model.apply({'params': params}, packed([[TGT_A], [TGT_B]], 7)[0])
  a, b = alone[0, :4], alone[1, :3]
  np.testing.assert_allclose(together[0, :4], a, atol=1e-5)
  np.testing.assert_allclose(together[0, 4:7], b, atol=1e-5)
  np.testing.assert_allclose(together[1, :3], b, atol=1e-5)
  np.testing.assert_allclose(together[1, 3:7], a, atol=1e-5)


def test_shift_right_starts_each_segment_with_zero():
  targets = jnp.array([[11, 12, 3, 21, 22, 0]])
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(shift_right(targets, seg),
                                [[0, 11, 12, 0, 21, 0]])


@pytest.mark.slow
@CONFIGS
def test_a_rows_own_start_makes_it_read_its_first_token_first(config):
  """targets_start: a row [t1..] with start t0 gives the logits of
  [t0, t1, ...] read from position 0 (as a prompt without BOS is fed to
  `generate`); -1 keeps the model's start token."""
  params = init(DecoderLM(config), TEACHER_FORCED)
  model = DecoderLM(config)
  first, rest = TEACHER_FORCED[:, 0], TEACHER_FORCED[:, 1:]
  own = model.apply({'params': params}, rest, targets_start=first)
  inputs = TEACHER_FORCED[:, :-1]
  ones = jnp.ones_like(inputs)
  read = model.apply({'params': params}, inputs, ones,
                     jnp.broadcast_to(jnp.arange(4), inputs.shape),
                     method='decode_logits')
  np.testing.assert_allclose(own, read, atol=1e-5)
  np.testing.assert_allclose(
      model.apply({'params': params}, rest,
                  targets_start=jnp.array([-1, first[1]]))[0],
      model.apply({'params': params}, rest)[0], atol=1e-6)


# Cached decoding.


def decode_step_by_step(decode, params, decoder_inputs, segment_ids,
                        positions, encoded=None):
  """Cached decoding with `decode(variables, encoded, decoder_inputs,
  segment_ids, positions) -> (logits, {'cache': ...})`.

  A first call at full length creates the cache (for an encoder-decoder it
  also computes the source keys and values from `encoded`); then one call
  per position, without the encoder output. Returns the per-step logits.
  """
  _, state = decode({'params': params}, encoded,
                    jnp.zeros_like(decoder_inputs), segment_ids, positions)
  steps = []
  for i in range(decoder_inputs.shape[1]):
    logits, state = decode({'params': params, **state}, None,
                           decoder_inputs[:, i:i + 1],
                           segment_ids[:, i:i + 1], positions[:, i:i + 1])
    steps.append(logits)
  return jnp.concatenate(steps, axis=1)


TEACHER_FORCED = jnp.array([[11, 12, 3, 4, 1], [21, 22, 23, 24, 1]])
ONES = jnp.ones_like(TEACHER_FORCED)
POSITIONS = jnp.broadcast_to(jnp.arange(5), TEACHER_FORCED.shape)


@pytest.mark.slow
@CONFIGS
@pytest.mark.parametrize('scan_layers', [False, True])
def test_cached_decoding_equals_teacher_forcing_in_encoder_decoder(
    scan_layers, config):
  params = init(EncoderDecoder(config), INPUTS, TEACHER_FORCED)
  full = EncoderDecoder(config).apply({'params': params}, INPUTS,
                                      TEACHER_FORCED)

  params = stacked(params) if scan_layers else params
  model = EncoderDecoder(config.replace(scan_layers=scan_layers), decode=True)
  encoded = model.apply({'params': params}, INPUTS, method='encode')

  @jax.jit
  def decode(variables, encoded, decoder_inputs, segment_ids, positions):
    return model.apply(variables, encoded, segments(INPUTS), decoder_inputs,
                       segment_ids, positions, method='decode_logits',
                       mutable=['cache'])

  stepped = decode_step_by_step(decode, params,
                                shift_right(TEACHER_FORCED, ONES), ONES,
                                POSITIONS, encoded)
  np.testing.assert_allclose(stepped, full, atol=1e-5)


@pytest.mark.slow
@CONFIGS
@pytest.mark.parametrize('scan_layers', [False, True])
def test_cached_decoding_equals_teacher_forcing_in_decoder_lm(scan_layers,
                                                              config):
  params = init(DecoderLM(config), TEACHER_FORCED)
  full = DecoderLM(config).apply({'params': params}, TEACHER_FORCED)

  params = stacked(params) if scan_layers else params
  model = DecoderLM(config.replace(scan_layers=scan_layers), decode=True)

  @jax.jit
  def decode(variables, encoded, decoder_inputs, segment_ids, positions):
    del encoded  # Decoder-only.
    return model.apply(variables, decoder_inputs, segment_ids, positions,
                       method='decode_logits', mutable=['cache'])

  stepped = decode_step_by_step(decode, params,
                                shift_right(TEACHER_FORCED, ONES), ONES,
                                POSITIONS)
  np.testing.assert_allclose(stepped, full, atol=1e-5)


# Equivalent execution options.


@pytest.mark.slow
@CONFIGS
def test_fused_attention_model_equals_einsum_model(config):
  params = init(EncoderDecoder(config), INPUTS, TARGETS)
  einsum = EncoderDecoder(config).apply({'params': params}, INPUTS, TARGETS)
  fused = EncoderDecoder(config.replace(attention_impl='fused')).apply(
      {'params': params}, INPUTS, TARGETS)
  real = np.asarray(segments(TARGETS), bool)
  np.testing.assert_allclose(fused[real], einsum[real], atol=1e-5)


@pytest.mark.slow
@CONFIGS
def test_scanned_layers_equal_looped_layers_with_stacked_params(config):
  params = init(EncoderDecoder(config), INPUTS, TARGETS)
  looped = EncoderDecoder(config).apply({'params': params}, INPUTS, TARGETS)
  scanned_model = EncoderDecoder(config.replace(scan_layers=True))
  scanned_params = stacked(params)
  # The mapped tree is exactly the scanned model's own parameter tree.
  own = jax.eval_shape(lambda: scanned_model.init(KEY, INPUTS, TARGETS))
  assert (jax.tree.map(jnp.shape, scanned_params)
          == jax.tree.map(jnp.shape, nn.unbox(own['params'])))
  scanned = scanned_model.apply({'params': scanned_params}, INPUTS, TARGETS)
  np.testing.assert_allclose(scanned, looped, atol=1e-5)


def loss_fn(model, params, inputs, targets):
  logits = model.apply({'params': params}, inputs, targets)
  weights = (targets != 0).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return (losses * weights).sum() / weights.sum()


@pytest.mark.slow
@CONFIGS
def test_remat_gives_the_same_loss_and_gradients(config):
  """Same parameters (stacked for scan); rematerialisation changes only what
  the backward pass recomputes."""
  def loss_and_grads(model, params):
    return jax.jit(jax.value_and_grad(
        lambda p: loss_fn(model, p, INPUTS, TARGETS)))(params)

  shallow = config.replace(num_encoder_layers=1, num_decoder_layers=1)
  params = init(EncoderDecoder(shallow), INPUTS, TARGETS)
  loss, grads = loss_and_grads(EncoderDecoder(shallow), params)
  for remat_policy, scan_layers in [('full', False), ('dots', True)]:
    model = EncoderDecoder(shallow.replace(remat_policy=remat_policy,
                                           scan_layers=scan_layers))
    convert = stacked if scan_layers else (lambda tree: tree)
    remat_loss, remat_grads = loss_and_grads(model, convert(params))
    np.testing.assert_allclose(remat_loss, loss, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                 remat_grads, convert(grads))


# Training.


@pytest.mark.slow
@pytest.mark.parametrize('norm_position', ['post', 'pre'])
def test_both_norm_positions_learn_to_copy(norm_position):
  config = SHALLOW.replace(norm_position=norm_position, embedding_dropout=0.0,
                           residual_dropout=0.0)
  model = EncoderDecoder(config)
  batch = jax.random.randint(jax.random.PRNGKey(1), (8, 6), 1, 50)
  params = init(model, batch, batch)
  optimizer = optax.adam(3e-3)
  opt_state = optimizer.init(params)

  @jax.jit
  def train_step(params, opt_state):
    loss, grads = jax.value_and_grad(
        lambda p: loss_fn(model, p, batch, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  for _ in range(20):
    params, opt_state, loss = train_step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < 0.6 * losses[0], losses


# Parameters: metadata and dtypes.


@pytest.mark.parametrize('model_cls, config', [
    (EncoderDecoder, TINY),
    (EncoderDecoder, TINY.replace(share_embeddings='none', norm_position='pre',
                                  position_embedding='learned')),
    (EncoderDecoder, TINY.replace(share_embeddings='target',
                                  scan_layers=True)),
    (EncoderDecoder, MODERN.replace(scan_layers=True)),
    (DecoderLM, TINY),
    (DecoderLM, MODERN),
    (EncoderClassifier, TINY),
    (EncoderClassifier, MODERN),
    (EncoderClassifier, TINY.replace(type_vocab_size=2, embedding_norm=True,
                                     pooler=True)),
    (EncoderRegressor, TINY),
])
def test_every_parameter_has_logical_axis_names(model_cls, config):
  args = (INPUTS, TARGETS) if model_cls is EncoderDecoder else (INPUTS,)
  variables = jax.eval_shape(lambda: model_cls(config).init(KEY, *args))
  leaves = jax.tree.leaves(
      variables['params'], is_leaf=lambda x: isinstance(x, nn.Partitioned))
  for leaf in leaves:
    assert isinstance(leaf, nn.Partitioned), leaf
    assert len(leaf.names) == leaf.value.ndim
    if leaf.value.ndim >= 2:  # Every matrix has an axis to shard.
      assert any(name is not None for name in leaf.names), leaf.names


def test_scanned_parameters_have_a_layers_axis():
  config = TINY.replace(scan_layers=True)
  variables = jax.eval_shape(
      lambda: EncoderDecoder(config).init(KEY, INPUTS, TARGETS))
  spec = nn.get_partition_spec(variables['params'])
  kernel = spec['encoder']['layers']['self_attention']['query']['kernel']
  assert tuple(kernel) == ('layers', 'heads', 'kv', 'embed')


@pytest.mark.slow
def test_bfloat16_computes_in_bfloat16_with_float32_params_and_logits():
  model = EncoderDecoder(TINY.replace(dtype='bfloat16'))
  own = jax.eval_shape(lambda: model.init(KEY, INPUTS, TARGETS))
  assert all(p.dtype == jnp.float32
             for p in jax.tree.leaves(nn.unbox(own['params'])))
  params = init(EncoderDecoder(TINY), INPUTS, TARGETS)
  logits = model.apply({'params': params}, INPUTS, TARGETS)
  assert logits.dtype == jnp.float32
  full = EncoderDecoder(TINY).apply({'params': params}, INPUTS, TARGETS)
  assert not np.array_equal(logits, full)  # Really computed at lower precision.
  np.testing.assert_allclose(logits, full, atol=0.25)


@pytest.mark.slow
def test_dropout_changes_outputs_only_in_training():
  model = EncoderDecoder(TINY, deterministic=False)
  params = init(EncoderDecoder(TINY), INPUTS, TARGETS)
  eval_logits = EncoderDecoder(TINY).apply({'params': params}, INPUTS, TARGETS)
  a = model.apply({'params': params}, INPUTS, TARGETS,
                  rngs={'dropout': jax.random.PRNGKey(1)})
  b = model.apply({'params': params}, INPUTS, TARGETS,
                  rngs={'dropout': jax.random.PRNGKey(2)})
  assert not np.allclose(a, eval_logits, atol=1e-3)
  assert not np.allclose(a, b, atol=1e-3)
