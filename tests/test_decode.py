"""Greedy search and beam search against uncached references and
hand-built models (sampling and a language model's continuations:
test_generate.py)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.core import meta

from jaxformer.inference import beam_search, search
from jaxformer.model import EncoderDecoder, ModelConfig, cpu_kernels

TINY = ModelConfig(vocab_size=32, d_model=16, num_heads=2, d_ff=32,
                   num_encoder_layers=2, num_decoder_layers=2, max_len=32,
                   share_embeddings='none')
DECODE_LEN = 10


def random_params(model, *example_args, seed=0):
  """Random parameters of `model`, drawn by numpy at the scale of Flax's
  initialisers (compiling those takes longer than these tests): unit
  LayerNorm scales, kernels with variance 1 / fan-in, embeddings with
  variance 1 / d_model, small biases."""
  shapes = meta.unbox(jax.eval_shape(model.init, jax.random.PRNGKey(0),
                                     *example_args)['params'])
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    names = [str(getattr(key, 'key', key)) for key in path]
    if names[-1] == 'scale':
      return jnp.ones(leaf.shape, leaf.dtype)
    if names[-1] == 'kernel':  # Output-major: the input axes come last.
      fan_in = np.prod(leaf.shape[-2:] if names[-2] == 'out'
                       else leaf.shape[-1:])
      std = fan_in ** -0.5
    elif names[-1] == 'embedding':
      std = leaf.shape[-1] ** -0.5
    else:
      std = 0.1
    return jnp.asarray(rng.normal(0.0, std, leaf.shape), leaf.dtype)
  return jax.tree_util.tree_map_with_path(draw, shapes)


def random_sources(batch, length, seed=0, vocab=TINY.vocab_size):
  """[batch, length] tokens in [2, vocab), each row right-padded to a random
  length >= 2."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, vocab, (batch, length))
  lengths = rng.integers(2, length + 1, (batch, 1))
  return np.where(np.arange(length) < lengths, tokens, 0).astype(np.int32)


@functools.lru_cache(maxsize=None)
def translation_model(scan_layers=False, eos_bias=0.0,
                      share_embeddings='none', seed=0):
  """(config, params) of a random tiny EncoderDecoder; `eos_bias` is added
  to the output bias of EOS (untied output layer only), so that hypotheses
  end within a few steps."""
  config = TINY.replace(scan_layers=scan_layers,
                        share_embeddings=share_embeddings)
  dummy = jnp.ones((1, 4), jnp.int32)
  params = random_params(EncoderDecoder(config), dummy, dummy, seed=seed)
  if eos_bias:
    bias = params['decoder']['logits']['bias']
    params['decoder']['logits']['bias'] = bias.at[search.EOS_ID].add(eos_bias)
  return config, params


@functools.lru_cache(maxsize=None)
def full_forward(model):
  """The jitted teacher-forced forward pass (no cache): logits[:, t] given
  targets[:, :t], every position a real one (segment id 1)."""
  return jax.jit(lambda params, *inputs_and_targets: model.apply(
      {'params': params}, *inputs_and_targets,
      targets_segment_ids=jnp.ones_like(inputs_and_targets[-1])))


def uncached_greedy(config, params, inputs, max_decode_len, eos_id):
  """Greedy decoding by re-running the full forward pass on the growing
  prefix: token t is the argmax of logits[:, t] given tokens[:, :t]."""
  forward = full_forward(EncoderDecoder(config))
  tokens = np.zeros((inputs.shape[0], max_decode_len), np.int32)
  finished = ~np.any(inputs != 0, axis=-1)
  for t in range(max_decode_len):
    next_tokens = np.argmax(forward(params, inputs, tokens)[:, t], axis=-1)
    tokens[:, t] = np.where(finished, 0, next_tokens)
    finished |= tokens[:, t] == eos_id
  return tokens


def assert_zero_after_eos(tokens, eos_id):
  """tokens: [..., length]; everything after the first EOS is padding."""
  tokens = np.asarray(tokens).reshape(-1, tokens.shape[-1])
  for row in tokens:
    ends = np.flatnonzero(row == eos_id)
    if ends.size:
      np.testing.assert_array_equal(row[ends[0] + 1:], 0)


def mid_sentence_eos(tokens, start=2):
  """An EOS id that ends some row of `tokens` ([batch, length], decoded
  without EOS) at or after position `start`: the first token there that the
  row has not produced before. Random tiny models rarely pick EOS=1 on their
  own; `eos_id` is an argument, so any token can play its part."""
  for row in np.asarray(tokens):
    for t in range(start, len(row) - 1):
      if row[t] > 1 and row[t] not in row[:t]:
        return int(row[t])
  raise AssertionError(f'no token to end a row with in {tokens}')


# Tied embeddings: on CPU greedy search picks tokens with screened_argmax.
# (Tiny tied models tend to repeat one token; seed 5 changes its mind.)
@pytest.mark.slow
@pytest.mark.parametrize('scan_layers, share_embeddings, seed', [
    (False, 'none', 0), (True, 'none', 0), (False, 'all', 5)])
def test_greedy_equals_uncached_argmax_and_stops_at_eos(scan_layers,
                                                        share_embeddings,
                                                        seed):
  config, params = translation_model(
      scan_layers, share_embeddings=share_embeddings, seed=seed)
  inputs = random_sources(4, 7)
  eos_id = mid_sentence_eos(
      uncached_greedy(config, params, inputs, DECODE_LEN, eos_id=-1))
  expected = uncached_greedy(config, params, inputs, DECODE_LEN, eos_id)
  tokens = search.greedy_decode(params, config, inputs,
                                max_decode_len=DECODE_LEN, eos_id=eos_id)
  np.testing.assert_array_equal(tokens, expected)
  assert np.any(expected[:, -1] == 0)  # A row stopped early,
  assert_zero_after_eos(tokens, eos_id)  # with zeros after its EOS.


def test_max_decode_length_counts_longest_real_source():
  inputs = np.array([[5, 6, 7, 0, 0], [5, 0, 0, 0, 0]])
  assert search.max_decode_length(inputs) == 53
  assert search.max_decode_length(inputs, extra=2) == 5
  assert search.max_decode_length(inputs, max_len=20) == 20
  with pytest.raises(ValueError):
    search.greedy_decode({}, TINY, inputs, max_decode_len=TINY.max_len + 1)


@pytest.mark.slow
def test_beam_size_one_equals_greedy():
  # A single beam ends only when its best extension is EOS, as greedy search
  # does, and with alpha=0 no longer hypothesis can beat it after that.
  config, params = translation_model(scan_layers=True)
  inputs = random_sources(4, 7, seed=1)
  run_search = functools.partial(search.greedy_decode, params, config, inputs,
                             max_decode_len=DECODE_LEN)
  eos_id = mid_sentence_eos(run_search(eos_id=-1))
  tokens, scores = beam_search.beam_search(
      params, config, inputs, beam_size=1, alpha=0.0,
      max_decode_len=DECODE_LEN, eos_id=eos_id)
  np.testing.assert_array_equal(tokens[:, 0], run_search(eos_id=eos_id))
  assert np.all(np.isfinite(scores))


# The trap: a real one-layer model whose next-token distribution depends only
# on the previous token, P(next | previous) = TRAP_PROBS[previous]. Greedy
# takes A (0.5) and then EOS (0.3): p = 0.15; B (0.4) then EOS (0.93) has
# p = 0.372. Tokens: 0 start, 1 EOS, 2 A, 3 B, 4-7 fillers.
A, B = 2, 3
TRAP_PROBS = np.full((8, 8), 0.01)
TRAP_PROBS[:, 1] = 0.93
TRAP_PROBS[0] = [0.1 / 6, 0.1 / 6, 0.5, 0.4] + [0.1 / 6] * 4
TRAP_PROBS[A] = [0.1, 0.3] + [0.1] * 6


@functools.lru_cache(maxsize=None)
def trap_model():
  """Every sublayer's output projection is zero and LayerNorms are plain, so
  the decoder state is LayerNorm(target embedding of the previous token)
  (positions are learned and zero). With one-hot embeddings that is
  a * onehot - a / d, so a logits kernel W = log(TRAP_PROBS) / a with bias
  a / d * (column sums of W) gives logits log(TRAP_PROBS[previous])."""
  vocab = d_model = 8
  config = ModelConfig(vocab_size=vocab, d_model=d_model, num_heads=2, d_ff=8,
                       num_encoder_layers=1, num_decoder_layers=1, max_len=16,
                       share_embeddings='none', position_embedding='learned')
  dummy = jnp.ones((1, 3), jnp.int32)
  params = random_params(EncoderDecoder(config), dummy, dummy)
  decoder = params['decoder']
  layer = decoder['layer_0']
  for norm in ('self_attention_norm', 'cross_attention_norm', 'ffn_norm'):
    layer[norm] = {'scale': jnp.ones(d_model), 'bias': jnp.zeros(d_model)}
  for sublayer in (layer['self_attention']['out'],
                   layer['cross_attention']['out'], layer['ffn']['wo']):
    sublayer['kernel'] = jnp.zeros_like(sublayer['kernel'])
    sublayer['bias'] = jnp.zeros_like(sublayer['bias'])
  decoder['positions']['position_embedding'] *= 0.0
  params['target_embed']['embedding'] = jnp.eye(vocab)
  scale = 1.0 / np.sqrt(1.0 / d_model - 1.0 / d_model ** 2)  # 1 / std(onehot)
  kernel = np.log(TRAP_PROBS) / scale
  decoder['logits'] = {'kernel': jnp.asarray(kernel.T, jnp.float32),
                       'bias': jnp.asarray(scale / d_model * kernel.sum(0),
                                           jnp.float32)}
  return config, params


@pytest.mark.slow
def test_beam_search_finds_what_greedy_misses():
  config, params = trap_model()
  inputs = np.array([[4, 5, 6]])
  greedy = search.greedy_decode(params, config, inputs, max_decode_len=6)
  np.testing.assert_array_equal(greedy, [[A, 1, 0, 0, 0, 0]])
  tokens, scores = beam_search.beam_search(params, config, inputs,
                                           beam_size=2, alpha=0.6,
                                           max_decode_len=6)
  np.testing.assert_array_equal(tokens[0], [[B, 1, 0, 0, 0, 0],
                                            [A, 1, 0, 0, 0, 0]])
  # The scores also check the construction: log p / length_penalty(2).
  penalty = beam_search.length_penalty(2, 0.6)
  np.testing.assert_allclose(
      scores[0], np.log([0.4 * 0.93, 0.5 * 0.3]) / penalty, rtol=1e-4)


def teacher_forced_logprob(config, params, inputs, tokens, eos_id):
  """log p(tokens | inputs) under the full (uncached) forward pass, summed up
  to and including each row's first EOS (all positions if it has none).
  inputs: [batch, s]; tokens: [batch, length] -> ([batch] log p, [batch]
  hypothesis lengths counting EOS)."""
  logits = full_forward(EncoderDecoder(config))(params, inputs, tokens)
  log_probs = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
  picked = np.take_along_axis(log_probs, tokens[..., None], -1)[..., 0]
  is_eos = tokens == eos_id
  lengths = np.where(is_eos.any(-1), is_eos.argmax(-1) + 1, tokens.shape[-1])
  within = np.arange(tokens.shape[-1]) < lengths[:, None]
  return np.where(within, picked, 0.0).sum(-1), lengths


@pytest.mark.slow
@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.2])
def test_beam_scores_are_rescored_log_probabilities(alpha):
  # Each returned hypothesis, rescored by the teacher-forced forward pass and
  # divided by its length penalty, has the score beam search reports; the
  # hypotheses are distinct and ranked best first, so none scores higher
  # than one returned before it.
  config, params = translation_model(eos_bias=2.0)
  inputs = random_sources(3, 7, seed=4)
  beam = 4
  tokens, scores = beam_search.beam_search(
      params, config, inputs, beam_size=beam, alpha=alpha,
      max_decode_len=DECODE_LEN)
  tokens, scores = np.asarray(tokens), np.asarray(scores)
  rows = tokens.reshape(-1, DECODE_LEN)
  logprob, lengths = teacher_forced_logprob(
      config, params, np.repeat(inputs, beam, axis=0), rows, search.EOS_ID)
  rescored = (logprob / beam_search.length_penalty(lengths, alpha)).reshape(
      scores.shape)
  np.testing.assert_allclose(scores, rescored, rtol=2e-5, atol=2e-5)
  assert np.all(np.diff(scores, axis=-1) <= 0)
  for sentence in tokens:
    assert len({tuple(row) for row in sentence}) == beam
  assert np.any(lengths < DECODE_LEN)  # Some hypotheses ended with EOS.


@pytest.mark.slow
def test_early_exit_does_not_change_results():
  config, params = translation_model(scan_layers=True, eos_bias=3.0)
  inputs = random_sources(4, 7, seed=2)
  run_search = functools.partial(beam_search.beam_search, params, config,
                                 inputs, beam_size=3,
                                 max_decode_len=DECODE_LEN, return_steps=True)
  tokens, scores, steps = run_search(early_exit=True)
  full_tokens, full_scores, full_steps = run_search(early_exit=False)
  np.testing.assert_array_equal(tokens, full_tokens)
  np.testing.assert_allclose(scores, full_scores, rtol=1e-6)
  assert np.all(np.diff(scores, axis=-1) <= 0)  # Best first.
  assert_zero_after_eos(tokens, eos_id=1)
  assert np.all(np.any(tokens == 1, axis=-1))  # All beams ended,
  assert steps < full_steps == DECODE_LEN  # and the search stopped early.


@pytest.mark.slow
def test_results_do_not_depend_on_the_rest_of_the_batch():
  config, params = translation_model(scan_layers=True)
  sentence = np.array([[5, 9, 14, 3, 30]], np.int32)
  # Other sentences, an all-padding row and a wider source.
  batch = random_sources(4, 7, seed=3)
  batch[1] = 0
  batch[2] = 0
  batch[2, :5] = sentence[0]
  greedy = functools.partial(search.greedy_decode, params, config,
                             max_decode_len=DECODE_LEN)
  beam = functools.partial(beam_search.beam_search, params, config,
                           beam_size=3, max_decode_len=DECODE_LEN)
  # The sentence ends mid-way, so it is done while its neighbours go on.
  eos_id = mid_sentence_eos(greedy(sentence, eos_id=-1))

  alone = greedy(sentence, eos_id=eos_id)
  together = greedy(batch, eos_id=eos_id)
  assert alone[0, -1] == 0
  np.testing.assert_array_equal(together[2], alone[0])
  np.testing.assert_array_equal(together[1], 0)

  alone_tokens, alone_scores = beam(sentence, eos_id=eos_id)
  batch_tokens, batch_scores = beam(batch, eos_id=eos_id)
  np.testing.assert_array_equal(batch_tokens[2], alone_tokens[0])
  np.testing.assert_allclose(batch_scores[2], alone_scores[0], rtol=1e-5)
  np.testing.assert_array_equal(batch_tokens[1], 0)


@pytest.mark.slow
@pytest.mark.parametrize('parts', [2, 3])
def test_searching_in_parts_changes_no_result(parts):
  # 5 sentences, one all padding; the last part is filled up with padding.
  config, params = translation_model(scan_layers=True, eos_bias=3.0)
  inputs = random_sources(5, 7, seed=2)
  inputs[3] = 0
  greedy = functools.partial(search.greedy_decode, params, config, inputs,
                             max_decode_len=DECODE_LEN, return_attention=True)
  tokens, weights = greedy(batch_parts=1)
  parts_tokens, parts_weights = greedy(batch_parts=parts)
  np.testing.assert_array_equal(parts_tokens, tokens)
  np.testing.assert_allclose(parts_weights, weights, atol=1e-6)

  beam = functools.partial(beam_search.beam_search, params, config, inputs,
                           beam_size=3, max_decode_len=DECODE_LEN,
                           return_steps=True)
  tokens, scores, steps = beam(batch_parts=1)
  parts_tokens, parts_scores, parts_steps = beam(batch_parts=parts)
  np.testing.assert_array_equal(parts_tokens, tokens)
  np.testing.assert_allclose(parts_scores, scores, rtol=1e-5)
  assert parts_steps == steps < DECODE_LEN  # The largest part's count.


@pytest.mark.slow
def test_default_batch_parts_is_one_with_several_devices_or_under_jit():
  config, params = translation_model()
  inputs = jnp.asarray(random_sources(3, 7))
  if jax.device_count() > 1:  # As the suite runs: 8 CPU devices.
    assert cpu_kernels.default_batch_parts(inputs) == 1

  greedy = functools.partial(search.greedy_decode, params, config,
                             max_decode_len=DECODE_LEN)
  parts_under_jit = []

  def traced(inputs):
    parts_under_jit.append(cpu_kernels.default_batch_parts(inputs))
    return greedy(inputs)
  np.testing.assert_array_equal(jax.jit(traced)(inputs), greedy(inputs))
  assert parts_under_jit == [1]


@pytest.mark.slow
def test_greedy_returns_cross_attention_weights():
  config, params = translation_model()
  inputs = random_sources(4, 7)
  run_search = functools.partial(search.greedy_decode, params, config, inputs,
                             max_decode_len=DECODE_LEN, return_attention=True)
  eos_id = mid_sentence_eos(run_search(eos_id=-1)[0])
  tokens, weights = run_search(eos_id=eos_id)
  assert weights.shape == (4, config.num_decoder_layers, config.num_heads,
                           DECODE_LEN, 7)
  ends = np.asarray(tokens) == eos_id
  decoded = np.cumsum(ends, axis=-1) - ends == 0  # Steps up to EOS.
  assert not np.all(decoded)
  # Each decoded step's weights are a distribution over the real source
  # tokens; later steps have none.
  row_sums = np.asarray(weights).sum(-1)
  np.testing.assert_allclose(row_sums, np.broadcast_to(
      decoded[:, None, None, :], row_sums.shape), atol=1e-5)
  source_padding = np.broadcast_to((inputs == 0)[:, None, None, None, :],
                                   weights.shape)
  np.testing.assert_array_equal(np.asarray(weights)[source_padding], 0.0)


@pytest.mark.slow
def test_fsdp_parameters_are_gathered_once_not_at_every_token():
  """Decoding with FSDP-sharded parameters communicates inside the token
  loop; `mesh_lib.gathered` (what `evaluate.decode_split` does first)
  leaves the compiled search without any collective."""
  from flax import linen as nn
  from jaxformer.parallel import mesh as mesh_lib
  config, params = translation_model()
  dummy = jnp.ones((1, 4), jnp.int32)
  logical = nn.get_partition_spec(jax.eval_shape(
      EncoderDecoder(config).init, jax.random.PRNGKey(0), dummy, dummy)
                                  )['params']
  mesh = mesh_lib.make_mesh({'fsdp': 4}, jax.devices()[:4])
  sharded = jax.device_put(params, mesh_lib.logical_shardings(
      logical, mesh, mesh_lib.DEFAULT_AXIS_RULES))
  inputs = random_sources(4, 6)

  def loop_gathers(params):
    """Collectives in the compiled search (XLA's CPU partitioner computes
    on the parameter shards and all-reduces the products, token by token)."""
    hlo = search._greedy_decode.lower(
        params, inputs, -jnp.ones(inputs.shape[:1], jnp.int32), config,
        DECODE_LEN, search.EOS_ID, False
        ).compile().as_text()
    return sum(hlo.count(f' {op}(') + hlo.count(f' {op}-start(') for op in (
        'all-gather', 'all-reduce', 'reduce-scatter', 'collective-permute',
        'all-to-all'))

  assert any('fsdp' in str(x.sharding.spec) for x in jax.tree.leaves(sharded))
  gathered = mesh_lib.gathered(sharded)
  assert not any('fsdp' in str(x.sharding.spec)
                 for x in jax.tree.leaves(gathered))
  assert loop_gathers(sharded) > 0
  assert loop_gathers(gathered) == 0
  np.testing.assert_array_equal(
      search.greedy_decode(gathered, config, inputs,
                           max_decode_len=DECODE_LEN, batch_parts=1),
      search.greedy_decode(params, config, inputs,
                           max_decode_len=DECODE_LEN, batch_parts=1))
