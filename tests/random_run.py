"""A training workdir of random parameters, saved without training: the
quick start's tiny runlocal model and a tokenizer trained on the built-in
data, for the tests of the commands that use a trained model."""
import pathlib

import jax
import numpy as np

from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.config.settings import default_config, load_config
from jaxformer.data import builtin
from jaxformer.data import tokenizer as tokenizer_lib
from jaxformer.model import config as model_config_lib
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train import schedule as schedules
from jaxformer.train.run_spec import with_vocabulary
from jaxformer.train.state import create_train_state
from jaxformer.train.tasks import get_task

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'quickstart.py') + ':runlocal'


def tokenizer(directory, vocab_size: int = 128, seed: int = 0):
  texts = [text for pair in builtin.generate(300, seed, 'train')
           for text in pair]
  tok_config = default_config().data.tokenizer
  tok_config.vocab_size = vocab_size
  return tokenizer_lib.train_tokenizer(texts, str(directory / 'joint'),
                                       tok_config)


def random_state(config, seed: int = 0):
  """A fresh train state of `config` (with its vocabulary) on all devices."""
  task = get_task(config.task)
  tx = schedules.make_optimizer(config.train, schedules.make_schedule(
      config.train, config.model.d_model))
  return create_train_state(
      task, task.model(model_config_lib.from_config_dict(config.model)), tx,
      task.example_batch(config), mesh_lib.make_mesh({'data': -1}),
      config.mesh.axis_rules, seed=seed,
      ema_decay=config.train.get('ema_decay', 0.0))


def save_steps(workdir, config, tok, states) -> str:
  """Saves `states` ({step: state}) with `config` and `tok` in `workdir`."""
  checkpoints = checkpoint_lib.Checkpointer(str(workdir),
                                            default_config().checkpoint)
  checkpoints.set_extra(config, [tok])
  for step, state in states.items():
    checkpoints.save(step, state, {'loss': 1.0})
  checkpoints.wait()
  checkpoints.close()
  return str(workdir)


def one_step_run(tmp_path_factory) -> tuple[str, object]:
  """(a workdir holding a random translator's step 1, its config)."""
  tok = tokenizer(tmp_path_factory.mktemp('tokenizer'))
  config = config_for(tok)
  return save_steps(tmp_path_factory.mktemp('run'), config, tok,
                    {1: random_state(config)}), config


def config_for(tok, **train):
  """The runlocal quick start's config with `tok`'s vocabulary, 4 test
  sentences and the given train.* values."""
  config = with_vocabulary(load_config(CONFIG), tok, tok)
  config.data.builtin.num_test = 4
  config.train.update(train)
  return config


def as_numpy(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))
