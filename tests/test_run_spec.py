"""One assembly of a run: `jaxformer train` and `jaxformer compile` build
the same `RunSpec` from a config (vocabulary, model, state layout, batch
shapes, data order); and the bookkeeping of the loop's steps."""
import pathlib

import jax
import ml_collections
import numpy as np
import pytest

from jaxformer.aot import programs
from jaxformer.config.settings import load_config
from jaxformer.run import log_window
from jaxformer.run.trainer import Trainer
from jaxformer.train import run_spec

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py') + ':runlocal'


@pytest.fixture(scope='module')
def trainer(tmp_path_factory):
  """A run set up as `jaxformer train` sets it up (its tokenizer trained to
  data.tokenizer.vocab_size pieces); nothing is trained."""
  result = Trainer(load_config(CONFIG), str(tmp_path_factory.mktemp('run')))
  yield result
  result.checkpoints.close()


def leaves(tree) -> list:
  return [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def test_train_and_compile_build_the_same_run(trainer):
  compiled = programs.compiled_run(load_config(CONFIG), jax.devices())
  assert compiled.config.to_dict() == trainer.config.to_dict()
  assert compiled.model_config == trainer.model_config
  assert compiled.task is trainer.task
  assert compiled.mesh == trainer.mesh
  (abstract, shardings), (ours, our_shardings) = (compiled.state_layout,
                                                  trainer.spec.state_layout)
  assert jax.tree.structure(abstract) == jax.tree.structure(ours)
  assert leaves(abstract) == leaves(ours)
  assert jax.tree.leaves(shardings) == jax.tree.leaves(our_shardings)
  [plan] = programs.rehearse_hosts(compiled)
  assert plan.train_shapes == trainer.plan.train_shapes == ((16, 40, 40),)
  assert plan.data_order == trainer.plan.data_order
  assert [p.name for p in programs.build_programs(compiled)] == [
      'train 16x(40+40)', 'eval 16x(40+40)', 'decode beam 4 104x40->56']


def test_a_new_step_count_moves_the_schedule_and_nothing_else():
  config = load_config(CONFIG, ['train.schedule=warmup_cosine',
                                'train.num_steps=100'])
  run = programs.compiled_run(config, jax.devices())
  longer = run.with_num_steps(200)
  assert (run.config.train.num_steps, longer.config.train.num_steps) == (
      100, 200)
  assert longer.model_config is run.model_config and longer.mesh is run.mesh
  assert float(longer.schedule(99)) > float(run.schedule(99)) > 0
  assert leaves(longer.state_layout[0]) == leaves(run.state_layout[0])


def test_a_saved_config_is_taken_as_it_is(trainer):
  """Commands build the run of a checkpoint's config: its vocabulary stays."""
  saved = ml_collections.ConfigDict(trainer.config.to_dict())
  saved.model.vocab_size = 300  # Unlike data.tokenizer.vocab_size.
  run = run_spec.RunSpec.build(saved, trainer.mesh)
  assert run.model_config.vocab_size == 300
  assert any(300 in x.shape for x in jax.tree.leaves(run.abstract_params()))


def metrics(loss: float, finite: float = 1.0) -> dict:
  """A train step's metrics as the step returns them (scalars and not)."""
  return {'loss': np.float32(loss), 'grad_norm': np.float32(2.0),
          'finite': np.float32(finite), 'per_layer': np.zeros(3)}


def test_a_window_keeps_one_step_in_flight_and_sums_up():
  window = log_window.Window('skip')
  for step, loss in enumerate([3.0, 2.0, 1.0], 1):
    window.add(step, metrics(loss, finite=float(step != 2)), tokens=10,
               flops=1e6)
    # Each step fetches the one before: one step runs ahead.
    assert [s for s, _ in window.records] == list(range(1, step))
  summary = window.summary(peak_flops=1e9)
  assert [s for s, _ in window.records] == [1, 2, 3]
  assert summary['loss'] == 1.0 and summary['skipped_steps'] == 1.0
  assert 'per_layer' not in summary
  assert summary['tokens_per_second'] > 0 and 0 < summary['mfu']
  assert summary['step_time'] > 0


def test_a_non_finite_step_stops_naming_the_last_good_checkpoint():
  window = log_window.Window('stop', last_good=lambda: 'step 4 in /w/c')
  window.add(5, metrics(float('nan'), finite=0.0), 1, 1.0)  # In flight.
  with pytest.raises(log_window.NonFiniteLossError,
                     match='at step 5 .*checkpoint is step 4 in /w/c;'):
    window.add(6, metrics(1.0), 1, 1.0)


def test_real_tokens_count_segments_not_token_ids():
  """Token 0 may be real (Marian's EOS): segment ids say what is padding."""
  local = {'inputs': np.array([[5, 0, 0]]),
           'inputs_segment_ids': np.array([[1, 1, 0]]),
           'targets': np.array([[7, 3, 0]])}
  assert log_window.real_tokens(local) == 2 + 2


class _Vocabulary:
  def __init__(self, vocab_size):
    self.vocab_size, self.pad_id, self.eos_id = vocab_size, 0, 1


@pytest.mark.parametrize('pretrained, tokenizer, model', [
    ('', 409, 409),           # A fresh model: the tokenizer's ids.
    ('exports/qwen', 409, 432),  # An import's padded table is kept...
    ('exports/qwen', 440, 440),  # ...unless the tokenizer outgrows it.
])
def test_a_finetune_keeps_its_imports_padded_vocabulary(pretrained, tokenizer,
                                                        model):
  config = ml_collections.ConfigDict(dict(
      init=dict(pretrained=pretrained),
      model=dict(vocab_size=432, target_vocab_size=0, pad_id=0, eos_id=1)))
  tok = _Vocabulary(tokenizer)
  resolved = run_spec.with_vocabulary(config, tok, tok)
  assert resolved.model.vocab_size == model
  assert resolved.model.target_vocab_size == 0
