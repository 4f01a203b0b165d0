"""The commands that read a config file: `jaxformer train` (and the
translation report after it) and `jaxformer compile`."""
import json
import sys

from jaxformer.cli.arguments import USAGE_OVERRIDES, path
from jaxformer.storage import paths


def cmd_train(args, overrides) -> int:
  from jaxformer.checkpoints.manager import make_workdir
  from jaxformer.config.settings import load_config
  from jaxformer.parallel import cluster, run_lock
  from jaxformer.run.trainer import StopRequested, Trainer
  from jaxformer.runtime import stop_clock
  with StopRequested() as stop:  # A signal during setup ends it cleanly.
    config = load_config(args.config, overrides)
    cluster.initialize_distributed(config.distributed)
    make_workdir(args.workdir)  # Names a missing bucket first.
    # A folder that is not a COMET checkpoint fails now, not at an eval.
    scorer = comet_scorer(config.eval.comet)
    # One training per workdir: a second one (a requeued job while the
    # first lives) is refused, naming the first, before it writes.
    with run_lock.one_writer(paths.join(args.workdir, 'train.lock'),
                             f'--workdir {args.workdir}'):
      trainer = Trainer(config, args.workdir, scorer=scorer)
      result = trainer.train(stop)
      if stop.signal_name:  # Its checkpoint is committed: exit promptly.
        stop_clock.phase('run ended (checkpoint committed, goodput '
                         'reported)')
        stop_clock.bound_exit()
      if (not stop.signal_name and result.finished
          and trainer.task.translates):
        report_translation(trainer, result.state.params)
  return 0


def comet_scorer(folder: str):
  """The scorer of eval.comet's COMET checkpoint `folder`, loaded now:
  (sources, hypotheses, references) -> {'comet': the system score};
  None for no folder ('')."""
  if not folder:
    return None
  from jaxformer.interop import comet, comet_scores
  model = comet.load(folder, given_as='eval.comet')

  def score(sources, hypotheses, references) -> dict[str, float]:
    report = comet_scores.corpus_report(model, sources, hypotheses,
                                        references)
    return {'comet': report['comet']}
  return score


def report_translation(trainer, params=None) -> None:
  """After training: test-split scores, a few examples, and what next, for
  `params` (default: the trainer's last result's). Every process decodes
  its share; process 0 prints and writes."""
  from jaxformer.inference import evaluate
  config = trainer.config
  split = config.eval.final_split
  if not split:
    return
  if params is None:
    params = trainer.result.state.params
  scores, hypotheses = evaluate.decode_split(
      params, trainer.model_config, config, trainer.source_tok,
      trainer.target_tok, split, trainer.mesh)
  if not trainer.is_main:
    return
  from jaxformer.data import sources
  pairs = sources.read_split(config.data, split)
  scorer = trainer.evaluator.scorer
  if scorer is not None:
    scores.update(scorer([source for source, _ in pairs], hypotheses,
                         [target for _, target in pairs]))
  comet = f'  COMET {scores["comet"]:.4f}' if 'comet' in scores else ''
  print(f'\n{split} split ({len(pairs)} sentences, beam '
        f'{config.decode.beam_size}): BLEU {scores["bleu"]:.2f}  chrF '
        f'{scores["chrf"]:.2f}  exact match {scores["exact_match"]:.1f}%'
        + comet)
  for (source, reference), hypothesis in list(zip(pairs, hypotheses))[
      :config.eval.show_examples]:
    print(f'  {source}\n    -> {hypothesis}\n    (reference: {reference})')
  paths.write_text(paths.join(trainer.workdir, f'{split}_scores.json'),
                   json.dumps(scores, indent=2))
  print(f'\nTranslate your own sentences:\n  echo "she bought forty-two red '
        f'apples ." | jaxformer translate --workdir {trainer.workdir}')


def cmd_compile(args, overrides) -> int:
  """Compiles the run's programs for a TPU topology; non-zero if one does
  not fit in HBM."""
  from jaxformer.aot.compile_run import compile_run
  from jaxformer.aot.report import misfit_message
  from jaxformer.config.settings import load_config
  config = load_config(args.config, overrides)
  kinds = tuple(k.strip() for k in args.programs.split(',')
                if k.strip() not in ('', 'none'))
  unknown = sorted(set(kinds) - {'train', 'eval', 'decode'})
  if unknown:
    raise ValueError(f'--programs {unknown}: choose from train, eval, '
                     'decode, or none (the start-up of every host only).')
  buckets = None
  if args.buckets != 'all':
    buckets = [int(w) for w in args.buckets.split(',')]
  report = compile_run(config, args.topology, kinds, buckets,
                       log=lambda text: print(text, flush=True),
                       num_slices=args.num_slices)
  report['config'] = args.config
  report['overrides'] = list(overrides)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(report, f, indent=2)
  misfits = misfit_message(report)
  if misfits:
    print(f'jaxformer compile: {misfits}', file=sys.stderr)
    return 1
  return 0


def add_train(commands) -> None:
  train = commands.add_parser('train', help='train or resume a model',
                              epilog=USAGE_OVERRIDES)
  train.add_argument('--config', required=True,
                     help='config file, e.g. configs/quickstart.py')
  train.add_argument('--workdir', required=True, type=path,
                     help='where checkpoints, metrics and the tokenizer go')
  train.set_defaults(run=cmd_train)


def add_compile(commands) -> None:
  compile_ = commands.add_parser(
      'compile', help="compile a run's programs for a TPU topology on this "
      'machine (needs libtpu: pip install -e ".[tpu]") and report memory, '
      'collectives and cost', epilog=USAGE_OVERRIDES)
  compile_.add_argument('--config', required=True)
  compile_.add_argument('--topology', required=True,
                        help='an accelerator type: v4-8, v5e-8, v5p-64, ...')
  compile_.add_argument('--num-slices', type=int, default=1,
                        help='slices of the topology joined by the '
                        'data-centre network (set mesh.dcn_data to match)')
  compile_.add_argument('--programs', default='train,eval,decode',
                        help='which of train, eval, decode (default: all); '
                        'none: only the start-up of every host')
  compile_.add_argument('--buckets', default='all',
                        help="bucket widths of the train step to compile, "
                        "e.g. 8,256 (default: all; 'pack' has one shape)")
  compile_.add_argument('--json', type=path,
                        help='also write the report to this file')
  compile_.set_defaults(run=cmd_compile)
