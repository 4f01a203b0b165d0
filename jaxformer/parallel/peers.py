"""What the processes of a multi-host run agree on, and how they learn
that one of them is gone.

Values pass through the distributed runtime's key-value store (the
coordinator, process 0): a process waits for a value with a deadline
instead of polling files, and no program is compiled for it. Each function
here is called by every process, in the same order; with one process (or
no runtime) they return at once. The store has no authentication (whoever
reaches the coordinator's port may write to it), so every value read from
it must match the form its caller gives before it is used.
"""
import atexit
import re
import secrets
import sys
import threading
import time

import jax

from jaxformer.storage import paths

PROBE = '.shared-workdir-probe'
PROBE_TOKEN = '[0-9a-f]{32}'
# What a process says of the probe (see `_read_probe`).
VERDICT = 'ok|does not see the probe file .*|sees another probe token .*'
BEAT = '[0-9]{1,12}|done'

_agreed: dict[str, str] = {}


def _client():
  from jax._src import distributed  # The runtime's client (as Orbax uses it).
  return distributed.global_state.client


def _several() -> bool:
  return jax.process_count() > 1 and _client() is not None


class StoreValueError(ValueError):
  """A value in the runtime's key-value store is not of its form."""


def checked(key: str, value: str, pattern: str) -> str:
  """`value` of the store's `key` if it matches `pattern` (a regular
  expression, whole), else a StoreValueError naming both."""
  if re.fullmatch(pattern, value):
    return value
  shown = repr(value if len(value) <= 80 else value[:80] + '...')
  raise StoreValueError(
      f"{key} from the distributed runtime's key-value store is not of the "
      f'form {pattern}: {shown}; something other than process 0 may write '
      "to the coordinator's port: close it to everything but the run's "
      'hosts (launch/README.md)')


def from_process_0(name: str, compute, timeout_seconds: float,
                   pattern: str) -> str:
  """Process 0's `compute()` (a string matching the regular expression
  `pattern`), on every process; the others never call `compute`. `name`
  must be the same on every process; it is agreed once per run (later calls
  return the first value)."""
  if name in _agreed:
    return _agreed[name]
  key = f'jaxformer/{name}'
  if not _several():
    value = compute()
  elif jax.process_index() == 0:
    value = checked(key, compute(), pattern)
    _client().key_value_set(key, value)
  else:
    value = _client().blocking_key_value_get(key, int(timeout_seconds * 1000))
  _agreed[name] = checked(key, value, pattern)
  return _agreed[name]


def from_every_process(name: str, value: str, timeout_seconds: float,
                       pattern: str) -> list[str]:
  """[processes] every process's `value` of `name` (matching `pattern`),
  in process order."""
  if not _several():
    return [value]
  client = _client()
  client.key_value_set(f'jaxformer/{name}/{jax.process_index()}', value)
  keys = [f'jaxformer/{name}/{p}' for p in range(jax.process_count())]
  return [checked(key, client.blocking_key_value_get(
      key, int(timeout_seconds * 1000)), pattern) for key in keys]


def post(name: str, value: str) -> None:
  """Sets this process's `value` of `name` (replacing its last one), for
  the others to read with `posted` whenever they look; alone: nothing."""
  if _several():
    _client().key_value_set(f'jaxformer/{name}/{jax.process_index()}', value,
                            allow_overwrite=True)


def posted(name: str, pattern: str) -> dict[int, str]:
  """{process: value} of the processes that posted `name` so far (values
  not matching `pattern` are refused); alone: {}. Does not wait."""
  if not _several():
    return {}
  found = {}
  for key, value in _client().key_value_dir_get(f'jaxformer/{name}/'):
    process = key.rsplit('/', 1)[-1]
    if re.fullmatch('[0-9]{1,6}', process):
      found[int(process)] = checked(key, value, pattern)
  return found


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

  token = from_process_0('workdir_probe', write_token, timeout_seconds,
                         PROBE_TOKEN)
  verdict = 'ok' if jax.process_index() == 0 else _read_probe(
      probe, token, read_seconds)
  verdicts = from_every_process('workdir_probe_verdict', verdict,
                                timeout_seconds, VERDICT)
  failed = {p: v for p, v in enumerate(verdicts) if v != 'ok'}
  if failed:
    # Every process has the verdicts and fails: they leave the runtime
    # together. Process 0 holds its service; exiting on its own, it would
    # end the others (a gRPC error or a fatal log) before they print this.
    jax.distributed.shutdown()
    who = '; '.join(f'process {p} {v}' for p, v in failed.items())
    raise NotSharedError(
        f'The workdir {workdir} must be shared by all {len(verdicts)} '
        f'processes (a gs:// bucket or a shared file system): {who}.')


def _read_probe(probe: str, token: str, read_seconds: float) -> str:
  deadline = time.monotonic() + read_seconds
  while True:
    try:
      seen = paths.read_text(probe).strip()
    except OSError:  # Missing, or unreadable here.
      seen = None
    if seen == token:
      return 'ok'
    if time.monotonic() > deadline:
      return ('does not see the probe file process 0 wrote there'
              if seen is None else
              'sees another probe token there (another run or a stale copy)')
    time.sleep(0.2)


def watch_peers(heartbeat_timeout: float, every: float = 1.0) -> None:
  """Names a process that dies, in one line on every other process.

  JAX's runtime ends every process `heartbeat_timeout` seconds after one
  stops sending heartbeats, from a thread of its own, with a fatal log that
  names the task inside many lines (and no Python code runs then). So a
  daemon thread here posts a beat to the key-value store every `every`
  seconds and reads all of them; a process silent for 0.4 of the timeout
  is named (the runtime may end the others as early as 0.7 of it after a
  death, measured: its own heartbeats come at intervals), and named as
  responding again if it was only stalled. A process that exits posts
  'done' and is not named, and its thread ends before the interpreter
  does: a daemon thread still inside a call of the runtime's client when
  Python finalizes is unwound through C++ and aborts the process (glibc's
  'FATAL: exception not rethrown', seen once in a 4-process run).
  """
  if not _several():
    return
  client, me = _client(), jax.process_index()
  count = jax.process_count()
  prefix = 'jaxformer/beat/'
  done, posting = threading.Event(), threading.Lock()
  silence = 0.4 * heartbeat_timeout

  def post_done():
    with posting:  # Before the runtime's exit handler waits for the others.
      done.set()
      try:
        client.key_value_set(f'{prefix}{me}', 'done', allow_overwrite=True)
      except Exception:  # pylint: disable=broad-except
        pass  # The runtime is going down already.
    thread.join(timeout=every + 10)

  def beat():
    seen: dict[int, tuple[str, float]] = {}
    named: set[int] = set()
    beats, last = 0, time.monotonic()
    while not done.wait(every):
      beats += 1
      try:
        with posting:
          if not done.is_set():
            client.key_value_set(f'{prefix}{me}', str(beats),
                                 allow_overwrite=True)
        values = client.key_value_dir_get(prefix)
      except Exception:  # pylint: disable=broad-except
        return  # The coordinator is gone: the runtime ends this process.
      now = time.monotonic()
      stalled, last = now - last > silence, now
      for key, value in values:
        process = key.rsplit('/', 1)[1]
        if not (re.fullmatch('[0-9]{1,6}', process) and int(process) < count
                and re.fullmatch(BEAT, value)):
          continue  # Not a beat of this run's processes.
        process = int(process)
        changed = process not in seen or seen[process][0] != value
        # After a stall of this thread, the others' silence is not theirs.
        if changed or stalled:
          seen[process] = (value, now)
        if changed and process in named:
          named.discard(process)
          _say(f'process {process} of {count} responds again.')
      silent = sorted(p for p, (v, t) in seen.items() if p not in named
                      and v != 'done' and now - t > silence)
      if silent:
        named.update(silent)
        _say(f'process {", ".join(map(str, silent))} of {count} stopped '
             f'responding {silence:g} s ago (dead, or stalled); if it is '
             f'dead, the runtime ends process {me} within '
             f'distributed.heartbeat_timeout={heartbeat_timeout:g} s: '
             'restart all processes to resume from the latest checkpoint.')

  thread = threading.Thread(target=beat, name='jaxformer-peers', daemon=True)
  atexit.register(post_done)
  thread.start()


def _say(text: str) -> None:
  print(f'jaxformer: {text}', file=sys.stderr, flush=True)
