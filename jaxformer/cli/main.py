"""The `jaxformer` command: train, translate, evaluate, average, attention,
predict, generate, import and compile."""
import argparse
import json
import os
import sys
import traceback

from jaxformer.cli import exiting
from jaxformer.storage import paths

USAGE_OVERRIDES = ('Config overrides: --config.KEY=VALUE (e.g. '
                   '--config.train.num_steps=2000).')


def _number(kind, allowed_name: str):
  """An argparse type: a `kind` number in config_ranges' `allowed_name`."""
  def parse(text: str):
    from jaxformer.config import ranges as config_ranges
    allowed = getattr(config_ranges, allowed_name)
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f'{text!r} is not a{"n integer" if kind is int else " number"}'
      ) from None
    if value != value or value not in allowed:
      raise argparse.ArgumentTypeError(f'{text} is out of range; it must be '
                                       f'{allowed}')
    return value
  return parse


POSITIVE_INT = _number(int, 'POSITIVE')
NON_NEGATIVE_INT = _number(int, 'NON_NEGATIVE')
NON_NEGATIVE_FLOAT = _number(float, 'NON_NEGATIVE')


def _split_overrides(argv):
  overrides = [a for a in argv if a.startswith('--config.')]
  rest = [a for a in argv if not a.startswith('--config.')]
  return rest, overrides


def cmd_train(args, overrides) -> int:
  from jaxformer.checkpoints.manager import make_workdir
  from jaxformer.config.settings import load_config
  from jaxformer.run.trainer import StopRequested, Trainer
  with StopRequested() as stop:  # A signal during setup ends it cleanly.
    config = load_config(args.config, overrides)
    make_workdir(args.workdir)
    trainer = Trainer(config, args.workdir)
    trainer.run(stop)
  if stop.signal_name:
    return 0
  if trainer.finished and trainer.task.translates:
    report_translation(trainer)
  return 0


def report_translation(trainer) -> None:
  """After training: test-split scores, a few examples, and what next.
  Every process decodes its share; process 0 prints and writes."""
  from jaxformer.inference import evaluate
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
  paths.write_text(paths.join(trainer.workdir, f'{split}_scores.json'),
                   json.dumps(scores, indent=2))
  print(f'\nTranslate your own sentences:\n  echo "she bought forty-two red '
        f'apples ." | jaxformer translate --workdir {trainer.workdir}')


def input_lines(args):
  """The lines of --input (or stdin) as text, decoded as --invalid-utf8 says."""
  from jaxformer.data import sources
  if args.input:
    stream = paths.open_bytes(args.input)
  else:  # A text stream without .buffer (an embedding program's) re-encoded.
    stream = getattr(sys.stdin, 'buffer', None) or (
        line.encode('utf-8', 'surrogateescape') for line in sys.stdin)
  return sources.decode_lines(
      stream, args.input or '<stdin>',
      'replace' if args.invalid_utf8 == 'replace' else 'strict',
      fix=', or pass --invalid-utf8=replace to replace undecodable bytes '
      'with U+FFFD')


def add_input_args(p, what: str) -> None:
  p.add_argument('--input', help=f'a file of {what}, one per line (default: '
                 'stdin); UTF-8')
  p.add_argument('--invalid-utf8', choices=('error', 'replace'),
                 default='error', help='on a line that is not UTF-8: stop '
                 'with an error naming it (default), or replace the '
                 'undecodable bytes with U+FFFD')


def load_trained(args, overrides):
  """The trained model of --workdir (--checkpoint), its saved config with
  `overrides` applied: keys that leave the model as trained (decode.*,
  eval.*, the data files...), as a resumed run may change them."""
  import dataclasses
  from jaxformer.config import resume
  from jaxformer.config import settings as config_lib
  from jaxformer.checkpoints import trained
  model = trained.load(args.workdir, args.checkpoint)
  if not overrides:
    return model
  config = config_lib.with_overrides(model.config, overrides)
  changed = resume.incompatible_keys(model.config.to_dict(), config.to_dict())
  if changed:
    raise config_lib.ConfigError(
        f'--config.{changed[0]}: a trained model keeps the settings it was '
        'trained with; only train.*, eval.*, decode.*, checkpoint.* and the '
        'data files may change.')
  return dataclasses.replace(model, config=config)


def load_translator(args, overrides):
  """`load_trained`, for the commands that decode translations."""
  model = load_trained(args, overrides)
  if not model.task.translates:
    raise ValueError(f'`jaxformer {args.command}` needs a translation run; '
                     f'{args.workdir} trained task={model.task.name!r} (use '
                     '`jaxformer predict` or `jaxformer generate`).')
  return model


def cmd_translate(args, overrides) -> int:
  from jaxformer.inference import evaluate
  model = load_translator(args, overrides)
  config = model.config
  stream = input_lines(args)
  beam = config.decode.beam_size if args.beam is None else args.beam
  alpha = config.decode.alpha if args.alpha is None else args.alpha
  extra = (config.decode.max_extra_len if args.max_extra_len is None
           else args.max_extra_len)
  for line in evaluate.translate(
      model.params, model.model_config, model.source_tok, model.target_tok,
      stream, beam_size=beam,
      alpha=alpha, max_extra_len=extra, batch_size=args.batch_size,
      max_source_length=config.data.max_source_length,
      on_too_long=args.on_too_long,
      warn=lambda text: print(text, file=sys.stderr)):
    print(line, flush=True)
  return 0


def cmd_predict(args, overrides) -> int:
  """Classification: one label per stdin line; regression: its value(s)."""
  from jaxformer.inference import predict
  model = load_trained(args, overrides)
  lines = list(input_lines(args))
  for start in range(0, len(lines), args.batch_size):
    for output in predict.predict(model.params, model.model_config,
                                  model.config, model.source_tok,
                                  lines[start:start + args.batch_size]):
      print(output if isinstance(output, str)
            else ' '.join(f'{value:.6g}' for value in output), flush=True)
  return 0


def cmd_generate(args, overrides) -> int:
  from jaxformer.inference import predict
  model = load_trained(args, overrides)
  for text in predict.generate(
      model.params, model.model_config, model.config, model.target_tok,
      [args.prompt] * args.num,
      seed=args.seed, max_len=args.max_len, temperature=args.temperature,
      top_k=args.top_k, top_p=args.top_p):
    print(text, flush=True)
  return 0


def cmd_evaluate(args, overrides) -> int:
  from jaxformer.inference import evaluate
  from jaxformer.checkpoints import trained
  model = load_translator(args, overrides)
  scores, hypotheses = evaluate.decode_split(
      model.params, model.model_config, model.config, model.source_tok,
      model.target_tok, args.split, trained.local_mesh(),
      beam_size=args.beam, alpha=args.alpha)
  path = paths.join(args.workdir, f'{args.split}_hypotheses.txt')
  paths.write_text(path, '\n'.join(hypotheses) + '\n')
  print(json.dumps(dict(scores, split=args.split, hypotheses=path), indent=2))
  return 0


def cmd_average(args, overrides) -> int:
  from jaxformer.checkpoints import trained
  steps = trained.average(args.workdir, args.last, args.out)
  print(f'Wrote the mean parameters of steps {steps} to {args.out}; use it '
        f'like a workdir: jaxformer translate --workdir {args.out}')
  return 0


EXPORT_FORMATS = ('jaxformer', 'ct2', 'hf')


def cmd_export(args, overrides) -> int:
  """A jaxformer export (parameters only), or the model in CTranslate2's
  or Hugging Face Marian's format (jaxformer/interop/)."""
  if args.format not in EXPORT_FORMATS:
    raise ValueError(f'--format {args.format}: choose one of '
                     f'{", ".join(EXPORT_FORMATS)}.')
  if args.quantization and args.format != 'ct2':
    raise ValueError(f'--quantization applies to --format ct2, not '
                     f'--format {args.format}.')
  if args.format != 'jaxformer':  # Before the model is read.
    from jaxformer.interop import ct2, folders
    ct2.check_quantization(args.quantization)
    folders.check_new(args.out)
  from jaxformer.checkpoints import trained
  if args.format == 'jaxformer':
    step = trained.export(args.workdir, args.out, args.checkpoint)
    print(f'Wrote the parameters of step {step} to {args.out}; use it like a '
          f'workdir: jaxformer translate --workdir {args.out}')
    return 0
  model = trained.load(args.workdir, args.checkpoint)
  if args.format == 'ct2':
    out = ct2.export(model, args.out, args.quantization)
    print(f'Wrote the CTranslate2 model ({args.quantization or "float32"}) '
          f'to {out}; translate with ctranslate2.Translator({out!r}) and the '
          f'SentencePiece model {out}/source.spm (README: "Start from a '
          'pretrained OPUS-MT model").')
    return 0
  from jaxformer.interop import hf_marian
  out = hf_marian.export(model, args.out)
  print(f'Wrote the Hugging Face Marian model to {out}; load it with '
        f'MarianMTModel.from_pretrained({out!r}) and '
        f'MarianTokenizer.from_pretrained({out!r}).')
  return 0


def cmd_import(args, overrides) -> int:
  from jaxformer.config.settings import default_config
  from jaxformer.interop import marian
  config = marian.import_folder(args.from_, args.out, default_config(),
                                warn=marian.main_warn)
  print(marian.report(config, args.out))
  return 0


def cmd_attention(args, overrides) -> int:
  import numpy as np
  from jaxformer.inference import search
  from jaxformer.inference import evaluate
  from jaxformer.inference import plots
  model = load_translator(args, overrides)
  config, model_config = model.config, model.model_config
  source_tok, target_tok = model.source_tok, model.target_tok
  rows, _ = evaluate.encode_sources(source_tok, [args.src],
                                    config.data.max_source_length)
  tokens, weights = search.greedy_decode(
      model.params, model_config, rows, return_attention=True,
      max_decode_len=search.decode_length(
          rows.shape[1], config.decode.max_extra_len, model_config.max_len))
  tokens, weights = np.asarray(tokens[0]), np.asarray(weights[0])
  if not 0 <= args.layer < weights.shape[0]:
    raise ValueError(f'--layer must be in [0, {weights.shape[0]}).')
  if args.head is not None and not 0 <= args.head < weights.shape[1]:
    raise ValueError(f'--head must be in [0, {weights.shape[1]}).')
  source_length = int((rows[0] != model_config.pad_id).sum())
  eos = model_config.eos_id
  target_length = int(np.argmax(tokens == eos)) + 1 if eos in tokens else int(
      (tokens != model_config.pad_id).sum())
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
  from jaxformer.inference import plots
  from jaxformer.run.metrics import has_metrics, metrics_path, read_metrics
  if not has_metrics(args.workdir):
    raise FileNotFoundError(f'{metrics_path(args.workdir)} does not exist; is '
                            f'{args.workdir} a training workdir?')
  plots.training_curves(read_metrics(args.workdir), args.out)
  print(f'wrote {args.out}')
  return 0


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
                       log=lambda text: print(text, flush=True))
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

  def add_model_args(p, overrides=True):
    if overrides:
      p.epilog = ('Config overrides of the saved config (decode.*, eval.*, '
                  'the data files): --config.KEY=VALUE.')
    p.add_argument('--workdir', required=True, help='a training workdir')
    p.add_argument('--checkpoint', type=NON_NEGATIVE_INT, default=None,
                   help='step to use (default: the latest)')

  translate = commands.add_parser(
      'translate', help='translate lines from stdin (or --input) to stdout')
  add_model_args(translate)
  add_input_args(translate, 'source sentences')
  translate.add_argument('--beam', type=POSITIVE_INT, default=None)
  translate.add_argument('--alpha', type=NON_NEGATIVE_FLOAT, default=None)
  translate.add_argument('--max-extra-len', type=NON_NEGATIVE_INT,
                         default=None)
  translate.add_argument('--batch-size', type=POSITIVE_INT, default=32)
  translate.add_argument('--on-too-long', choices=('truncate', 'error'),
                         default='truncate')
  translate.set_defaults(run=cmd_translate)

  predict = commands.add_parser(
      'predict', help='classification labels or regression values of the '
      'lines of stdin (or --input)')
  add_model_args(predict)
  add_input_args(predict, 'texts')
  predict.add_argument('--batch-size', type=POSITIVE_INT, default=64)
  predict.set_defaults(run=cmd_predict)

  generate = commands.add_parser(
      'generate', help='sample continuations of a prompt from a language model')
  add_model_args(generate)
  generate.add_argument('--prompt', default='', help='text to continue')
  generate.add_argument('--num', type=POSITIVE_INT, default=1,
                        help='samples to draw')
  generate.add_argument('--temperature', type=NON_NEGATIVE_FLOAT, default=1.0,
                        help='0: greedy')
  generate.add_argument('--top-k', type=NON_NEGATIVE_INT, default=0,
                        help='0: off')
  generate.add_argument('--top-p', type=_number(float, 'UNIT_INTERVAL'),
                        default=1.0, help='1: off')
  generate.add_argument('--max-len', type=NON_NEGATIVE_INT, default=0,
                        help='tokens incl. the prompt (0: data.max_target_length)')
  generate.add_argument('--seed', type=NON_NEGATIVE_INT, default=0)
  generate.set_defaults(run=cmd_generate)

  evaluate = commands.add_parser(
      'evaluate', help='BLEU/chrF of a split, printed as JSON')
  add_model_args(evaluate)
  evaluate.add_argument('--split', default='test',
                        choices=('train', 'dev', 'test'))
  evaluate.add_argument('--beam', type=POSITIVE_INT, default=None)
  evaluate.add_argument('--alpha', type=NON_NEGATIVE_FLOAT, default=None)
  evaluate.set_defaults(run=cmd_evaluate)

  attention = commands.add_parser(
      'attention', help='plot the cross-attention of one translation')
  add_model_args(attention)
  attention.add_argument('--src', required=True, help='the source sentence')
  attention.add_argument('--layer', type=NON_NEGATIVE_INT, default=0)
  attention.add_argument('--head', type=NON_NEGATIVE_INT, default=None,
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
  average.add_argument('--last', type=POSITIVE_INT, default=5,
                       help='how many of the newest checkpoints (default 5)')
  average.add_argument('--out', required=True,
                       help='directory to create for the export')
  average.set_defaults(run=cmd_average)

  export = commands.add_parser(
      'export', help='write one checkpoint as a parameters-only jaxformer '
      'export (default), a CTranslate2 model or a Hugging Face Marian folder')
  export.add_argument('--workdir', '--from', dest='workdir', required=True,
                      help='a training workdir or a jaxformer export')
  export.add_argument('--checkpoint', type=NON_NEGATIVE_INT, default=None,
                      help='step to use (default: the latest)')
  export.add_argument('--out', required=True,
                      help='directory to create for the export')
  export.add_argument('--format', default='jaxformer',
                      help='jaxformer (default), ct2 (CTranslate2) or hf '
                      '(Hugging Face MarianMTModel)')
  export.add_argument('--quantization', default=None,
                      help='ct2 weights: int8, int8_float32, bfloat16 or '
                      'float16 (default: float32)')
  export.set_defaults(run=cmd_export)

  import_ = commands.add_parser(
      'import', help='convert a Hugging Face Marian (OPUS-MT) folder into a '
      'jaxformer export (translate, evaluate, fine-tune it)')
  import_.add_argument('--from', dest='from_', required=True,
                       help='a local folder: config.json, model.safetensors '
                       '(or pytorch_model.bin), source.spm, target.spm, '
                       'vocab.json')
  import_.add_argument('--out', required=True,
                       help='directory to create for the export')
  import_.set_defaults(run=cmd_import)

  compile_ = commands.add_parser(
      'compile', help="compile a run's programs for a TPU topology on this "
      'machine (needs libtpu: pip install -e ".[tpu]") and report memory, '
      'collectives and cost', epilog=USAGE_OVERRIDES)
  compile_.add_argument('--config', required=True)
  compile_.add_argument('--topology', required=True,
                        help='an accelerator type: v4-8, v5e-8, v5p-64, ...')
  compile_.add_argument('--programs', default='train,eval,decode',
                        help='which of train, eval, decode (default: all); '
                        'none: only the start-up of every host')
  compile_.add_argument('--buckets', default='all',
                        help="bucket widths of the train step to compile, "
                        "e.g. 8,256 (default: all; 'pack' has one shape)")
  compile_.add_argument('--json', help='also write the report to this file')
  compile_.set_defaults(run=cmd_compile)
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
  if args.command not in ('curves', 'average', 'export'):
    from jaxformer.runtime import compilation_cache
    cache = compilation_cache.enable(  # Before anything compiles.
        jax_cache=args.command != 'compile')
    if args.command in ('train', 'compile'):
      print(f'jaxformer: compilation cache: {cache or "off"} '
            f'({compilation_cache.ENV}=DIR or off)', flush=True)
  try:
    status = args.run(args, overrides)
    if cache and args.command == 'train':
      print(f'jaxformer: {compilation_cache.summary()}', flush=True)
    return status
  except Exception as e:
    if os.environ.get('JAXFORMER_DEBUG') or not (
        isinstance(e, (ValueError, RuntimeError)) or paths.is_storage_error(e)):
      raise
    print(f'jaxformer {args.command}: error: {exiting.error_line(e)}',
          file=sys.stderr)
    return 1


def run() -> None:
  """The `jaxformer` program (pyproject's entry point): main, then
  exit_process; an unexpected exception is printed with its traceback."""
  if not os.environ.get('JAXFORMER_DEBUG'):
    exiting.quiet_library_errors()
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
