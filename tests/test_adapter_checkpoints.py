"""The checkpoints of a LoRA fine-tune from an export hold the adapters,
their optimizer state and average, and a reference to the export with its
fingerprint (`checkpoints/saved_state.py`): small, resumed bitwise over
the same base, refused over another; whole checkpoints written before
keep resuming."""
import json
import pathlib
import shutil
import signal

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util

from jaxformer.checkpoints import exports as exports_lib
from jaxformer.checkpoints import saved_state, trained
from jaxformer.checkpoints.manager import CheckpointError
from jaxformer.config.settings import load_config
from jaxformer.model import lora
from jaxformer.run.trainer import Trainer
from jaxformer.train import frozen_base
from test_finetune_lm import CONFIG, _overrides, setup  # noqa: F401

LORA = ['model.lora.targets=q,v,o,ffn_in', 'model.lora.rank=4',
        'model.lora.alpha=8', 'train.ema_decay=0.9']


def _tiny_export(directory: str) -> str:
  exports_lib.export_params(directory, {'layer': {
      'kernel': np.arange(12, dtype=np.float32).reshape(3, 4)}},
                            {'config': {}, 'tokenizers': []})
  return directory


def _flat(tree) -> dict:
  return traverse_util.flatten_dict(jax.tree.map(np.asarray, tree))


def _equal(a, b) -> None:
  a, b = (jax.tree_util.tree_leaves_with_path(jax.tree.map(np.asarray, tree))
          for tree in (a, b))
  assert [path for path, _ in a] == [path for path, _ in b]
  for (path, x), (_, y) in zip(a, b):
    assert x.tobytes() == y.tobytes(), path


def test_the_fingerprint_is_of_the_files_and_not_of_the_commit_markers(
    tmp_path):
  export = _tiny_export(str(tmp_path / 'export'))
  first = saved_state.fingerprint(export)
  shutil.copytree(export, tmp_path / 'copy')
  assert saved_state.fingerprint(str(tmp_path / 'copy')) == first
  # `export` rewrites the markers without the path they were written to.
  (tmp_path / 'copy' / 'commit_success.txt').write_text('written elsewhere')
  assert saved_state.fingerprint(str(tmp_path / 'copy')) == first
  data = [path for path in (tmp_path / 'copy' / 'params').rglob('*')
          if path.is_file() and path.parent.name == 'd']
  data[0].write_bytes(data[0].read_bytes()[:-1] + b'\x00')
  assert saved_state.fingerprint(str(tmp_path / 'copy')) != first
  # Another export of the same arrays is another export.
  assert saved_state.fingerprint(_tiny_export(str(tmp_path / 'again'))) != (
      first)


def test_a_missing_or_changed_base_is_named_with_the_fix(tmp_path):
  export = _tiny_export(str(tmp_path / 'export'))
  reference = {'export': export, 'sha256': saved_state.fingerprint(export)}
  saved_state.check_base(reference, export)
  with pytest.raises(CheckpointError, match='is not the one these adapter '
                     'checkpoints were trained on.*put that export back'):
    saved_state.check_base(dict(reference, sha256='0' * 64), export)
  with pytest.raises(CheckpointError, match='is missing.*init.pretrained'):
    saved_state.check_base(reference, str(tmp_path / 'moved'))


def _config(root, export, steps, *overrides):
  return load_config(f'{CONFIG}:tsv', _overrides(root, export, 'tsv', steps)
                     + LORA + list(overrides))


@pytest.mark.slow
def test_adapter_checkpoints_are_small_and_resume_bitwise(setup, tmp_path):
  root, exports = setup
  export = str(tmp_path / 'base')
  shutil.copytree(exports['own'], export)
  # An nf4 base: read back from the export, it must quantize bitwise again
  # (a float32 base resumes in test_finetune_lora.py's SIGKILL test).
  nf4 = 'model.lora.base_dtype=nf4'
  whole = Trainer(_config(root, export, 8, nf4), str(tmp_path / 'whole'))
  whole.run()
  halves = str(tmp_path / 'halves')
  stopped = Trainer(_config(root, export, 8, nf4), halves)
  # Stopped as a preemption stops a run: SIGTERM, saved at the boundary.
  stopped.hooks.add('preempted', lambda boundary: signal.raise_signal(
      signal.SIGTERM), every=4)
  assert not stopped.train().finished
  resumed = Trainer(_config(root, export, 8, nf4), halves)
  resumed.run()
  _equal(resumed.state.params, whole.state.params)
  _equal(resumed.state.ema, whole.state.ema)
  _equal(resumed.state.opt_state, whole.state.opt_state)

  step = pathlib.Path(halves) / 'checkpoints' / '8'
  extra = json.loads((step / 'extra' / 'metadata').read_text())
  assert extra['base'] == {'export': export,
                           'sha256': saved_state.fingerprint(export)}
  held = ocp.Checkpointer(ocp.StandardCheckpointHandler()).metadata(
      step / 'state')
  held = getattr(held, 'item_metadata', held)
  held = [tuple(getattr(key, 'key', getattr(key, 'idx', None))
                for key in path)
          for path, _ in jax.tree_util.tree_leaves_with_path(
              getattr(held, 'tree', held))]
  for item in ('params', 'ema'):
    paths = [path[1:] for path in held if path[0] == item]
    assert paths and all(map(frozen_base.is_trainable, paths)), paths

  # Read back by every command through `trained.load`, over the base.
  loaded = trained.load(halves, weights='raw')
  _equal(loaded.params, resumed.state.params)

  # The base changed under the checkpoints: refused, not trained over.
  data = [path for path in pathlib.Path(export, 'params').rglob('*')
          if path.is_file() and path.parent.name == 'd']
  data[0].write_bytes(data[0].read_bytes() + b'\x00')
  with pytest.raises(CheckpointError, match='is not the one these adapter'):
    Trainer(_config(root, export, 12, nf4), halves)
  for read in (trained.load, lambda workdir: trained.export(
      workdir, str(tmp_path / 'export'))):
    with pytest.raises(CheckpointError, match='is not the one these adapter'):
      read(halves)
  assert not (tmp_path / 'export').exists()


@pytest.mark.slow
def test_whole_lora_checkpoints_written_before_keep_resuming(
    setup, tmp_path, monkeypatch):
  root, exports = setup
  workdir = str(tmp_path / 'run')
  with monkeypatch.context() as patch:  # As runs saved before adapters alone.
    patch.setattr(saved_state, 'of_run',
                  lambda run, extra: saved_state.SavedState(run, None))
    Trainer(_config(root, exports['own'], 4), workdir).run()
  step = pathlib.Path(workdir) / 'checkpoints' / '4'
  assert 'base' not in json.loads((step / 'extra' / 'metadata').read_text())
  resumed = Trainer(_config(root, exports['own'], 8), workdir)
  resumed.run()
  assert int(resumed.state.step) == 8
  assert resumed.saved_state.base is None
  tuned = _flat(trained.load(workdir, weights='raw').params)
  assert any(lora.is_adapter(path) for path in tuned)
