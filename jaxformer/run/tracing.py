"""`train.profile_steps=A:B`: a `jax.profiler` trace of steps A to B in
`<workdir>/profile/` (`.xplane.pb` for TensorBoard's profile plugin,
`perfetto_trace.json.gz` for Perfetto), on process 0 or, with
`train.profile_all_hosts`, on every process."""
import jax

from jaxformer.config import ranges
from jaxformer.storage import paths


class StepTrace:
  """Starts the trace before step A is dispatched and stops it once step B
  has run; does nothing without `profile_steps`."""

  def __init__(self, train, workdir: str):
    """train: the `train.*` config."""
    steps = ranges.step_span(train.profile_steps)
    wanted = train.profile_all_hosts or jax.process_index() == 0
    self.first, self.last = steps if steps and wanted else (0, 0)
    self.directory = paths.join(workdir, 'profile')
    self.active = False

  def before(self, step: int) -> None:
    if self.first <= step <= self.last and not self.active:
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
      self.active = True

  def after(self, step: int, outputs) -> None:
    if self.active and step >= self.last:
      self.stop(outputs)

  def stop(self, outputs=None) -> None:
    """Ends the trace (if on) once `outputs` are computed."""
    if self.active:
      jax.block_until_ready(outputs)
      jax.profiler.stop_trace()
      self.active = False
