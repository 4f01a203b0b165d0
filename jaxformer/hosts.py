"""What the processes of a multi-host run agree on, and how they find out
that one of them is gone.

Values pass through the distributed runtime's key-value store (the
coordinator, process 0): a process waits for a value with a deadline
instead of polling files, and no program is compiled for it. Each function
here is called by every process, in the same order; with one process (or
no runtime) they return at once.
"""
import secrets
import sys
import threading
import time

import jax

from jaxformer import paths

PROBE = '.shared-workdir-probe'

_agreed: dict[str, str] = {}


def _client():
  from jax._src import distributed  # The runtime's client (as Orbax uses it).
  return distributed.global_state.client


def _several() -> bool:
  return jax.process_count() > 1 and _client() is not None


def from_process_0(name: str, compute, timeout_seconds: float) -> str:
  """Process 0's `compute()` (a string), on every process; the others never
  call `compute`. `name` must be the same on every process; it is agreed
  once per run (later calls return the first value)."""
  if name in _agreed:
    return _agreed[name]
  if not _several():
    value = compute()
  elif jax.process_index() == 0:
    value = compute()
    _client().key_value_set(f'jaxformer/{name}', value)
  else:
    value = _client().blocking_key_value_get(
        f'jaxformer/{name}', int(timeout_seconds * 1000))
  _agreed[name] = value
  return value


def from_every_process(name: str, value: str,
                       timeout_seconds: float) -> list[str]:
  """[processes] every process's `value` of `name`, in process order."""
  if not _several():
    return [value]
  client = _client()
  client.key_value_set(f'jaxformer/{name}/{jax.process_index()}', value)
  return [client.blocking_key_value_get(f'jaxformer/{name}/{p}',
                                        int(timeout_seconds * 1000))
          for p in range(jax.process_count())]


class NotSharedError(RuntimeError):
  """The processes of a run see different workdirs."""


def check_shared_workdir(workdir: str, timeout_seconds: float = 120,
                         read_seconds: float = 5) -> None:
  """Raises on every process unless all of them see process 0's `workdir`:
  process 0 writes a random token into WORKDIR/.shared-workdir-probe, the
  others read it back (for up to `read_seconds`, for file systems that show
  a new file late), and all learn every process's verdict."""
  if not _several():
    return
  probe = paths.join(paths.absolute(workdir), PROBE)

  def write_token() -> str:
    token = secrets.token_hex(16)
    paths.write_text(probe, token)
    return token

  token = from_process_0('workdir_probe', write_token, timeout_seconds)
  verdict = 'ok' if jax.process_index() == 0 else _read_probe(
      probe, token, read_seconds)
  verdicts = from_every_process('workdir_probe_verdict', verdict,
                                timeout_seconds)
  failed = {p: v for p, v in enumerate(verdicts) if v != 'ok'}
  if failed:
    who = '; '.join(f'process {p} {v}' for p, v in failed.items())
    raise NotSharedError(
        f'The workdir {workdir} must be shared by all {len(verdicts)} '
        f'processes (a gs:// bucket or a shared file system): {who}.')


def _read_probe(probe: str, token: str, read_seconds: float) -> str:
  deadline = time.monotonic() + read_seconds
  while True:
    try:
      seen = paths.read_text(probe).strip()
    except (FileNotFoundError, OSError):
      seen = None
    if seen == token:
      return 'ok'
    if time.monotonic() > deadline:
      return ('does not see the probe file process 0 wrote there'
              if seen is None else
              'sees another probe token there (another run or a stale copy)')
    time.sleep(0.2)


def dead_processes(timeout_seconds: float) -> list[int] | None:
  """The processes that the runtime no longer counts as alive (their
  heartbeats stopped), asked of the coordinator together with the other
  survivors ([0] when the coordinator, process 0, cannot be reached); None
  when no answer came within `timeout_seconds` (a survivor still busy
  elsewhere)."""
  if not _several():
    return []
  result = []

  def ask():
    every = list(range(jax.process_count()))
    try:
      live = _client().get_live_nodes(every)
    except Exception:  # pylint: disable=broad-except
      result.append([0])  # Every other process still reaches it.
      return
    result.append([p for p in every if p not in live])

  thread = threading.Thread(target=ask, daemon=True)
  thread.start()
  thread.join(timeout_seconds)
  return result[0] if result else None


def report_dead_processes(timeout_seconds: float) -> None:
  """After an error in a multi-process run: one line naming the processes
  that died, when that is why this one stopped."""
  dead = dead_processes(timeout_seconds)
  if dead:
    names = ', '.join(map(str, dead))
    print(f'jaxformer: process {names} of {jax.process_count()} died (no '
          f'heartbeat), so process {jax.process_index()} stops too; restart '
          'all processes to resume from the latest checkpoint.',
          file=sys.stderr, flush=True)
