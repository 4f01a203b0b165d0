"""How a `jaxformer` command that failed reports it and ends: one error
line, then an exit that no library's thread can hold up."""
import logging
import os
import sys

from jaxformer.runtime import stop_clock
from jaxformer.storage import errors


def error_line(error: BaseException) -> str:
  """One line saying what failed: jaxformer's own messages whole, another
  library's storage error by its type and first line."""
  if isinstance(error, (errors.JaxformerError, ValueError, RuntimeError,
                        FileNotFoundError)):
    return str(error)
  lines = str(error).strip().splitlines() or ['']
  return f'{type(error).__name__}: {lines[0][:300]}'


def exit_process(code: int) -> None:
  """Ends the process with `code`; after a failure, at once.

  An error can leave threads that would keep a failed run alive for many
  minutes, or for good: an Orbax save still writing, TensorStore's and
  gcsfs's retries against storage that is gone, the exit hooks that wait
  for them (and for the other hosts). So once the error is printed and the
  output flushed, a non-zero exit skips them (os._exit); the other hosts
  of a multi-host run stop at their next collective or heartbeat."""
  if code == 0:
    if stop_clock.bounded():  # A stop's checkpoint is committed.
      stop_clock.leave_without_exit_hooks()
    stop_clock.phase('exit hooks (the runtime, Orbax, tf.data threads)')
    sys.exit(0)
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except (OSError, ValueError):  # A closed pipe: nothing more to say.
      pass
  os._exit(code)


class _WithoutOrbaxErrors(logging.Filter):
  """Drops Orbax's error logs (each with a traceback): the error they log
  reaches the command, which reports it in one line."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno < logging.ERROR:
      return True
    frame = sys._getframe(1)  # The logging call is below: who made it?
    while frame is not None:
      if f'{os.sep}orbax{os.sep}' in frame.f_code.co_filename:
        return False
      frame = frame.f_back
    return True


def quiet_library_errors() -> None:
  """Leaves a failure's report to `error_line`: no Orbax error logs, no
  closed-event-loop callbacks (tracebacks that repeat it)."""
  logging.getLogger('absl').addFilter(_WithoutOrbaxErrors())
  sys.unraisablehook = _closed_loop_callbacks_ignored(sys.unraisablehook)


def _closed_loop_callbacks_ignored(report):
  """sys.unraisablehook without the errors of the callbacks that
  TensorStore's writes, still finishing after a failed save, send to the
  event loop Orbax closed on the failure (a traceback each)."""
  def hook(unraisable):
    if (unraisable.exc_type is RuntimeError
        and str(unraisable.exc_value) == 'Event loop is closed'):
      return
    report(unraisable)
  return hook
