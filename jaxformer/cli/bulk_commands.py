"""`jaxformer translate --input FILES --output OUT` and `jaxformer generate
--input FILES --output OUT`: a corpus decoded into one file by every
process of a run (inference/bulk.py), which joins the distributed runtime
as `jaxformer train` does (the `distributed.*` settings, launch/local.sh's
variables, a pod's own)."""
import signal
import sys


def distributed_settings(overrides):
  """The `distributed` settings: the defaults with --config.distributed.*
  (the saved config's are its training's cluster, not this one)."""
  from jaxformer.config import settings as config_lib
  chosen = [o for o in overrides if o.removeprefix('--config.').startswith(
      'distributed.')]
  return config_lib.with_overrides(config_lib.default_config(),
                                   chosen).distributed


def lock_of(output: str) -> str:
  """The lock of --output OUTPUT: the hidden file (local, where it stays)
  or object (gs://, removed at the end) `.OUTPUT.lock` beside it."""
  from jaxformer.storage import paths
  return paths.join(paths.parent(output),
                    f'.{output.rstrip("/").rsplit("/", 1)[-1]}.lock')


def cmd_bulk(args, overrides, load) -> int:
  """Every process decodes its share; process 0 writes --output, which it
  holds (`lock_of`) from start to end: a second run on it is refused,
  naming this one. SIGTERM
  (in any process) commits what is done and ends every process with 0.
  load(args, overrides) -> (input files, bulk.Decoder, what the manifest
  says of the model): called once the distributed runtime is up."""
  import jax
  from jaxformer.inference import bulk
  from jaxformer.parallel import cluster, peers, run_lock
  if not args.input:
    raise ValueError('--output needs --input FILE_OR_GLOB: every process '
                     'reads the input itself, which stdin cannot give them.')
  from jaxformer.cli import input_args
  # Before the lock (`lock_of`): a refused command leaves nothing.
  bulk.check_not_an_input(input_args.input_files(args.input),
                          args.output)
  stop = bulk.Stop()

  def request_stop(signum, frame):
    del frame
    stop.request(signal.Signals(signum).name)

  previous = signal.signal(signal.SIGTERM, request_stop)
  try:
    settings = distributed_settings(overrides)
    cluster.initialize_distributed(settings)
    # The runtime's preemption notifier took SIGTERM: this command stops
    # each process on its own, and tells the others (bulk.Stop).
    signal.signal(signal.SIGTERM, request_stop)
    peers.watch_peers(settings.heartbeat_timeout)
    with run_lock.one_writer(lock_of(args.output), f'--output {args.output}'):
      files, decoder, description = load(args, overrides)
      status, progress = bulk.decode_corpus(decoder, files, args.output,
                                            description, stop)
  finally:
    signal.signal(signal.SIGTERM, previous)
  if jax.process_index() == 0:
    processes, devices = jax.process_count(), jax.local_device_count()
    layout = (f'{processes} process{"es" * (processes > 1)} x {devices} '
              f'device{"s" * (devices > 1)}')
    if status == 'done':
      print(f'{args.command}: {progress} ({layout}); wrote {args.output}',
            file=sys.stderr, flush=True)
    else:
      print(f'{args.command}: stopped ({stop.reason}) at {progress}; '
            f'committed chunks are in {args.output}.parts: run the same '
            'command again to finish.', file=sys.stderr, flush=True)
  return 0
