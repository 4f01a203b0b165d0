"""The flags of `translate` that steer what a translation holds: a target
prefix (`--target-prefix`, `--target-prefix-file`)."""
from jaxformer.cli.arguments import path
from jaxformer.storage import paths


def add_prefix_args(p) -> None:
  prefix = p.add_mutually_exclusive_group()
  prefix.add_argument(
      '--target-prefix', default=None,
      help='text every translation starts with (its tokens are forced, '
      'then the search goes on, as CTranslate2\'s target_prefix)')
  prefix.add_argument(
      '--target-prefix-file', type=path, default=None,
      help='a file with the prefix of each input line\'s translation, one '
      'per line (an empty line: none); not with --output')


def prefixes(args):
  """The target prefix of each input line (a list of texts), of all of
  them (one text), or None for none."""
  if args.target_prefix_file:
    if args.output:
      raise ValueError('--target-prefix-file with --output: give one '
                       '--target-prefix for the whole corpus, or translate '
                       'without --output.')
    if not paths.exists(args.target_prefix_file):
      raise FileNotFoundError(f'--target-prefix-file '
                              f'{args.target_prefix_file}: no such file.')
    return paths.read_text(args.target_prefix_file).splitlines()
  return args.target_prefix or None
