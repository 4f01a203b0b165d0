"""The `jaxformer` command: train, translate, evaluate, average, attention,
predict and generate."""
import argparse
import json
import os
import sys

USAGE_OVERRIDES = ('Config overrides: --config.KEY=VALUE (e.g. '
                   '--config.train.num_steps=2000).')


def _split_overrides(argv):
  overrides = [a for a in argv if a.startswith('--config.')]
  rest = [a for a in argv if not a.startswith('--config.')]
  return rest, overrides


def cmd_train(args, overrides) -> int:
  from jaxformer.config import load_config
  from jaxformer.train.loop import Trainer
  config = load_config(args.config, overrides)
  os.makedirs(args.workdir, exist_ok=True)
  trainer = Trainer(config, args.workdir)
  metrics = trainer.run()
  if trainer.is_main and int(trainer.state.step) >= config.train.num_steps:
    report_translation(trainer) if trainer.task.name == 'translation' else None
  return 0


def report_translation(trainer) -> None:
  """After training: test-split scores, a few examples, and what next."""
  from jaxformer import evaluate
  config = trainer.config
  split = config.eval.final_split
  if not split:
    return
  scores, hypotheses = evaluate.decode_split(
      trainer.state.params, trainer.model_config, config, trainer.source_tok,
      trainer.target_tok, split, trainer.mesh)
  from jaxformer.data import sources
  pairs = sources.read_split(config.data, split)
  print(f'\n{split} split ({len(pairs)} sentences, beam '
        f'{config.decode.beam_size}): BLEU {scores["bleu"]:.2f}  chrF '
        f'{scores["chrf"]:.2f}  exact match {scores["exact_match"]:.1f}%')
  for (source, reference), hypothesis in list(zip(pairs, hypotheses))[
      :config.eval.show_examples]:
    print(f'  {source}\n    -> {hypothesis}\n    (reference: {reference})')
  with open(os.path.join(trainer.workdir, f'{split}_scores.json'), 'w') as f:
    json.dump(scores, f, indent=2)
  print(f'\nTranslate your own sentences:\n  echo "she bought forty-two red '
        f'apples ." | jaxformer translate --workdir {trainer.workdir}')


def cmd_translate(args, overrides) -> int:
  from jaxformer import evaluate
  params, model_config, config, source_tok, target_tok = (
      evaluate.load_trained(args.workdir, args.checkpoint))
  stream = open(args.input) if args.input else sys.stdin
  beam = config.decode.beam_size if args.beam is None else args.beam
  alpha = config.decode.alpha if args.alpha is None else args.alpha
  extra = (config.decode.max_extra_len if args.max_extra_len is None
           else args.max_extra_len)
  for line in evaluate.translate(
      params, model_config, source_tok, target_tok, stream, beam_size=beam,
      alpha=alpha, max_extra_len=extra, batch_size=args.batch_size,
      max_source_length=config.data.max_source_length,
      on_too_long=args.on_too_long,
      warn=lambda text: print(text, file=sys.stderr)):
    print(line, flush=True)
  return 0


def cmd_evaluate(args, overrides) -> int:
  from jaxformer import evaluate
  from jaxformer import parallel
  import jax
  params, model_config, config, source_tok, target_tok = (
      evaluate.load_trained(args.workdir, args.checkpoint))
  mesh = parallel.make_mesh({'data': -1}, jax.local_devices())
  scores, hypotheses = evaluate.decode_split(
      params, model_config, config, source_tok, target_tok, args.split, mesh,
      beam_size=args.beam, alpha=args.alpha)
  path = os.path.join(args.workdir, f'{args.split}_hypotheses.txt')
  with open(path, 'w') as f:
    f.write('\n'.join(hypotheses) + '\n')
  print(json.dumps(dict(scores, split=args.split, hypotheses=path), indent=2))
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog='jaxformer', description='Train and use Transformers with JAX.',
      epilog=USAGE_OVERRIDES)
  commands = parser.add_subparsers(dest='command', required=True)

  train = commands.add_parser('train', help='train or resume a model',
                              epilog=USAGE_OVERRIDES)
  train.add_argument('--config', required=True,
                     help='config file, e.g. configs/quickstart.py')
  train.add_argument('--workdir', required=True,
                     help='where checkpoints, metrics and the tokenizer go')
  train.set_defaults(run=cmd_train)

  def add_model_args(p):
    p.add_argument('--workdir', required=True, help='a training workdir')
    p.add_argument('--checkpoint', type=int, default=None,
                   help='step to use (default: the latest)')

  translate = commands.add_parser(
      'translate', help='translate lines from stdin (or --input) to stdout')
  add_model_args(translate)
  translate.add_argument('--input', help='a file of source lines')
  translate.add_argument('--beam', type=int, default=None)
  translate.add_argument('--alpha', type=float, default=None)
  translate.add_argument('--max-extra-len', type=int, default=None)
  translate.add_argument('--batch-size', type=int, default=32)
  translate.add_argument('--on-too-long', choices=('truncate', 'error'),
                         default='truncate')
  translate.set_defaults(run=cmd_translate)

  evaluate = commands.add_parser(
      'evaluate', help='BLEU/chrF of a split, printed as JSON')
  add_model_args(evaluate)
  evaluate.add_argument('--split', default='test',
                        choices=('train', 'dev', 'test'))
  evaluate.add_argument('--beam', type=int, default=None)
  evaluate.add_argument('--alpha', type=float, default=None)
  evaluate.set_defaults(run=cmd_evaluate)
  return parser


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  rest, overrides = _split_overrides(argv)
  args = build_parser().parse_args(rest)
  if overrides and args.command != 'train':
    print('--config.* overrides apply to `jaxformer train` only.',
          file=sys.stderr)
    return 2
  try:
    return args.run(args, overrides)
  except (ValueError, FileNotFoundError, RuntimeError) as e:
    if os.environ.get('JAXFORMER_DEBUG'):
      raise
    print(f'jaxformer {args.command}: error: {e}', file=sys.stderr)
    return 1


if __name__ == '__main__':
  sys.exit(main())
