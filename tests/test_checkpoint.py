"""Checkpoints: restoring into any mesh, keeping the best step, surviving
damaged and failed writes, refusing incompatible configs, and parameter
exports (`jaxformer export` / `jaxformer average`) that load and translate."""
import errno
import os
import pathlib
import resource
import shutil
import signal
import socket
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.cli import main as cli
from jaxformer.config import resume
from jaxformer.inference import translator
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.config.settings import default_config, load_config
from jaxformer.data import builtin
from jaxformer.data import task_batches
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.model import config as model_config_lib
from jaxformer.train.tasks import get_task
from jaxformer.train import schedule as schedules
from jaxformer.checkpoints import trained
from jaxformer.train.run_spec import with_vocabulary
from jaxformer.train.state import create_train_state, state_shardings
from trained_runs import train

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py') + ':runlocal'


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  texts = [text for pair in builtin.generate(300, 0, 'train') for text in pair]
  tok_config = default_config().data.tokenizer
  tok_config.vocab_size = 128
  prefix = str(tmp_path_factory.mktemp('tokenizer') / 'joint')
  return tokenizer_lib.train_tokenizer(texts, prefix, tok_config)


@pytest.fixture(scope='module')
def config(tokenizer):
  """The quickstart's tiny model (d_model 32, one layer each side)."""
  return with_vocabulary(load_config(CONFIG), tokenizer, tokenizer)


def options(**changes) -> ml_collections.ConfigDict:
  result = default_config().checkpoint
  result.update(changes)
  return result


def optimizer(config):
  return schedules.make_optimizer(config.train, schedules.make_schedule(
      config.train, config.model.d_model))


def model_and_task(config):
  task = get_task(config.task)
  return task, task.model(model_config_lib.from_config_dict(config.model))


def new_state(config, mesh):
  task, model = model_and_task(config)
  return create_train_state(task, model, optimizer(config),
                            task.example_batch(config), mesh,
                            config.mesh.axis_rules, seed=0)


def layout(config, mesh):
  """(abstract state, shardings) of the train state on `mesh`."""
  task, model = model_and_task(config)
  return state_shardings(task, model, optimizer(config),
                         task.example_batch(config), mesh,
                         config.mesh.axis_rules)


def save(workdir, steps_and_states, config, tokenizer, **option_changes):
  checkpoints = checkpoint_lib.Checkpointer(str(workdir),
                                            options(**option_changes))
  checkpoints.set_extra(config, [tokenizer])
  for step, state in steps_and_states:
    checkpoints.save(step, state, {'loss': 1.0})
  checkpoints.wait()
  return checkpoints


def seen_by_a_new_process(workdir: pathlib.Path) -> pathlib.Path:
  """A copy of `workdir`: reads of the original paths may be served from
  what this process cached while writing them."""
  copy = workdir.with_name(workdir.name + '_copy')
  shutil.copytree(workdir, copy)
  return copy


def files_and_sizes(directory: pathlib.Path, after: float = 0.0):
  time.sleep(after)
  return {path: path.stat().st_size for path in directory.rglob('*')
          if path.is_file()}


def as_numpy(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(as_numpy(a)), jax.tree.leaves(as_numpy(b))):
    np.testing.assert_array_equal(x, y)


@pytest.fixture(scope='module')
def mesh():
  return mesh_lib.make_mesh({'data': -1})


@pytest.fixture(scope='module')
def state(config):
  """A fresh train state, sharded over a data=2 x fsdp=4 mesh."""
  return new_state(config, mesh_lib.make_mesh({'data': 2, 'fsdp': 4}))


def shifted(state, amount: float):
  return state.replace(params=jax.tree.map(lambda p: p + amount,
                                           state.params))


@pytest.fixture(scope='module')
def fsdp_checkpoint(tmp_path_factory, config, tokenizer, state):
  """The fresh state saved from its data=2 x fsdp=4 mesh."""
  assert not all(x.sharding.is_fully_replicated
                 for x in jax.tree.leaves(state.params))
  workdir = tmp_path_factory.mktemp('fsdp')
  save(workdir, [(7, state)], config, tokenizer).close()
  return seen_by_a_new_process(workdir), as_numpy(state)


@pytest.mark.slow
@pytest.mark.parametrize('sizes, num_devices', [
    ({'data': 1}, 1), ({'data': 4}, 4), ({'data': 8}, 8)])
def test_state_saved_sharded_restores_into_another_mesh(
    fsdp_checkpoint, config, sizes, num_devices):
  workdir, saved = fsdp_checkpoint
  mesh = mesh_lib.make_mesh(sizes, jax.devices()[:num_devices])
  abstract, shardings = layout(config, mesh)
  checkpoints = checkpoint_lib.Checkpointer(str(workdir), options())
  restored = checkpoints.restore_latest(abstract, shardings)
  assert_trees_equal(restored, saved)
  for array, sharding in zip(jax.tree.leaves(restored),
                             jax.tree.leaves(shardings)):
    assert array.sharding == sharding
    assert len(array.devices()) == num_devices


@pytest.mark.parametrize('best_metric, best_mode, scores, kept', [
    ('bleu', 'max', {2: 30.0, 4: 20.0}, [2, 5]),
    ('loss', 'min', {2: 3.0, 4: 1.0}, [4, 5]),
])
def test_best_step_is_kept_beside_the_latest(tmp_path, best_metric, best_mode,
                                             scores, kept):
  checkpoints = checkpoint_lib.Checkpointer(
      str(tmp_path), options(keep=1, best_metric=best_metric,
                             best_mode=best_mode))
  state = {'w': np.arange(4.0)}
  for step in range(1, 6):
    metrics = {'loss': 9.0}
    if step in scores:
      metrics[f'eval_{best_metric}'] = scores[step]
    checkpoints.save(step, state, metrics)
  checkpoints.wait()
  assert checkpoints.all_steps() == kept


def truncate(path: pathlib.Path) -> None:
  os.truncate(path, path.stat().st_size // 2)


def truncate_array_index(step_dir: pathlib.Path) -> None:
  truncate(step_dir / 'state' / 'manifest.ocdbt')


def truncate_tree_metadata(step_dir: pathlib.Path) -> None:
  truncate(step_dir / 'state' / '_METADATA')


def delete_state(step_dir: pathlib.Path) -> None:
  shutil.rmtree(step_dir / 'state')


def delete_extra(step_dir: pathlib.Path) -> None:
  shutil.rmtree(step_dir / 'extra')


@pytest.mark.slow
@pytest.mark.parametrize('damage', [truncate_array_index,
                                    truncate_tree_metadata, delete_state,
                                    delete_extra])
def test_damaged_latest_step_is_reported_and_the_one_before_used(
    tmp_path, config, tokenizer, mesh, state, capsys, damage):
  later = shifted(state, 1.0)
  save(tmp_path / 'run', [(1, state), (2, later)], config, tokenizer).close()
  workdir = seen_by_a_new_process(tmp_path / 'run')
  damaged = workdir / 'checkpoints' / '2'
  damage(damaged)
  files_before = sorted(p.relative_to(damaged)
                        for p in damaged.rglob('*'))

  checkpoints = checkpoint_lib.Checkpointer(str(workdir), options())
  restored = checkpoints.restore_latest(*layout(config, mesh))

  assert_trees_equal(restored, state)
  assert f'{damaged} cannot be restored' in capsys.readouterr().err
  [moved] = (workdir / 'checkpoints').glob('2.damaged-*')
  assert sorted(p.relative_to(moved) for p in moved.rglob('*')) == files_before
  assert checkpoints.all_steps() == [1]
  checkpoints.set_extra(config, [tokenizer])
  checkpoints.save(2, later, {})
  checkpoints.wait()
  assert checkpoints.all_steps() == [1, 2]


@pytest.mark.slow
def test_no_restorable_step_raises_and_moves_nothing(tmp_path, config,
                                                     tokenizer, mesh, state):
  save(tmp_path / 'run', [(1, state)], config, tokenizer).close()
  workdir = seen_by_a_new_process(tmp_path / 'run')
  delete_state(workdir / 'checkpoints' / '1')
  checkpoints = checkpoint_lib.Checkpointer(str(workdir), options())

  with pytest.raises(checkpoint_lib.CheckpointError,
                     match='No checkpoint in .* can be restored .*step 1: '):
    checkpoints.restore_latest(*layout(config, mesh))
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['1']


@pytest.mark.slow
def test_failed_save_raises_and_keeps_the_previous_checkpoints(
    tmp_path, config, tokenizer, mesh, state):
  checkpoints = save(tmp_path, [(1, state)], config, tokenizer)
  # Root ignores permissions, but not a file size limit: every array file
  # of the next step fails to write.
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, hard))
  try:
    with pytest.raises(checkpoint_lib.CheckpointError,
                       match=r'step 2 .* failed .* \[1\] are kept'):
      checkpoints.save(2, state, {})
      checkpoints.wait()
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous_handler)
  # The error comes only after the step's other writes have ended.
  assert files_and_sizes(tmp_path) == files_and_sizes(tmp_path, after=1.0)

  reopened = checkpoint_lib.Checkpointer(
      str(seen_by_a_new_process(tmp_path)), options())
  assert reopened.all_steps() == [1]
  assert_trees_equal(reopened.restore_latest(*layout(config, mesh)), state)


def test_resuming_with_another_model_or_state_layout_names_the_keys(
    tmp_path, config, tokenizer):
  save(tmp_path, [(1, {'w': np.zeros(2)})], config, tokenizer).close()
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path), options())
  changed = ml_collections.ConfigDict(config.to_dict())
  changed.model.update(d_model=64, num_decoder_layers=2, vocab_size=512)
  changed.train.update(num_steps=10_000, weight_decay=0.1, prng_impl='rbg')

  with pytest.raises(checkpoint_lib.CheckpointError) as error:
    resume.check_compatible(checkpoints, changed)

  message = str(error.value)
  for key in ('model.d_model: saved 32, now 64',
              'model.num_decoder_layers: saved 1, now 2',
              'model.vocab_size: saved 128, now 512',
              'train.weight_decay: saved 0.0, now 0.1',
              "train.prng_impl: saved 'threefry2x32', now 'rbg'"):
    assert key in message
  assert 'train.num_steps' not in message


def test_resuming_with_more_steps_or_another_learning_rate_is_allowed(
    tmp_path, config, tokenizer):
  save(tmp_path, [(1, {'w': np.zeros(2)})], config, tokenizer).close()
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path), options())
  changed = ml_collections.ConfigDict(config.to_dict())
  changed.train.update(num_steps=10_000, learning_rate=1e-4,
                       grad_clip_norm=0.5, schedule='warmup_cosine')
  resume.check_compatible(checkpoints, changed)


def test_a_run_saved_before_an_option_existed_resumes_with_its_default(
    tmp_path, config, tokenizer):
  """Configs saved by an older jaxformer lack the options added since;
  their defaults behave as before, another value is a change."""
  older = ml_collections.ConfigDict(config.to_dict())
  del older.model['sinusoid_layout']
  del older.data.tokenizer['target_vocab_size']
  save(tmp_path, [(1, {'w': np.zeros(2)})], older, tokenizer).close()
  checkpoints = checkpoint_lib.Checkpointer(str(tmp_path), options())
  defaults = dict(model=dict(sinusoid_layout='interleaved'),
                  data=dict(tokenizer=dict(target_vocab_size=0)))
  resume.check_compatible(checkpoints, config, defaults)

  changed = ml_collections.ConfigDict(config.to_dict())
  changed.model.sinusoid_layout = 'halves'
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match="model.sinusoid_layout: saved None, now 'halves'"):
    resume.check_compatible(checkpoints, changed, defaults)


def batching(config, kind: str, grad_accum_steps: int = 1):
  changed = ml_collections.ConfigDict(config.to_dict())
  changed.data.batching = kind
  changed.train.grad_accum_steps = grad_accum_steps
  return changed


def save_in_data_order(workdir, config, tokenizer, row_shards: int) -> None:
  """A checkpoint of step 1 saved with `config`'s data order on a mesh of
  `row_shards` row shards."""
  checkpoints = checkpoint_lib.Checkpointer(str(workdir), options())
  checkpoints.set_extra(config, [tokenizer])
  resume.use_data_order(checkpoints,
                        task_batches.data_order(config, row_shards), False)
  checkpoints.save(1, {'w': np.zeros(2)}, {'loss': 1.0})
  checkpoints.close()


def test_resuming_bucket_batches_on_another_row_multiple_needs_consent(
    tmp_path, config, tokenizer, capsys):
  save_in_data_order(tmp_path, batching(config, 'bucket'), tokenizer, 8)

  resumed = checkpoint_lib.Checkpointer(str(tmp_path), options())
  # 4 row shards x 2 microbatches: a multiple of 8 rows as before, the
  # same batches.
  resume.use_data_order(
      resumed, task_batches.data_order(batching(config, 'bucket', 2), 4), False)
  new_order = task_batches.data_order(batching(config, 'bucket', 2), 8)
  with pytest.raises(checkpoint_lib.CheckpointError) as error:
    resume.use_data_order(resumed, new_order, False)
  message = str(error.value)
  assert '\n' not in message
  assert ('multiples of 8 rows (8 row shards (mesh.data x mesh.fsdp) x 1 '
          'train.grad_accum_steps), this run makes multiples of 16 rows (8 '
          'row shards (mesh.data x mesh.fsdp) x 2 train.grad_accum_steps)'
          in message)
  assert '--config.data.allow_new_data_order=true' in message

  resume.use_data_order(resumed, new_order, True)
  assert 'going on in the new order' in capsys.readouterr().err
  resumed.save(2, {'w': np.zeros(2)}, {'loss': 1.0})
  resumed.wait()
  assert resumed.restore_extra(2)['data_order'] == new_order
  resumed.close()


def first_batches(config, tokenizer, row_multiple: int):
  """Global batches 5 and 6 of `config` with rows in multiples of
  `row_multiple` (mesh.data x mesh.fsdp x train.grad_accum_steps)."""
  stream = task_batches.train_batches(config, tokenizer, tokenizer, start_step=5,
                                    row_multiple=row_multiple)
  return [next(stream) for _ in range(2)]


@pytest.mark.slow
def test_pack_batches_resume_on_any_layout(tmp_path, config, tokenizer):
  pack = batching(config, 'pack')
  # The same examples in the same rows whatever the row multiple; bucket
  # batches change with it.
  for a, b in zip(first_batches(pack, tokenizer, 1),
                  first_batches(pack, tokenizer, 16)):
    assert a.keys() == b.keys()
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  bucket = batching(config, 'bucket')
  assert [len(batch['inputs']) for batch in first_batches(
      bucket, tokenizer, 1)] != [len(batch['inputs']) for batch in
                                 first_batches(bucket, tokenizer, 16)]

  save_in_data_order(tmp_path, pack, tokenizer, 8)
  resumed = checkpoint_lib.Checkpointer(str(tmp_path), options())
  resume.use_data_order(
      resumed, task_batches.data_order(batching(config, 'pack', 4), 2), False)
  resumed.close()


def test_workdir_under_a_file_fails_at_start_naming_the_file(tmp_path, capsys):
  blocking = tmp_path / 'notes.txt'
  blocking.write_text('not a directory')
  status = train(blocking / 'run', config=CONFIG)
  assert status == 1
  assert f'{blocking} is a file' in capsys.readouterr().err
  assert blocking.read_text() == 'not a directory'


@pytest.fixture(scope='module')
def three_steps(tmp_path_factory, config, tokenizer, state):
  """A workdir with steps 1 (p), 2 (p + 1) and 3 (p + 2)."""
  workdir = tmp_path_factory.mktemp('three_steps')
  save(workdir, [(1, state), (2, shifted(state, 1.0)),
                 (3, shifted(state, 2.0))], config, tokenizer, keep=3).close()
  return seen_by_a_new_process(workdir), as_numpy(state.params)


@pytest.mark.slow
def test_average_of_the_last_two_steps_is_their_mean(three_steps, tmp_path):
  workdir, params = three_steps
  steps = trained.average(str(workdir), 2, str(tmp_path / 'avg'))
  assert steps == [2, 3]
  averaged = trained.load(str(tmp_path / 'avg')).params
  for got, want in zip(jax.tree.leaves(as_numpy(averaged)),
                       jax.tree.leaves(params)):
    np.testing.assert_allclose(got, want + 1.5, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_average_of_identical_steps_is_that_step(tmp_path, config, tokenizer,
                                                 state):
  save(tmp_path / 'run', [(s, state) for s in (1, 2, 3)], config, tokenizer,
       keep=3).close()
  trained.average(
      str(seen_by_a_new_process(tmp_path / 'run')), 3, str(tmp_path / 'avg'))
  averaged = trained.load(str(tmp_path / 'avg')).params
  assert_trees_equal(averaged, state.params)


@pytest.mark.slow
def test_exports_from_the_command_line_load_and_translate(
    three_steps, tmp_path, capsys):
  workdir, params = three_steps
  assert cli.main(['export', '--workdir', str(workdir),
                   '--out', str(tmp_path / 'latest')]) == 0
  assert cli.main(['average', '--workdir', str(workdir), '--last', '3',
                   '--out', str(tmp_path / 'averaged')]) == 0
  assert 'mean parameters of steps [1, 2, 3]' in capsys.readouterr().out

  latest = trained.load(str(tmp_path / 'latest'))
  assert latest.step == 3
  assert_trees_equal(latest.params, jax.tree.map(lambda p: p + 2.0, params))
  model = trained.load(str(tmp_path / 'averaged'))
  assert model.step == 3 and model.task.name == 'translation'
  averaged = model.params
  for got, want in zip(jax.tree.leaves(as_numpy(averaged)),
                       jax.tree.leaves(params)):
    np.testing.assert_allclose(got, want + 1.0, rtol=1e-6, atol=1e-6)
  saved_items = ocp.StandardCheckpointer().metadata(
      str(tmp_path / 'averaged' / 'params')).item_metadata
  assert set(saved_items) == set(params)
  lines = list(translator.translate_lines(translator.Translation(
      [model], translator.TranslateSettings(
          batch_size=2, chunk_batches=1, beam_size=1, alpha=0.6,
          max_extra_len=4, max_source_length=model.model_config.max_len)),
      ['she bought forty-two red apples .', '']))
  assert len(lines) == 2 and lines[1] == ''


@pytest.mark.slow
def test_export_never_overwrites(three_steps, tmp_path, capsys):
  workdir, _ = three_steps
  out = tmp_path / 'taken'
  out.mkdir()
  (out / 'keep.txt').write_text('mine')
  assert cli.main(['export', '--workdir', str(workdir),
                   '--out', str(out)]) == 1
  assert 'already exists' in capsys.readouterr().err
  assert (out / 'keep.txt').read_text() == 'mine'


def test_averaging_more_steps_than_kept_says_which_exist(three_steps,
                                                         tmp_path):
  workdir, _ = three_steps
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r'3 checkpoints \[1, 2, 3\], fewer than --last=5'):
    trained.average(str(workdir), 5, str(tmp_path / 'x'))
  assert not (tmp_path / 'x').exists()


@pytest.mark.slow
def test_loading_for_translate_or_evaluate_names_both_steps_of_a_fallback(
    tmp_path, config, tokenizer, state, capsys):
  save(tmp_path / 'run', [(1, state), (2, shifted(state, 1.0))], config,
       tokenizer).close()
  workdir = seen_by_a_new_process(tmp_path / 'run')
  delete_state(workdir / 'checkpoints' / '2')

  model = trained.load(str(workdir))

  err = capsys.readouterr().err
  assert 'the latest checkpoint, step 2, cannot be restored' in err
  assert 'using step 1 instead' in err
  assert model.step == 1
  assert_trees_equal(model.params, state.params)


def test_errors_that_may_pass_are_told_from_damage(tmp_path):
  """Timeouts, dropped connections and unavailable storage are retried
  before a step counts as damaged; missing or unreadable files are not."""
  with socket.socket() as s:  # A port that nothing listens on.
    s.bind(('127.0.0.1', 0))
    closed_port = s.getsockname()[1]
  with pytest.raises(ConnectionRefusedError) as refused:
    socket.create_connection(('127.0.0.1', closed_port), timeout=5)
  with pytest.raises(FileNotFoundError) as missing:
    (tmp_path / 'absent').read_bytes()
  transient = [refused.value, TimeoutError('read timed out'),
               OSError(errno.EIO, 'Input/output error'),
               ValueError('UNAVAILABLE: GCS returned 503'),
               ValueError('DEADLINE_EXCEEDED: read of gs://b/x')]
  damage = [missing.value, PermissionError(errno.EACCES, 'denied'),
            ValueError('DATA_LOSS: Error reading manifest.ocdbt')]
  assert [checkpoint_lib.transient(e) for e in transient] == [True] * 5
  assert [checkpoint_lib.transient(e) for e in damage] == [False] * 3
