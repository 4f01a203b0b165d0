"""Parameters-only exports (`jaxformer average`, `export --format
jaxformer`, `import`): write one, recognise one, read one; and the mean of a
run's checkpoints. Like checkpoint.py, it knows only Orbax and `paths`."""
import copy

import jax
import orbax.checkpoint as ocp

from jaxformer.checkpoints.manager import (Checkpointer, CheckpointError,
                                  make_workdir, short_error)
from jaxformer.storage import paths

EXPORT_FORMAT = 'jaxformer-params-1'
# Config keys that name places on the machine that made a run (a group
# stands for each of its keys): an export keeps them only when asked
# (keep_provenance), like the workdir or folder it came from ('source').
MACHINE_KEYS = ('data.tsv', 'data.files', 'data.text', 'data.tfds.data_dir',
                'data.token_cache_dir', 'data.tokenizer.model_path',
                'data.tokenizer.source_model_path',
                'data.tokenizer.target_model_path', 'init.pretrained',
                'distributed.coordinator_address')


def _emptied(value, empty):
  if isinstance(value, dict):
    return {k: _emptied(v, empty) for k, v in value.items()}
  return empty if isinstance(value, str) else value


def _empty_machine_keys(config: dict, keys) -> None:
  for key in keys:
    *groups, name = key.split('.')
    node = config
    for group in groups:
      node = node.get(group) if isinstance(node, dict) else None
    if isinstance(node, dict) and name in node:
      node[name] = _emptied(node[name],
                            None if key == 'data.tfds.data_dir' else '')


def without_machine_paths(config: dict) -> dict:
  """The JSON `config` with every string under MACHINE_KEYS emptied (''; None
  for data.tfds.data_dir, its default), in `data` and in each source of
  `data.mixture` (whose groups are data's)."""
  config = copy.deepcopy(config)
  _empty_machine_keys(config, MACHINE_KEYS)
  data_keys = [key for key in MACHINE_KEYS if key.startswith('data.')]
  mixture = (config.get('data') or {}).get('mixture') or {}
  for source in mixture.get('sources') or []:
    if isinstance(source, dict):
      _empty_machine_keys({'data': source}, data_keys)
  return config


def _composite_checkpointer():
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def export_params(out: str, params, extra: dict,
                  keep_provenance: bool = False) -> None:
  """Writes `params` with the config and tokenizers of `extra` to `out`,
  which must not exist yet; the paths of the machine that made it (its
  'source' and the config's MACHINE_KEYS) only with `keep_provenance`."""
  out = paths.absolute(out)
  if paths.exists(out):
    raise CheckpointError(f'{out} already exists; choose another --out, or '
                          'remove it first.')
  make_workdir(paths.parent(out))
  contents = {'format': EXPORT_FORMAT, 'config': extra['config'],
              'tokenizers': extra['tokenizers'],
              'weights': extra.get('weights', 'raw'),
              'steps': extra.get('steps', [extra.get('step')]),
              'source': extra.get('source', '')}
  if not keep_provenance:
    contents.update(config=without_machine_paths(extra['config']), source='')
  try:
    _composite_checkpointer().save(out, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        extra=ocp.args.JsonSave(contents)))
  except Exception as e:
    raise CheckpointError(f'Writing the export {out} failed '
                          f'({short_error(e)}).') from e
  if not keep_provenance:
    _commit_markers_without_paths(out)


COMMIT_MARKER = 'commit_success.txt'


def _commit_markers_without_paths(out: str) -> None:
  """Orbax's commit markers (of the export and of each item) say the path
  they were written to; they say only that the commit succeeded (Orbax
  reads their presence, not their words)."""
  for folder in (out, paths.join(out, 'params'), paths.join(out, 'extra')):
    marker = paths.join(folder, COMMIT_MARKER)
    if paths.exists(marker):
      paths.write_text(marker, 'Checkpoint commit was successful.')


def is_export(directory: str) -> bool:
  return (paths.is_dir(paths.join(directory, 'params'))
          and paths.is_dir(paths.join(directory, 'extra'))
          and not paths.is_dir(paths.join(directory, 'checkpoints')))


def restore_export(directory: str, abstract_params=None):
  """(extra, params) of the export in `directory`: its JSON item (format,
  config, tokenizers, steps, source) and, given `abstract_params` (a
  function of that extra returning ShapeDtypeStructs with shardings), the
  parameters placed so; else params is None."""
  checkpointer = _composite_checkpointer()
  extra = checkpointer.restore(directory, args=ocp.args.Composite(
      extra=ocp.args.JsonRestore()))['extra']
  if extra.get('format') != EXPORT_FORMAT:
    raise CheckpointError(f'{directory} is not a jaxformer export (format '
                          f'{extra.get("format")!r}, expected '
                          f'{EXPORT_FORMAT!r}).')
  if abstract_params is None:
    return extra, None
  params = checkpointer.restore(directory, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(abstract_params(extra))))['params']
  return extra, params


def param_shapes(directory: str) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
  """The shape and dtype of each parameter of the export in `directory`,
  by its path of names (from its metadata; no array is read)."""
  metadata = ocp.Checkpointer(ocp.StandardCheckpointHandler()).metadata(
      paths.join(directory, 'params'))
  tree = getattr(metadata, 'item_metadata', metadata)
  return {tuple(key.key for key in path): jax.ShapeDtypeStruct(leaf.shape,
                                                               leaf.dtype)
          for path, leaf in jax.tree_util.tree_leaves_with_path(tree)}


def running_mean(mean, params, count: int):
  """The mean of `count` trees given that of the first count - 1, in their
  dtypes (a quantized frozen kernel stays integer). Exact when all are
  equal."""
  return jax.tree.map(lambda m, p: (m + (p - m) / count).astype(m.dtype),
                      mean, params)


def mean_params(reader: Checkpointer, steps: list[int], abstract_params,
                read_params=None):
  """The mean parameters of `steps` (read one at a time by `reader`, a
  `Checkpointer.reader`, or by `read_params(step)` if given), placed as
  `abstract_params` says."""
  read_params = read_params or (
      lambda s: reader.restore_params(s, abstract_params))
  mean = None
  for count, step in enumerate(steps, start=1):
    params = read_step(reader, step, read_params)
    mean = params if mean is None else running_mean(mean, params, count)
  return mean


def steps_to_average(reader: Checkpointer, last: int) -> list[int]:
  """The newest `last` steps of `reader`; raises if it holds fewer."""
  if last < 1:
    raise ValueError(f'--last must be at least 1, got {last}.')
  steps = reader.all_steps()
  if len(steps) < last:
    raise CheckpointError(
        f'{reader.directory} holds {len(steps)} checkpoints {steps}, fewer '
        f'than --last={last}; lower --last, or train with a larger '
        'checkpoint.keep.')
  return steps[-last:]


def step_to_export(reader: Checkpointer, step: int | None) -> int:
  """`step` (default: the latest) if `reader` holds it; raises if not."""
  steps = reader.all_steps()
  if not steps:
    raise CheckpointError(f'{reader.directory} holds no checkpoint; train '
                          'first or check the --workdir.')
  step = steps[-1] if step is None else step
  if step not in steps:
    raise CheckpointError(f'No checkpoint of step {step} in '
                          f'{reader.directory}; there are {steps}.')
  return step


def read_step(reader: Checkpointer, step: int, read):
  try:
    return read(step)
  except CheckpointError:
    raise  # Says already what is wrong (a base export that changed).
  except Exception as e:  # Orbax raises many types for damaged files.
    raise CheckpointError(
        f'Checkpoint {reader.step_directory(step)} cannot be read '
        f'({short_error(e)}); choose other steps.') from e
