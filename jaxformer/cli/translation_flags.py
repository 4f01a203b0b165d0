"""The flags of `translate` and `evaluate` that steer what a translation
holds and which models decode it: a target prefix (`--target-prefix`,
`--target-prefix-file`), terminology (`--constraints`), an ensemble
(`--ensemble`); any of them together, to stdout or with --output."""
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
      'per line (an empty line: none)')
  p.add_argument(
      '--constraints', type=path, default=None, metavar='FILE',
      help='a file with the target phrases each input line\'s translation '
      'must contain, tab-separated, one line per input line (an empty '
      'line: none): lexically constrained beam search (dynamic beam '
      'allocation), after the target prefix if one is given')


def _per_line(file: str | None, flag: str):
  """A `translator.PerLine` of `file`'s lines, None without it."""
  if not file:
    return None
  if not paths.exists(file):
    raise FileNotFoundError(f'{flag} {file}: no such file.')
  from jaxformer.inference import translator
  return translator.PerLine(flag, paths.read_text(file).splitlines())


def per_line(args) -> dict:
  """{'prefixes', 'constraints'}: the per-line files of --target-prefix-file
  and --constraints (`translator.PerLine`, None where not given), read
  before any model loads."""
  return dict(
      prefixes=_per_line(args.target_prefix_file, '--target-prefix-file'),
      constraints=_per_line(args.constraints, '--constraints'))


def add_ensemble_arg(p) -> None:
  p.add_argument(
      '--ensemble', action='append', type=path, default=[],
      metavar='WORKDIR', help='another model (a training workdir or an '
      'export) of the same target vocabulary to decode with, averaging the '
      'models\' log-probabilities at each step; repeat for more (their '
      'latest checkpoints; --weights and the overrides apply to each)')


def members(args, overrides, load) -> list:
  """The model of --workdir and those of each --ensemble, loaded by
  `load(args, overrides)`, their target vocabularies checked."""
  loaded = [load(args, overrides)]
  for workdir in args.ensemble:
    loaded.append(load(argparse.Namespace(
        **dict(vars(args), workdir=workdir, checkpoint=None)), overrides))
  if len(loaded) > 1:
    from jaxformer.inference import ensemble as ensemble_lib
    ensemble_lib.check_same_target(
        [args.workdir, *args.ensemble], [m.target_tok for m in loaded],
        [m.model_config for m in loaded])
  return loaded


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
