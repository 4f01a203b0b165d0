"""The `jaxformer` command: its parser, which runs one command (in
train_commands, model_commands and export_commands), and how the program
ends."""
import argparse
import os
import sys
import traceback

from jaxformer.cli import (exiting, export_commands, model_commands,
                           plot_commands, train_commands)
from jaxformer.cli.arguments import USAGE_OVERRIDES
from jaxformer.runtime import library_logs
from jaxformer.storage import errors, paths


def _split_overrides(argv):
  overrides = [a for a in argv if a.startswith('--config.')]
  rest = [a for a in argv if not a.startswith('--config.')]
  return rest, overrides


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='jaxformer', description='Train and use Transformers with JAX.',
      epilog=USAGE_OVERRIDES)
  commands = parser.add_subparsers(dest='command', required=True)

  train_commands.add_train(commands)
  model_commands.add_parsers(commands)
  plot_commands.add_parsers(commands)
  export_commands.add_parsers(commands)
  train_commands.add_compile(commands)
  return parser


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  rest, overrides = _split_overrides(argv)
  args = build_parser().parse_args(rest)
  if overrides and args.command in ('curves', 'average', 'export', 'import'):
    print(f'--config.* overrides apply to the commands that read a config, '
          f'not to `jaxformer {args.command}`.', file=sys.stderr)
    return 2
  cache = None
  try:
    if args.command not in ('curves', 'average', 'export'):
      from jaxformer.runtime import compilation_cache
      cache = compilation_cache.enable(  # Before anything compiles.
          jax_cache=args.command != 'compile')
      if args.command in ('train', 'compile'):
        print(f'jaxformer: compilation cache: {cache or "off"} '
              f'({compilation_cache.ENV}=DIR or off)', flush=True)
    status = args.run(args, overrides)
    if cache and args.command == 'train':
      print(f'jaxformer: {compilation_cache.summary()}', flush=True)
    return status
  except Exception as e:
    # jaxformer's own kinds of error (storage/errors.py), and what the
    # libraries below raise for bad input or storage.
    if os.environ.get('JAXFORMER_DEBUG') or not (
        isinstance(e, (errors.JaxformerError, ValueError, RuntimeError))
        or paths.is_storage_error(e)):
      raise
    print(f'jaxformer {args.command}: error: {exiting.error_line(e)}',
          file=sys.stderr)
    return 1


def run() -> None:
  """The `jaxformer` program (pyproject's entry point): main, then
  exit_process; an unexpected exception is printed with its traceback.
  Other libraries' own lines stay off stderr (before JAX starts)."""
  if not os.environ.get('JAXFORMER_DEBUG'):
    exiting.quiet_library_errors()
    library_logs.quiet()
  try:
    code = main()
  except SystemExit as e:  # argparse's usage errors, --help.
    code = e.code if isinstance(e.code, int) else (e.code is not None)
  except KeyboardInterrupt:
    print('jaxformer: interrupted', file=sys.stderr)
    code = 130
  except BaseException:  # A bug: its traceback is the useful report.
    traceback.print_exc()
    code = 1
  exiting.exit_process(code)


if __name__ == '__main__':
  run()
