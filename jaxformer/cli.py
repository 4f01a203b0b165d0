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
  from jaxformer.checkpoint import make_workdir
  from jaxformer.config import load_config
  from jaxformer.train.loop import Trainer
  config = load_config(args.config, overrides)
  make_workdir(args.workdir)
  trainer = Trainer(config, args.workdir)
  trainer.run()
  if trainer.finished and trainer.task.name == 'translation':
    report_translation(trainer)
  return 0


def report_translation(trainer) -> None:
  """After training: test-split scores, a few examples, and what next.
  Every process decodes its share; process 0 prints and writes."""
  from jaxformer import evaluate
  config = trainer.config
  split = config.eval.final_split
  if not split:
    return
  scores, hypotheses = evaluate.decode_split(
      trainer.state.params, trainer.model_config, config, trainer.source_tok,
      trainer.target_tok, split, trainer.mesh)
  if not trainer.is_main:
    return
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


def cmd_predict(args, overrides) -> int:
  """Classification: one label per stdin line; regression: its value(s)."""
  from jaxformer import evaluate
  from jaxformer import predict
  params, model_config, config, source_tok, _ = evaluate.load_trained(
      args.workdir, args.checkpoint)
  stream = open(args.input) if args.input else sys.stdin
  lines = [line.rstrip('\n') for line in stream]
  for start in range(0, len(lines), args.batch_size):
    for output in predict.predict(params, model_config, config, source_tok,
                                  lines[start:start + args.batch_size]):
      print(output if isinstance(output, str)
            else ' '.join(f'{value:.6g}' for value in output), flush=True)
  return 0


def cmd_generate(args, overrides) -> int:
  from jaxformer import evaluate
  from jaxformer import predict
  params, model_config, config, _, target_tok = evaluate.load_trained(
      args.workdir, args.checkpoint)
  for text in predict.generate(
      params, model_config, config, target_tok, [args.prompt] * args.num,
      seed=args.seed, max_len=args.max_len, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p):
    print(text, flush=True)
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


def cmd_average(args, overrides) -> int:
  from jaxformer import checkpoint as checkpoint_lib
  steps = checkpoint_lib.average_checkpoints(args.workdir, args.last, args.out)
  print(f'Wrote the mean parameters of steps {steps} to {args.out}; use it '
        f'like a workdir: jaxformer translate --workdir {args.out}')
  return 0


def cmd_export(args, overrides) -> int:
  from jaxformer import checkpoint as checkpoint_lib
  step = checkpoint_lib.export_checkpoint(args.workdir, args.out,
                                          args.checkpoint)
  print(f'Wrote the parameters of step {step} to {args.out}; use it like a '
        f'workdir: jaxformer translate --workdir {args.out}')
  return 0


def cmd_attention(args, overrides) -> int:
  import numpy as np
  from jaxformer import decode, evaluate, plots
  params, model_config, config, source_tok, target_tok = (
      evaluate.load_trained(args.workdir, args.checkpoint))
  rows, _ = evaluate.encode_sources(source_tok, [args.src],
                                    config.data.max_source_length)
  tokens, weights = decode.greedy_decode(
      params, model_config, rows, return_attention=True,
      max_decode_len=min(model_config.max_len,
                         rows.shape[1] + config.decode.max_extra_len))
  tokens, weights = np.asarray(tokens[0]), np.asarray(weights[0])
  if not 0 <= args.layer < weights.shape[0]:
    raise ValueError(f'--layer must be in [0, {weights.shape[0]}).')
  if args.head is not None and not 0 <= args.head < weights.shape[1]:
    raise ValueError(f'--head must be in [0, {weights.shape[1]}).')
  source_length = int((rows[0] != 0).sum())
  target_length = int(np.argmax(tokens == 1)) + 1 if 1 in tokens else int(
      (tokens != 0).sum())
  layer = weights[args.layer]
  grid = layer.mean(0) if args.head is None else layer[args.head]
  grid = grid[:target_length, :source_length]
  head = 'mean of heads' if args.head is None else f'head {args.head}'
  plots.attention_heatmap(
      grid, [source_tok.id_to_piece(int(t)) for t in rows[0, :source_length]],
      [target_tok.id_to_piece(int(t)) for t in tokens[:target_length]],
      args.out, title=f'cross-attention, layer {args.layer}, {head}')
  print(f'{target_tok.decode(tokens)}\nwrote {args.out}')
  return 0


def cmd_curves(args, overrides) -> int:
  from jaxformer import plots
  from jaxformer.train.metrics import read_metrics
  path = os.path.join(args.workdir, 'metrics.jsonl')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} does not exist; is {args.workdir} a '
                            'training workdir?')
  plots.training_curves(read_metrics(args.workdir), args.out)
  print(f'wrote {args.out}')
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

  predict = commands.add_parser(
      'predict', help='classification labels or regression values of the '
      'lines of stdin (or --input)')
  add_model_args(predict)
  predict.add_argument('--input', help='a file of texts, one per line')
  predict.add_argument('--batch-size', type=int, default=64)
  predict.set_defaults(run=cmd_predict)

  generate = commands.add_parser(
      'generate', help='sample continuations of a prompt from a language model')
  add_model_args(generate)
  generate.add_argument('--prompt', default='', help='text to continue')
  generate.add_argument('--num', type=int, default=1, help='samples to draw')
  generate.add_argument('--temperature', type=float, default=1.0,
                        help='0: greedy')
  generate.add_argument('--top-k', type=int, default=0, help='0: off')
  generate.add_argument('--top-p', type=float, default=1.0, help='1: off')
  generate.add_argument('--max-len', type=int, default=0,
                        help='tokens incl. the prompt (0: data.max_target_length)')
  generate.add_argument('--seed', type=int, default=0)
  generate.set_defaults(run=cmd_generate)

  evaluate = commands.add_parser(
      'evaluate', help='BLEU/chrF of a split, printed as JSON')
  add_model_args(evaluate)
  evaluate.add_argument('--split', default='test',
                        choices=('train', 'dev', 'test'))
  evaluate.add_argument('--beam', type=int, default=None)
  evaluate.add_argument('--alpha', type=float, default=None)
  evaluate.set_defaults(run=cmd_evaluate)

  attention = commands.add_parser(
      'attention', help='plot the cross-attention of one translation')
  add_model_args(attention)
  attention.add_argument('--src', required=True, help='the source sentence')
  attention.add_argument('--layer', type=int, default=0)
  attention.add_argument('--head', type=int, default=None,
                         help='default: the mean over heads')
  attention.add_argument('--out', required=True, help='a .png path')
  attention.set_defaults(run=cmd_attention)

  curves = commands.add_parser('curves',
                               help='plot loss/BLEU curves of a run')
  curves.add_argument('--workdir', required=True)
  curves.add_argument('--out', required=True, help='a .png path')
  curves.set_defaults(run=cmd_curves)

  average = commands.add_parser(
      'average', help='average the parameters of the last N checkpoints '
      'into a parameters-only export')
  average.add_argument('--workdir', required=True, help='a training workdir')
  average.add_argument('--last', type=int, default=5,
                       help='how many of the newest checkpoints (default 5)')
  average.add_argument('--out', required=True,
                       help='directory to create for the export')
  average.set_defaults(run=cmd_average)

  export = commands.add_parser(
      'export', help='write the parameters of one checkpoint (no optimizer '
      'state) with the config and tokenizers')
  add_model_args(export)
  export.add_argument('--out', required=True,
                      help='directory to create for the export')
  export.set_defaults(run=cmd_export)
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
