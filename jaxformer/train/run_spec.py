"""A run, resolved once: what a config and the tokenizers make of it.

`RunSpec.build` turns a config (with its vocabulary: the tokenizers of a
run, or a saved config's own) and a mesh into the model config, the task,
the learning-rate schedule and the optimizer. From them follow the batch
shapes, the train state's layout and the jitted steps. `jaxformer train`
(`run/trainer.py`), `jaxformer compile` (`aot/programs.py`) and every
command that loads a trained model (`checkpoints/trained.py`) build their
run here, so they cannot drift apart: a new model family adds its options
to `model/config.py` and its task to `train/tasks.py`, and each of them
follows.
"""
import dataclasses
import functools
from collections.abc import Sequence

import jax
import ml_collections
import optax

from jaxformer.data.tokenizer import Tokenizer
from jaxformer.model import config as model_config_lib
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.storage.errors import DataError
from jaxformer.train import schedule as schedules
from jaxformer.train.state import (TrainState, create_train_state,
                                   state_shardings)
from jaxformer.train.step import compile_eval_step, compile_train_step
from jaxformer.train.tasks import Task, get_task


def run_mesh(config: ml_collections.ConfigDict,
             devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """The mesh of config.mesh over `devices` (default: every device)."""
  return mesh_lib.make_mesh(
      {axis: config.mesh[axis] for axis in mesh_lib.MESH_AXES}, devices,
      dcn_data=config.mesh.get('dcn_data', 1))


def _copy(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(config.to_dict())


def with_vocabulary(config: ml_collections.ConfigDict, source_tok: Tokenizer,
                    target_tok: Tokenizer) -> ml_collections.ConfigDict:
  """The model's vocabulary sizes and special ids (padding, end of
  sentence) follow the tokenizers."""
  if source_tok.pad_id != target_tok.pad_id:
    raise DataError(
        f'the source vocabulary pads with id {source_tok.pad_id}, the '
        f'target one with {target_tok.pad_id}; the model has one pad id')
  config = _copy(config)
  if not _keeps_pretrained_vocabulary(config, source_tok, target_tok):
    config.model.vocab_size = source_tok.vocab_size
    config.model.target_vocab_size = (
        0 if target_tok.vocab_size == source_tok.vocab_size
        else target_tok.vocab_size)
  config.model.pad_id = source_tok.pad_id
  config.model.eos_id = target_tok.eos_id
  return config


def _keeps_pretrained_vocabulary(config: ml_collections.ConfigDict,
                                 source_tok: Tokenizer,
                                 target_tok: Tokenizer) -> bool:
  """Whether a fine-tune keeps its export's vocabulary: an imported model's
  embedding table may hold more rows than its tokenizer has ids (hubs pad
  it, e.g. Qwen2's 151,936 rows for 151,665 ids), and its tokenizers fit."""
  if not config.get('init', {}).get('pretrained', ''):
    return False
  model = config.model
  return (source_tok.vocab_size <= model.vocab_size and
          target_tok.vocab_size <= (model.get('target_vocab_size', 0)
                                    or model.vocab_size))


def with_labels(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Classification: `data.labels` (the train split's sorted labels unless
  given) and `model.num_classes` to match; other tasks are unchanged."""
  if not get_task(config.task).labels_from_data:
    return config
  # Here, not at the top: the batches bring TensorFlow, which the commands
  # that only load a model do without.
  from jaxformer.data import row_layouts
  config = _copy(config)
  config.data.labels = row_layouts.labels_of(config.data)
  config.model.num_classes = len(config.data.labels)
  return config


def with_expected_vocabulary(config: ml_collections.ConfigDict
                             ) -> ml_collections.ConfigDict:
  """The vocabulary `jaxformer train` would give the model, without its
  tokenizer: one trained to data.tokenizer.vocab_size pieces, unless a model
  file is given (then model.vocab_size stands for it). Classes: data.labels
  if given, else model.num_classes (train reads them from the data)."""
  tokenizer = config.data.tokenizer
  config = _copy(config)
  if config.data.labels:
    config.model.num_classes = len(config.data.labels)
  if not (tokenizer.model_path or tokenizer.source_model_path):
    config.model.vocab_size = tokenizer.vocab_size
    config.model.target_vocab_size = 0
  return config


@dataclasses.dataclass(frozen=True, eq=False)
class RunSpec:
  """A resolved run (see the module docstring); build it with `build`.

  config: the run's config, its vocabulary (and classes) resolved: what
    checkpoints save and `config.json` holds.
  """
  config: ml_collections.ConfigDict
  model_config: model_config_lib.ModelConfig
  task: Task
  mesh: jax.sharding.Mesh
  # (step, num_steps), ...: where warmup_cosine decays when a budget plans
  # it (`schedules.replanned_cosine_schedule`); (): to train.num_steps.
  plan: tuple[tuple[int, int], ...] = ()

  @classmethod
  def build(cls, config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh,
            tokenizers: Sequence[Tokenizer] | None = None) -> 'RunSpec':
    """The run of `config` on `mesh` (`run_mesh` for a run's own).

    tokenizers: [source, target] of a run that starts or resumes: they size
      the vocabulary, and classification reads its labels from the data;
      None takes `config`'s vocabulary as it is (a saved config's, or
      `with_expected_vocabulary`'s).
    """
    if tokenizers is not None:
      config = with_labels(with_vocabulary(config, *tokenizers))
    return cls(config, model_config_lib.from_config_dict(config.model),
               get_task(config.task), mesh)

  def with_num_steps(self, num_steps: int) -> 'RunSpec':
    """The run to `num_steps` steps, its schedule and optimizer following."""
    config = _copy(self.config)
    config.train.num_steps = num_steps
    return dataclasses.replace(self, config=config)

  def with_plan(self, plan: Sequence[tuple[int, int]]) -> 'RunSpec':
    """The run to the last num_steps of a budget's `plan`, its schedule
    decaying as the plan says (`run/budget.py`)."""
    return dataclasses.replace(self.with_num_steps(plan[-1][1]),
                               plan=tuple(map(tuple, plan)))

  @functools.cached_property
  def schedule(self) -> optax.Schedule:
    """The learning rate by step (`train.schedule`, over `plan` if any)."""
    return schedules.make_schedule(self.config.train, self.model_config.d_model,
                                   self.plan)

  @functools.cached_property
  def tx(self) -> optax.GradientTransformation:
    """The optimizer (built on first use: commands need none)."""
    return schedules.make_optimizer(self.config.train, self.schedule)

  @property
  def rules(self):
    """The logical-axis rules (`mesh.axis_rules`)."""
    return self.config.mesh.axis_rules

  @property
  def row_shards(self) -> int:
    return mesh_lib.row_shards(self.mesh)

  def model(self, deterministic: bool = True):
    return self.task.model(self.model_config, deterministic=deterministic)

  def example_batch(self):
    """A one-row batch of the configured shapes (`Task.example_batch`)."""
    return self.task.example_batch(self.config)

  def batch_struct(self, rows: int, source: int, target: int
                   ) -> dict[str, jax.ShapeDtypeStruct]:
    """A global batch (`Task.batch_shapes`: token arrays [rows, source]
    and/or [rows, target], the labels or values) split over the batch
    axes."""
    sharding = mesh_lib.batch_sharding(self.mesh)
    shapes = self.task.batch_shapes(self.config, rows, source, target)
    return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for key, (shape, dtype) in shapes.items()}

  @functools.cached_property
  def state_layout(self) -> tuple[TrainState, TrainState]:
    """(abstract TrainState, NamedSharding tree) with the run's optimizer."""
    return self._layout(self.tx)

  def abstract_params(self):
    """The parameters as ShapeDtypeStructs placed on the mesh; no optimizer
    state is laid out (enough to restore the parameters alone)."""
    abstract, shardings = self._layout(optax.identity())
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract.params, shardings.params)

  def _layout(self, tx: optax.GradientTransformation):
    return state_shardings(self.task, self.model(), tx, self.example_batch(),
                           self.mesh, self.rules, self.config.train.prng_impl,
                           self.ema_decay)

  @property
  def ema_decay(self) -> float:
    """`train.ema_decay` (0, or absent from an older config: no average)."""
    return float(self.config.train.get('ema_decay', 0.0))

  def init_state(self) -> TrainState:
    """A fresh train state of `config.seed`, each shard on its devices."""
    return create_train_state(self.task, self.model(), self.tx,
                              self.example_batch(), self.mesh, self.rules,
                              self.config.seed, self.config.train.prng_impl,
                              self.ema_decay)

  def train_step(self, shardings: TrainState):
    """The jitted train step (`train/step.py`) for a state placed as
    `shardings`."""
    train = self.config.train
    return compile_train_step(
        self.mesh, shardings, task=self.task,
        model=self.model(deterministic=False), tx=self.tx,
        schedule=self.schedule, label_smoothing=train.label_smoothing,
        grad_accum_steps=train.grad_accum_steps, prng_impl=train.prng_impl,
        ema_decay=self.ema_decay)

  def eval_step(self, param_shardings):
    """The jitted eval step: loss sums of a batch."""
    return compile_eval_step(self.mesh, param_shardings, task=self.task,
                             model=self.model())
