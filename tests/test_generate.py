"""Continuations of prompts from a decoder-only model (`jaxformer generate`):
the prefill of a batch of prompts and the steps after it give the logits of
the step-by-step path and of a full forward pass, batches of prompts of
different lengths give each prompt's tokens alone, greedy ids equal an
uncached full forward pass, rows end at any of several
EOS ids or after max_new_tokens, samples are reproducible by seed, and the
command prints one JSON object per prompt, in order."""
import base64
import functools
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from test_decode import random_params

from jaxformer.checkpoints import exports
from jaxformer.cli import main as cli
from jaxformer.config.settings import default_config
from jaxformer.data import builtin
from jaxformer.data.tokenizer import train_tokenizer
from jaxformer.inference import generation
from jaxformer.model import DecoderLM, ModelConfig, incremental
from jaxformer.model.config import to_config_dict

PAPER = ModelConfig(vocab_size=32, d_model=16, num_heads=2, d_ff=32,
                    num_decoder_layers=2, max_len=32, share_embeddings='none')
MODERN = PAPER.replace(
    num_heads=4, num_kv_heads=2, position_embedding='rope', norm_type='rms',
    norm_position='pre', activation='swiglu', use_bias=False,
    logits_bias=False)
CONFIGS = {'modern': MODERN, 'paper': PAPER,
           'learned': PAPER.replace(position_embedding='learned')}
# Seeds whose random models do not repeat one token.
SEEDS = {'modern': 2, 'paper': 1, 'learned': 3}
# The model's inputs: decoder_start_id 0, then the prompt's tokens.
PROMPTS = [[0, 5, 9, 4], [0], [0, 7, 3, 3, 8, 12, 30, 2], [0, 11, 6]]
NEW = 8


@functools.lru_cache(maxsize=None)
def model(name):
  config = CONFIGS[name]
  return config, random_params(DecoderLM(config), jnp.ones((1, 4), jnp.int32),
                               seed=SEEDS[name])


@functools.lru_cache(maxsize=None)
def forward(config):
  """The jitted uncached forward pass: logits [b, t, v] of inputs [b, t]
  from position 0, every position a real one."""
  def logits(params, inputs):
    ones = jnp.ones_like(inputs)
    return DecoderLM(config).apply(
        {'params': params}, inputs, ones, jnp.cumsum(ones, axis=1) - 1,
        method='decode_logits')
  return jax.jit(logits)


def uncached_greedy(config, params, prompt, new_tokens, eos_ids=()):
  """The argmax of the full forward pass on the growing sequence."""
  sequence, new = list(prompt), []
  while len(new) < min(new_tokens, config.max_len - len(prompt) + 1):
    inputs = np.zeros((1, config.max_len), np.int32)
    inputs[0, :len(sequence)] = sequence
    token = int(np.argmax(forward(config)(params, inputs)[0, len(sequence) - 1]))
    new.append(token)
    sequence.append(token)
    if token in eos_ids:
      break
  return new


@functools.lru_cache(maxsize=None)
def jitted_step(config, params_id, rows_mode):
  """lm_step_fn's step, jitted: params, and start positions with
  `rows_mode`, are its first arguments."""
  del params_id  # Part of the cache key only.
  def step(params, starts, cache, tokens, step):
    return incremental.lm_step_fn(config, params,
                                  starts if rows_mode else None)(
                                      cache, tokens, step)[:2]
  return jax.jit(step)


def prefilled_logits(config, params, sequences, lengths, steps):
  """Logits [b, steps, v] after each row's positions lengths - 1 + k: the
  rows' first lengths - 1 tokens read by one prefill call (with the later
  tokens of the longer rows as padding), then one step per position."""
  rows, total = sequences.shape
  width = int(max(lengths)) - 1
  cache = incremental.init_lm_cache(config, params, rows, total)
  cache = jax.jit(incremental.lm_prefill, static_argnums=0)(
      config, params, cache, jnp.asarray(sequences[:, :width]))
  step = jitted_step(config, id(params), True)
  logits = []
  for k in range(steps):
    out, cache = step(params, jnp.asarray(lengths - 1), cache,
                      jnp.asarray(sequences[np.arange(rows), lengths - 1 + k]),
                      k)
    logits.append(out)
  return np.stack(logits, axis=1)


def step_by_step_logits(config, params, sequences):
  """Logits [b, t, v] of the one-token-per-step path from position 0."""
  cache = incremental.init_lm_cache(config, params, *sequences.shape)
  step = jitted_step(config, id(params), False)
  logits = []
  for s in range(sequences.shape[1]):
    out, cache = step(params, None, cache, jnp.asarray(sequences[:, s]), s)
    logits.append(out)
  return np.stack(logits, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_prefill_and_steps_equal_step_by_step_and_full_forward_logits(name):
  config, params = model(name)
  steps = 3
  lengths = np.array([len(p) for p in PROMPTS if len(p) > 1])
  sequences = np.zeros((len(lengths), max(lengths) + steps), np.int32)
  rng = np.random.default_rng(0)
  for row, prompt in zip(sequences, [p for p in PROMPTS if len(p) > 1]):
    row[:] = rng.integers(1, config.vocab_size, row.shape)
    row[:len(prompt)] = prompt
  at = lengths[:, None] - 1 + np.arange(steps)  # [b, steps] positions.
  rows = np.arange(len(lengths))[:, None]
  ours = prefilled_logits(config, params, sequences, lengths, steps)
  full = np.asarray(forward(config)(params, sequences))[rows, at]
  old = step_by_step_logits(config, params, sequences)[rows, at]
  np.testing.assert_allclose(ours, full, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ours, old, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(CONFIGS))
def test_batched_prompts_equal_one_at_a_time_and_uncached_greedy(name):
  config, params = model(name)
  batched = generation.generate_ids(params, config, PROMPTS,
                                    max_new_tokens=NEW, eos_ids=())
  alone = [generation.generate_ids(params, config, [p], max_new_tokens=NEW,
                                   eos_ids=())[0] for p in PROMPTS]
  assert batched == alone
  assert batched == [uncached_greedy(config, params, p, NEW) for p in PROMPTS]
  assert all(len(ids) == NEW for ids in batched)


def first_new(ids, skip):
  """The first of `ids` not in `skip` and not earlier in `ids`."""
  return next(t for i, t in enumerate(ids) if t not in skip
              and t not in ids[:i])


@pytest.mark.slow
def test_rows_end_at_any_of_several_eos_ids_each_on_its_own():
  config, params = model('modern')
  free = generation.generate_ids(params, config, PROMPTS, max_new_tokens=NEW,
                                 eos_ids=())
  eos_ids = [first_new(free[0][1:], free[0][:1])]
  eos_ids.append(first_new(free[2][1:], free[2][:1] + eos_ids))
  ended = generation.generate_ids(params, config, PROMPTS,
                                  max_new_tokens=NEW, eos_ids=eos_ids)
  expected = [generation.until_end(ids, eos_ids) for ids in free]
  assert ended == expected
  assert ended == [uncached_greedy(config, params, p, NEW, eos_ids)
                   for p in PROMPTS]
  assert all(ended[i][-1] in eos_ids and len(ended[i]) < NEW for i in (0, 2))
  assert len(set(map(len, ended))) > 1  # Each row ends at its own step.


@pytest.mark.slow
def test_new_tokens_are_bounded_by_max_new_tokens_and_positions():
  config, params = model('modern')
  ids = functools.partial(generation.generate_ids, params, config,
                          eos_ids=())
  assert [len(r) for r in ids(PROMPTS, max_new_tokens=3)] == [3] * 4
  near_end = [0] + [5] * (config.max_len - 3)  # Positions for 3 more.
  assert [len(r) for r in ids([near_end, [0, 5]], max_new_tokens=None)] == [
      3, config.max_len - 1]
  assert [len(r) for r in ids([[0, 5, 9]], max_positions=10)] == [8]
  assert ids([[], [0]], max_new_tokens=2)[0] == []  # No input, no output.
  with pytest.raises(ValueError, match='exceeds the 10 positions'):
    ids([[0] * 11], max_positions=10)


# ---------------------------------------------------------------- sampling ---

def test_top_k_filter_keeps_the_k_largest():
  logits = jnp.array([[1.0, 3.0, 2.0, 0.0]])
  np.testing.assert_array_equal(generation.top_k_filter(logits, 2),
                                [[-np.inf, 3.0, 2.0, -np.inf]])
  np.testing.assert_array_equal(generation.top_k_filter(logits, 0), logits)


@pytest.mark.parametrize('p, kept', [
    (0.3, {0}), (0.75, {0, 2}), (0.85, {0, 1, 2}), (0.99, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3})])
def test_top_p_filter_keeps_smallest_set_reaching_p(p, kept):
  probs = np.array([0.5, 0.15, 0.3, 0.05])
  filtered = generation.top_p_filter(jnp.log(jnp.array([probs])), p)
  assert set(np.flatnonzero(np.isfinite(filtered[0]))) == kept


def test_sample_choice_draws_only_allowed_tokens():
  logits = jnp.log(jnp.array([[0.5, 0.15, 0.3, 0.05]] * 2000))
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  choose = functools.partial(jax.jit(generation.sample_choice), logits, keys)
  assert set(np.unique(choose(1.0, 0, 0.75))) == {0, 2}  # Nucleus.
  assert set(np.unique(choose(5.0, 1, 1.0))) == {0}  # Top one.
  assert set(np.unique(choose(0.0, 0, 1.0))) == {0}  # Argmax.
  assert set(np.unique(choose(100.0, 0, 1.0))) == {0, 1, 2, 3}  # Flat.


def test_greedy_takes_the_lowest_id_of_tied_maxima():
  logits = jnp.array([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
  keys = jax.random.split(jax.random.PRNGKey(0), 2)
  np.testing.assert_array_equal(
      generation.sample_choice(logits, keys, 0.0, 0, 1.0), [1, 0])


@pytest.mark.slow
def test_samples_are_reproducible_by_seed_and_independent_of_the_batch():
  config, params = model('modern')
  sample = functools.partial(generation.generate_ids, params, config,
                             max_new_tokens=NEW, eos_ids=(), temperature=1.0,
                             top_k=3)
  drawn = sample(PROMPTS, seed=0)
  assert sample(PROMPTS, seed=0) == drawn
  assert sample(PROMPTS, seed=1) != drawn
  assert [sample([p], seed=0, first_row=i)[0]
          for i, p in enumerate(PROMPTS)] == drawn
  # Each drawn token is one of the 3 most likely at its position.
  for prompt, new in zip(PROMPTS, drawn):
    sequence = np.array([prompt + new], np.int32)
    logits = np.asarray(forward(config)(params, sequence))[0]
    for t, token in enumerate(new, start=len(prompt) - 1):
      assert np.sum(logits[t] > logits[t, token]) < 3


@pytest.mark.slow
def test_top_one_sampling_is_greedy():
  config, params = model('modern')
  run = functools.partial(generation.generate_ids, params, config, PROMPTS,
                          max_new_tokens=NEW, eos_ids=())
  assert run(temperature=1.0, top_k=1, seed=5) == run(temperature=0.0)


# ----------------------------------------------------------- the command ---

VOCAB = 100


def random_lm_export(root):
  """(export directory, tokenizer, config, params) of a random language
  model whose vocabulary is a SentencePiece model trained here: the
  conftest's `lm_export`, which the modules that generate share."""
  texts = [text for pair in builtin.generate(300, 0, 'train') for text in pair]
  tok = train_tokenizer(texts, str(root / 'tok'), ml_collections.ConfigDict(
      dict(type='unigram', vocab_size=VOCAB, character_coverage=1.0)))
  config = MODERN.replace(vocab_size=VOCAB, max_len=24)
  params = random_params(DecoderLM(config), jnp.ones((1, 4), jnp.int32))
  run = default_config()
  run.task = 'language_model'
  run.model = to_config_dict(config)
  run.data.tokenizer.vocab_size = VOCAB
  run.data.max_target_length = 24
  path = str(root / 'export')
  exports.export_params(path, params, {
      'config': run.to_dict(), 'steps': [0],
      'tokenizers': [base64.b64encode(tok.serialized_model_proto()).decode()]})
  return path, tok, config, params


def run_cli(capfd, *args):
  capfd.readouterr()
  status = cli.main(['generate', *args])
  out, err = capfd.readouterr()
  return status, out, err


@pytest.mark.slow
def test_jsonl_prints_one_object_per_prompt_in_order(lm_export, tmp_path,
                                                     capfd):
  path, tok, config, params = lm_export
  prompts = ['she bought forty-two', '', 'yesterday he sold three red cups',
             'the old']
  (tmp_path / 'prompts.txt').write_text('\n'.join(prompts) + '\n')
  status, out, err = run_cli(
      capfd, '--workdir', path, '--input', str(tmp_path / 'prompts.txt'),
      '--temperature', '0', '--max-new-tokens', '5', '--jsonl',
      '--batch-size', '3')
  assert status == 0, err
  records = [json.loads(line) for line in out.splitlines()]
  assert [r['prompt'] for r in records] == prompts
  assert all(set(r) == {'prompt', 'ids', 'text'} for r in records)
  inputs = [[0] + ids[:-1] for ids in tok.encode(prompts)]  # Start, no EOS.
  assert [r['ids'] for r in records] == [
      uncached_greedy(config, params, p, 5, (1,)) for p in inputs]
  assert [r['text'] for r in records] == [tok.decode(r['ids'])
                                          for r in records]
  assert all(0 < len(r['ids']) <= 5 for r in records)


@pytest.mark.slow
def test_prompt_and_num_print_the_prompt_with_its_continuation(lm_export,
                                                               capfd):
  status, out, err = run_cli(capfd, '--workdir', lm_export[0], '--prompt',
                             'yesterday she', '--num', '2', '--temperature',
                             '0', '--max-len', '12')
  assert status == 0, err
  lines = out.splitlines()
  assert len(lines) == 2 and lines[0] == lines[1]
  assert lines[0].startswith('yesterday she')


@pytest.mark.slow
def test_a_prompt_too_long_is_cut_with_a_warning_or_refused(lm_export,
                                                            tmp_path, capfd):
  path, _, _, _ = lm_export
  long_prompt = ' '.join(['she bought forty-two red apples'] * 8)
  (tmp_path / 'long.txt').write_text(f'the old\n{long_prompt}\n')
  common = ['--workdir', path, '--input', str(tmp_path / 'long.txt'),
            '--temperature', '0', '--jsonl']
  status, out, err = run_cli(capfd, *common)
  assert status == 0
  assert 'warning: prompt 2 has' in err and 'cut to its first 24' in err
  records = [json.loads(line) for line in out.splitlines()]
  assert len(records) == 2 and len(records[1]['ids']) == 1  # No room left.
  status, out, err = run_cli(capfd, *common, '--on-too-long', 'error')
  assert status == 1 and out.count('\n') <= 1
  assert err.count('\n') == 1 and 'Prompt 2 has' in err


def test_prompt_and_input_together_are_refused(lm_export, tmp_path, capfd):
  (tmp_path / 'p.txt').write_text('the\n')
  status, _, err = run_cli(capfd, '--workdir', lm_export[0], '--prompt', 'a',
                           '--input', str(tmp_path / 'p.txt'))
  assert status == 1 and '--prompt and --input' in err
