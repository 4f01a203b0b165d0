"""--input of the commands that read sentences, texts or prompts: a file or
a glob of them (plain or .gz, local or gs://), or stdin."""
import sys

from jaxformer.cli.arguments import path
from jaxformer.storage import paths


def input_files(pattern: str) -> list[str]:
  """The files of --input: a file, or a glob's files in name order."""
  files = paths.matching_files(pattern)
  if not files or not paths.exists(files[0]):
    raise FileNotFoundError(f'--input {pattern}: no such file; name a file '
                            'of one sentence a line, or a glob of them')
  return files


def input_lines(args):
  """The lines of --input (or stdin) as text, decoded as --invalid-utf8 says."""
  from jaxformer.data import sources
  from jaxformer.inference import bulk
  if args.input:
    return bulk.read_lines(input_files(args.input), args.invalid_utf8)
  # A text stream without .buffer (an embedding program's) re-encoded.
  stream = getattr(sys.stdin, 'buffer', None) or (
      line.encode('utf-8', 'surrogateescape') for line in sys.stdin)
  return sources.decode_lines(
      stream, '<stdin>',
      'replace' if args.invalid_utf8 == 'replace' else 'strict',
      fix=bulk.UTF8_FIX)


def add_input_args(p, what: str, default: str = 'stdin') -> None:
  p.add_argument('--input', type=path, help=f'a file of {what}, one per '
                 'line, or a glob of such files (read in name order); '
                 f'plain or .gz, local or gs:// (default: {default}); UTF-8')
  p.add_argument('--invalid-utf8', choices=('error', 'replace'),
                 default='error', help='on a line that is not UTF-8: stop '
                 'with an error naming it (default), or replace the '
                 'undecodable bytes with U+FFFD')
