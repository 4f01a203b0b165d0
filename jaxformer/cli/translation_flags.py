"""The flags of `translate` and `evaluate` that steer what a translation
holds and which models decode it: a target prefix (`--target-prefix`,
`--target-prefix-file`), terminology (`--constraints`), an ensemble
(`--ensemble`)."""
import argparse

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
  prefix.add_argument(
      '--constraints', type=path, default=None, metavar='FILE',
      help='a file with the target phrases each input line\'s translation '
      'must contain, tab-separated, one line per input line (an empty '
      'line: none): lexically constrained beam search (dynamic beam '
      'allocation); not with --output or --ensemble')


def constraints(args) -> dict:
  """{'constraints': the lines of --constraints} for `translate`'s
  settings, {} without it."""
  if not args.constraints:
    return {}
  if args.output or args.ensemble:
    raise ValueError('--constraints with --output or --ensemble: translate '
                     'to stdout with one model under constraints.')
  return {'constraints': _lines(args.constraints, '--constraints')}


def _lines(file: str, flag: str) -> list[str]:
  if not paths.exists(file):
    raise FileNotFoundError(f'{flag} {file}: no such file.')
  return paths.read_text(file).splitlines()


def prefixes(args):
  """The target prefix of each input line (a list of texts), of all of
  them (one text), or None for none."""
  if args.target_prefix_file:
    if args.output:
      raise ValueError('--target-prefix-file with --output: give one '
                       '--target-prefix for the whole corpus, or translate '
                       'without --output.')
    return _lines(args.target_prefix_file, '--target-prefix-file')
  return args.target_prefix or None


def add_ensemble_arg(p) -> None:
  p.add_argument(
      '--ensemble', action='append', type=path, default=[],
      metavar='WORKDIR', help='another model (a training workdir or an '
      'export) of the same target vocabulary to decode with, averaging the '
      'models\' log-probabilities at each step; repeat for more (their '
      'latest checkpoints; --weights and the overrides apply to each)')


def ensemble(args, overrides, load) -> list:
  """The models of --workdir and of each --ensemble, loaded by
  `load(args, overrides)`, their target vocabularies checked; [] without
  --ensemble."""
  if not args.ensemble:
    return []
  if getattr(args, 'output', None):
    raise ValueError('--ensemble with --output: translate to stdout (or '
                     'evaluate) with an ensemble; bulk decoding takes one '
                     'model.')
  from jaxformer.inference import ensemble as ensemble_lib
  members = [load(args, overrides)]
  for workdir in args.ensemble:
    members.append(load(argparse.Namespace(
        **dict(vars(args), workdir=workdir, checkpoint=None)), overrides))
  ensemble_lib.check_same_target(
      [args.workdir, *args.ensemble], [m.target_tok for m in members],
      [m.model_config for m in members])
  return members


def ensemble_report(args) -> dict:
  """What `evaluate`'s JSON says of an ensemble."""
  return {'ensemble': [args.workdir, *args.ensemble]} if args.ensemble else {}


def add_comet_arg(p) -> None:
  p.add_argument(
      '--comet', type=path, default=None, metavar='DIR',
      help='also score the translations with the COMET checkpoint folder DIR '
      '(as Unbabel\'s comet saves it: hparams.yaml, checkpoints/model.ckpt; '
      'its pretrained_model a local folder with the encoder\'s config.json '
      'and tokenizer), run in JAX: sentence and system scores in the JSON')


def comet_model(args):
  """The --comet model (read before any decoding, so that a folder that
  is not one fails at once), or None."""
  if not args.comet:
    return None
  from jaxformer.interop import comet
  return comet.load(args.comet)


def comet_report(model, data_config, split: str, hypotheses) -> dict:
  """{'comet': the system score, 'comet_sentences': one per line, and the
  model's kind} of `split`'s translations; {} without --comet."""
  if model is None:
    return {}
  from jaxformer.data import sources
  from jaxformer.interop import comet_scores
  pairs = sources.read_split(data_config, split)[:len(hypotheses)]
  report = comet_scores.corpus_report(
      model, [source for source, _ in pairs], hypotheses,
      [target for _, target in pairs])
  return dict(report, comet_model=model.kind)
