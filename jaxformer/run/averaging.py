"""`eval.average_last`: after training, the mean parameters of the last
checkpoints, evaluated, logged and exported for `jaxformer translate`."""
from collections.abc import Callable

import jax

from jaxformer.checkpoints import exports
from jaxformer.checkpoints import manager as checkpoint_lib
from jaxformer.run.metrics import MetricsWriter
from jaxformer.storage import paths
from jaxformer.train import frozen_base
from jaxformer.train.state import TrainState


def averaged(state: TrainState, step: int, last: int,
             checkpoints: checkpoint_lib.Checkpointer, workdir: str,
             evaluate: Callable[[TrainState], dict], writer: MetricsWriter,
             log: Callable[[str], None]) -> TrainState:
  """`state` with the mean parameters of the `last` newest checkpoints (the
  final one included), evaluated, written as `eval_average_*` metrics of
  `step` and exported to WORKDIR/average_<first>-<last>."""
  steps = checkpoints.all_steps()[-last:]
  if len(steps) < 2:
    log(f'Only the checkpoint of step {steps} exists: nothing to average.')
    return state
  # A frozen base is the same in every step: only what trains is averaged.
  trainable, frozen = frozen_base.split(state.params)
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
      trainable)
  reader = checkpoint_lib.Checkpointer.reader(workdir)
  state = state.replace(params=frozen_base.merge(
      exports.mean_params(reader, steps, abstract), frozen))
  metrics = evaluate(state)
  writer.write(step, metrics, prefix='eval_average_')
  out = paths.join(workdir, f'average_{steps[0]}-{steps[-1]}')
  if not paths.exists(out):
    exports.export_params(out, state.params, dict(
        checkpoints.extra, steps=steps, source=checkpoints.directory))
  log(f'Averaged the checkpoints of steps {steps} (exported to {out}): '
      + ' '.join(f'eval_{k}={v:.4g}' for k, v in metrics.items()))
  return state
