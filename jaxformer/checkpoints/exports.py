"""Parameters-only exports (`jaxformer average`, `export --format
jaxformer`, `import`): write one, recognise one, read one; and the mean of a
run's checkpoints. Like checkpoint.py, it knows only Orbax and `paths`."""
import jax
import orbax.checkpoint as ocp

from jaxformer.checkpoints.manager import (Checkpointer, CheckpointError,
                                  make_workdir, short_error)
from jaxformer.storage import paths

EXPORT_FORMAT = 'jaxformer-params-1'


def _composite_checkpointer():
  return ocp.Checkpointer(ocp.CompositeCheckpointHandler())


def export_params(out: str, params, extra: dict) -> None:
  """Writes `params` with the config and tokenizers of `extra` to `out`,
  which must not exist yet."""
  out = paths.absolute(out)
  if paths.exists(out):
    raise CheckpointError(f'{out} already exists; choose another --out, or '
                          'remove it first.')
  make_workdir(paths.parent(out))
  contents = {'format': EXPORT_FORMAT, 'config': extra['config'],
              'tokenizers': extra['tokenizers'],
              'steps': extra.get('steps', [extra.get('step')]),
              'source': extra.get('source', '')}
  try:
    _composite_checkpointer().save(out, args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        extra=ocp.args.JsonSave(contents)))
  except Exception as e:
    raise CheckpointError(f'Writing the export {out} failed '
                          f'({short_error(e)}).') from e


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


def running_mean(mean, params, count: int):
  """The mean of `count` trees given that of the first count - 1. Exact
  when all are equal."""
  return jax.tree.map(lambda m, p: m + (p - m) / count, mean, params)


def mean_params(reader: Checkpointer, steps: list[int], abstract_params):
  """The mean parameters of `steps` (read one at a time by `reader`, a
  `Checkpointer.reader`), placed as `abstract_params` says."""
  mean = None
  for count, step in enumerate(steps, start=1):
    params = read_step(reader, step,
                        lambda s: reader.restore_params(s, abstract_params))
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
  except Exception as e:  # Orbax raises many types for damaged files.
    raise CheckpointError(
        f'Checkpoint {reader.step_directory(step)} cannot be read '
        f'({short_error(e)}); choose other steps.') from e
