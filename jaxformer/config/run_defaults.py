"""Every key of the run config with its default, and, beside them, the
values the keys of a fixed set may take (`CHOICES`, checked by
`config/validation.py`).

Each config file starts from `default_config()`, so each key has one
documented default. The groups of other layers are theirs: `model`
(`model/config.py`), `data` (`data/defaults.py`, with `DATA_CHOICES`) and
the mesh's axis rules (`parallel/mesh.py`).
"""
import ml_collections

from jaxformer.data.defaults import DATA_CHOICES, default_data_config
from jaxformer.model import config as model_config
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.train.tasks import TASKS

TRAIN_CHOICES = {
    'schedule': ('rsqrt', 'warmup_rsqrt', 'warmup_cosine'),
    'nan_policy': ('stop', 'skip'),
    'prng_impl': ('threefry2x32', 'rbg', 'unsafe_rbg'),
}


def train_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      num_steps=100_000,
      schedule='rsqrt',  # rsqrt (the paper) | warmup_rsqrt | warmup_cosine
      learning_rate=1.0,  # rsqrt: the factor; others: the peak
      warmup_steps=4000,
      b1=0.9, b2=0.98, eps=1e-9,
      weight_decay=0.0,  # > 0: AdamW
      grad_clip_norm=0.0,  # 0: no clipping
      label_smoothing=0.1,
      ema_decay=0.0,  # > 0: an average of the parameters (train/ema.py)
      grad_accum_steps=1,
      prng_impl='threefry2x32',
      nan_policy='stop',  # skip: non-finite steps are not applied
      log_every=100,
      peak_flops=0.0,  # a device's FLOP/s for MFU; 0: its chip's, or measured
      max_minutes=0.0,  # wall-clock budget (from the start); 0: none
      # With max_minutes and warmup_cosine: at the end of warm-up, fix
      # num_steps to what the budget allows, re-planned as the speed changes
      # (recorded in the workdir; docs/data.md).
      schedule_over_budget=False,
      # 'A:B': a jax.profiler trace of steps A-B in <workdir>/profile/
      # (process 0's, or every process's with profile_all_hosts); '': none.
      profile_steps='', profile_all_hosts=False,
  ))


SPLITS = ('train', 'dev', 'test')
EVAL_CHOICES = {'split': SPLITS, 'final_split': ('',) + SPLITS}


def eval_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      every=1000,  # steps; 0: only at the end
      split='dev',
      num_batches=0,  # 0: the whole split
      bleu_examples=256,  # dev sentences decoded for BLEU during training
      final_split='test',  # decoded with beam search after training; '' skips
      show_examples=5,  # example translations printed after training
      # > 1: the final evaluation uses the mean of the last N checkpoints.
      average_last=0,
      # A COMET checkpoint folder (local or gs://; `evaluate --comet`'s):
      # translation runs also score the bleu_examples sentences with it
      # (eval_comet; checkpoint.best_metric='comet'); '': off.
      comet='',
  ))


def decode_defaults() -> ml_collections.ConfigDict:
  """Beam search as the paper's: 4 beams, length penalty alpha 0.6, up to
  50 tokens beyond the longest source (`inference/search.py`'s defaults
  for callers without a config)."""
  return ml_collections.ConfigDict(dict(
      beam_size=4, alpha=0.6, max_extra_len=50, batch_size=64))


CHECKPOINT_CHOICES = {'best_mode': ('min', 'max')}


def checkpoint_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      every=1000, keep=3, best_metric='bleu', best_mode='max',
      async_save=True))


def distributed_defaults() -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      coordinator_address='', num_processes=0, process_id=-1,
      # Where process 0's coordinator listens (host:port); '' takes
      # JAX_COORDINATOR_BIND_ADDRESS, else the interface the coordinator
      # address names (parallel/cluster.py `listen_address`).
      coordinator_bind_address='',
      initialization_timeout=300, heartbeat_timeout=60,
      # Longer than process 0's work after training (the final report), or
      # the others fail at the exit barrier.
      shutdown_timeout=300))


def default_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.task = 'translation'  # translation | classification | regression | language_model
  c.seed = 0
  c.model = model_config.to_config_dict(model_config.ModelConfig())
  c.data = default_data_config()
  # A jaxformer export (`jaxformer import`, `export`, `average`) to start
  # from: its parameters, model and tokenizers (fine-tuning); '': a fresh
  # model. A resumed run continues from its own checkpoint.
  c.init = ml_collections.ConfigDict(dict(pretrained=''))
  c.train = train_defaults()
  c.mesh = ml_collections.ConfigDict(dict(
      data=-1, fsdp=1, tensor=1,  # within one slice
      dcn_data=1,  # slices the data axis spans (docs/pods.md)
      axis_rules=[list(rule) for rule in mesh_lib.DEFAULT_AXIS_RULES],
  ))
  c.eval = eval_defaults()
  c.decode = decode_defaults()
  c.checkpoint = checkpoint_defaults()
  c.distributed = distributed_defaults()
  return c


def _within(group: str, choices: dict) -> dict:
  return {f'{group}.{key}': values for key, values in choices.items()}


# Dotted key -> the values it may take.
CHOICES = {**_within('train', TRAIN_CHOICES), 'task': tuple(TASKS),
           **_within('checkpoint', CHECKPOINT_CHOICES),
           **_within('eval', EVAL_CHOICES), **_within('data', DATA_CHOICES)}
