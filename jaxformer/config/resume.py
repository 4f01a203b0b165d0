"""Which config changes a run may resume with: the policy that
`jaxformer train` applies to the config and data order saved with its
newest checkpoint, and that the commands apply to their overrides of a
trained model's config. `checkpoints/manager.py` only reads and writes.
"""
import dataclasses
import json
import sys

import ml_collections

from jaxformer.checkpoints.manager import Checkpointer, CheckpointError
from jaxformer.data import defaults as data_defaults
from jaxformer.model import config as model_config_lib
from jaxformer.storage import paths

# Keys that may change when a run resumes; everything else must match.
RESUMABLE_CHANGES = ('train.', 'eval.', 'checkpoint.', 'decode.', 'init.',
                     'distributed.', 'mesh.', 'data.tokenizer.wait_seconds',
                     'data.allow_new_data_order',
                     'data.tsv.', 'data.files.', 'data.tfds.data_dir',
                     'data.tokenize_workers', 'data.token_cache_piece_bytes',
                     *(f'data.{kind}.{split}' for kind in ('jsonl', 'parquet')
                       for split in ('train', 'dev', 'test')),
                     'data.source_lang', 'data.target_lang',
                     'seed')

# Resumable keys that still change the layout of the saved state: the RNG
# key's implementation, and clipping or weight decay switched on or off.
STATE_LAYOUT = {'train.prng_impl': str, 'train.grad_clip_norm': bool,
                'train.weight_decay': bool}


def _flatten(config: dict, prefix: str = '') -> dict[str, object]:
  flat = {}
  for key, value in config.items():
    if isinstance(value, dict):
      flat.update(_flatten(value, f'{prefix}{key}.'))
    else:
      flat[f'{prefix}{key}'] = value
  return flat


def incompatible_keys(saved: dict, current: dict, defaults: dict | None = None
                      ) -> list[str]:
  """Config keys whose change would make the saved state unusable.

  `defaults`: values of keys that a config saved by an older jaxformer
  lacks (options added since, whose defaults behave as before).
  """
  a, b = _flatten(saved), _flatten(current)
  a = {**{k: v for k, v in _flatten(defaults or {}).items() if k in b}, **a}
  changed = [k for k in sorted(set(a) | set(b))
             if not _same(a.get(k), b.get(k))]
  return [k for k in changed if not k.startswith(RESUMABLE_CHANGES)
          or (k in STATE_LAYOUT
              and STATE_LAYOUT[k](a.get(k)) != STATE_LAYOUT[k](b.get(k)))]


def _same(saved, current) -> bool:
  """Equal values, or a relative path that a config saved before paths were
  made absolute at loading (config/path_keys.py) now made absolute."""
  return json.dumps(saved) == json.dumps(current) or (
      isinstance(saved, str) and bool(saved)
      and paths.absolute(saved) == current)


def option_defaults() -> dict:
  """The model and data options with their defaults: what a config saved
  before an option existed is taken to hold (see `incompatible_keys`)."""
  return dict(model=dataclasses.asdict(model_config_lib.ModelConfig()),
              data=data_defaults.default_data_config().to_dict())


def check_compatible(checkpoints: Checkpointer,
                     config: ml_collections.ConfigDict,
                     defaults: dict | None = None) -> None:
  """Raises if the newest readable checkpoint was made with a config whose
  model or data differ from `config` (see `incompatible_keys`)."""
  saved = (checkpoints.newest_extra() or {}).get('config')
  if saved is None:
    return
  current = json.loads(config.to_json_best_effort())
  keys = incompatible_keys(saved, current, defaults)
  if keys:
    details = '; '.join(f'{k}: saved {_flatten(saved).get(k)!r}, now '
                        f'{_flatten(current).get(k)!r}' for k in keys)
    raise CheckpointError(
        f'The checkpoints in {checkpoints.directory} were made with a '
        f'different config ({details}). Use another --workdir, or undo '
        'these changes (train.*, eval.*, checkpoint.* and decode.* may '
        'change on resume, except train.prng_impl and switching '
        'train.grad_clip_norm or train.weight_decay between 0 and non-zero).')


def _row_layout(order: dict) -> str:
  return (f"multiples of {order['row_multiple']} rows ({order['row_shards']} "
          f"row shards (mesh.data x mesh.fsdp) x {order['grad_accum_steps']} "
          'train.grad_accum_steps)')


def use_data_order(checkpoints: Checkpointer, order: dict,
                   allow_change: bool) -> None:
  """Saves `order` (what the order of training examples depends on, see
  `data/task_batches.py` `data_order`) with every later step. If the newest
  checkpoint was made in another order, raises, or with `allow_change` says
  so and goes on."""
  checkpoints.extra['data_order'] = order
  saved = (checkpoints.newest_extra() or {}).get('data_order')
  if not (saved and saved['batching'] == order['batching'] == 'bucket'
          and saved['row_multiple'] != order['row_multiple']):
    return  # A change of batching is a config change: check_compatible.
  change = (f"The checkpoints in {checkpoints.directory} were made with "
            f"'bucket' batches of {_row_layout(saved)}, this run makes "
            f'{_row_layout(order)}, which changes the examples of every '
            'later batch')
  if not allow_change:
    raise CheckpointError(
        f'{change}. Resume with the saved mesh and grad_accum_steps (or '
        'any with the same product), or pass '
        '--config.data.allow_new_data_order=true to go on in the new order.')
  print(f'WARNING: {change}; going on in the new order '
        '(data.allow_new_data_order=true).', file=sys.stderr, flush=True)
