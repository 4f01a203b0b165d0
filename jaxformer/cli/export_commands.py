"""The commands that write a model in another form: average, export and
import."""
from jaxformer.cli.arguments import NON_NEGATIVE_INT, POSITIVE_INT, path


def cmd_average(args, overrides) -> int:
  from jaxformer.checkpoints import trained
  steps = trained.average(args.workdir, args.last, args.out,
                          args.keep_provenance)
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
    step = trained.export(args.workdir, args.out, args.checkpoint,
                          args.keep_provenance)
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
                                warn=marian.main_warn,
                                keep_provenance=args.keep_provenance)
  print(marian.report(config, args.out))
  return 0


def add_provenance_arg(p) -> None:
  p.add_argument('--keep-provenance', action='store_true',
                 help='record in the export where it came from (the '
                 'workdir or folder) and the data paths of its config')


def add_parsers(commands) -> None:
  """average, export and import."""
  average = commands.add_parser(
      'average', help='average the parameters of the last N checkpoints '
      'into a parameters-only export')
  average.add_argument('--workdir', required=True, type=path,
                       help='a training workdir')
  average.add_argument('--last', type=POSITIVE_INT, default=5,
                       help='how many of the newest checkpoints (default 5)')
  average.add_argument('--out', required=True, type=path,
                       help='directory to create for the export')
  add_provenance_arg(average)
  average.set_defaults(run=cmd_average)

  export = commands.add_parser(
      'export', help='write one checkpoint as a parameters-only jaxformer '
      'export (default), a CTranslate2 model or a Hugging Face Marian folder')
  export.add_argument('--workdir', '--from', dest='workdir', required=True,
                      type=path,
                      help='a training workdir or a jaxformer export')
  export.add_argument('--checkpoint', type=NON_NEGATIVE_INT, default=None,
                      help='step to use (default: the latest)')
  export.add_argument('--out', required=True, type=path,
                      help='directory to create for the export')
  export.add_argument('--format', default='jaxformer',
                      help='jaxformer (default), ct2 (CTranslate2) or hf '
                      '(Hugging Face MarianMTModel)')
  export.add_argument('--quantization', default=None,
                      help='ct2 weights: int8, int8_float32, bfloat16 or '
                      'float16 (default: float32)')
  add_provenance_arg(export)
  export.set_defaults(run=cmd_export)

  import_ = commands.add_parser(
      'import', help='convert a Hugging Face Marian (OPUS-MT) folder into a '
      'jaxformer export (translate, evaluate, fine-tune it)')
  import_.add_argument('--from', dest='from_', required=True, type=path,
                       help='a local folder: config.json, model.safetensors '
                       '(or pytorch_model.bin), source.spm, target.spm, '
                       'vocab.json')
  import_.add_argument('--out', required=True, type=path,
                       help='directory to create for the export')
  add_provenance_arg(import_)
  import_.set_defaults(run=cmd_import)
