"""The commands that write a model in another form: average, export and
import."""
from jaxformer.cli.arguments import NON_NEGATIVE_INT, POSITIVE_INT, path
from jaxformer.cli.model_commands import add_weights_arg


def cmd_average(args, overrides) -> int:
  from jaxformer.checkpoints import trained
  steps = trained.average(args.workdir, args.last, args.out,
                          args.keep_provenance, args.weights)
  print(f'Wrote the mean parameters of steps {steps} to {args.out}; use it '
        f'like a workdir: jaxformer translate --workdir {args.out}')
  return 0


EXPORT_FORMATS = ('jaxformer', 'ct2', 'hf', 'peft')


def cmd_export(args, overrides) -> int:
  """A jaxformer export (parameters only), or the model in CTranslate2's
  or Hugging Face's format (jaxformer/interop/)."""
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
                          args.keep_provenance, args.weights)
    print(f'Wrote the parameters of step {step} to {args.out}; use it like a '
          f'workdir: jaxformer translate --workdir {args.out}')
    return 0
  model = trained.load(args.workdir, args.checkpoint, args.weights)
  print(_export_other_format(model, args))
  return 0


def _export_other_format(model, args) -> str:
  """Writes `model` (a `Trained`) in args.format: a translation model as
  CTranslate2's Translator or Hugging Face's Marian, a language model as
  CTranslate2's Generator or a Hugging Face Llama/Qwen2, an encoder-only
  model as a Hugging Face BERT/RoBERTa/XLM-R. Returns the line
  that says how to use it."""
  from jaxformer.interop import (ct2, ct2_encoder, ct2_lm, hf_bert, hf_llama,
                                 hf_m2m100, hf_marian, peft)
  if args.format == 'peft':
    out = peft.export(model, args.out)
    return (f'Wrote the LoRA adapter to {out}; load it with PeftModel.'
            f'from_pretrained(base, {out!r}) over the base model it was '
            'trained on.')
  model = peft.merged(model)  # The other formats have no adapters.
  generates = model.task.generates
  if args.format == 'ct2' and model.task.name in ('classification',
                                                  'regression'):
    out = ct2_encoder.export(model, args.out, args.quantization)
    return (f'Wrote the CTranslate2 encoder ({args.quantization or "float32"})'
            f' to {out}; run it with ctranslate2.Encoder({out!r}), the '
            f'tokenizer {out}/tokenizer.json and the head {out}/'
            'head.safetensors (docs/interop.md: "Start from a pretrained '
            'encoder").')
  if args.format == 'ct2':
    out = (ct2_lm if generates else ct2).export(model, args.out,
                                                args.quantization)
    use = (f'generate with ctranslate2.Generator({out!r}) and the tokenizer '
           f'{out}/tokenizer.json (docs/interop.md: "Start from a Llama or '
           'Qwen2 checkpoint")' if generates else
           f'translate with ctranslate2.Translator({out!r}), sources from '
           f'AutoTokenizer.from_pretrained({out!r}) with src_lang set and '
           'target_prefix=[[the target language token]] (docs/interop.md: '
           '"Translate between many languages")'
           if hf_m2m100.is_many_to_many(model) else
           f'translate with ctranslate2.Translator({out!r}) and the '
           f'SentencePiece model {out}/source.spm (README: "Start from a '
           'pretrained OPUS-MT model")')
    return (f'Wrote the CTranslate2 model ({args.quantization or "float32"}) '
            f'to {out}; {use}.')
  if model.task.name in ('classification', 'regression'):
    out, kind = hf_bert.export(model, args.out)
    return (f'Wrote the Hugging Face {kind} model to {out}; load it with '
            f'AutoModelForSequenceClassification.from_pretrained({out!r}) '
            f'and AutoTokenizer.from_pretrained({out!r}).')
  if generates:
    out = hf_llama.export(model, args.out)
    return (f'Wrote the Hugging Face {hf_llama.model_type(model.model_config)}'
            f' model to {out}; load it with AutoModelForCausalLM.'
            f'from_pretrained({out!r}) and AutoTokenizer.from_pretrained'
            f'({out!r}).')
  if hf_m2m100.is_many_to_many(model):
    out = hf_m2m100.export(model, args.out)
    return (f'Wrote the Hugging Face M2M100 model to {out}; load it with '
            f'M2M100ForConditionalGeneration.from_pretrained({out!r}) and '
            f'AutoTokenizer.from_pretrained({out!r}).')
  out = hf_marian.export(model, args.out)
  return (f'Wrote the Hugging Face Marian model to {out}; load it with '
          f'MarianMTModel.from_pretrained({out!r}) and '
          f'MarianTokenizer.from_pretrained({out!r}).')


# config.json model_type values `jaxformer import` takes.
IMPORTED_TYPES = ('marian', 'llama', 'qwen2', 'mistral', 'bert', 'roberta',
                  'xlm-roberta', 'm2m_100')


def cmd_import(args, overrides) -> int:
  """A Hugging Face folder, by its config.json model_type: Marian
  (OPUS-MT), M2M100/NLLB, the Llama family or the BERT family."""
  from jaxformer.config.settings import default_config
  from jaxformer.interop import bert, hf_folders, llama, m2m100, marian
  model_type = hf_folders.model_type(args.from_)
  if args.num_labels is not None and model_type not in bert.MODEL_TYPES:
    raise ValueError(f'--num-labels applies to encoder imports ('
                     f'{", ".join(bert.MODEL_TYPES)}), not {model_type!r}.')
  if args.adapter is not None:
    return _import_adapter(args, model_type)
  if model_type in bert.MODEL_TYPES:
    _float32_only(args, 'BERT-family')
    config, model_type, task = bert.import_folder(
        args.from_, args.out, default_config(), args.num_labels,
        args.keep_provenance)
    print(bert.report(config, model_type, task, args.out))
    return 0
  if model_type == m2m100.MODEL_TYPE:
    _float32_only(args, 'M2M100/NLLB')
    config, languages = m2m100.import_folder(
        args.from_, args.out, default_config(), args.keep_provenance)
    print(m2m100.report(config, languages, args.out))
    return 0
  if model_type in llama.MODEL_TYPES:
    config, model_type = llama.import_folder(
        args.from_, args.out, default_config(), args.dtype,
        args.keep_provenance)
    print(llama.report(config, model_type, args.out))
    return 0
  if model_type != marian.MODEL_TYPE:
    raise ValueError(f'{args.from_}/config.json: model_type {model_type!r} '
                     'cannot be imported; supported: '
                     f'{", ".join(IMPORTED_TYPES)}.')
  _float32_only(args, 'Marian')
  config = marian.import_folder(args.from_, args.out, default_config(),
                                warn=marian.main_warn,
                                keep_provenance=args.keep_provenance)
  print(marian.report(config, args.out))
  return 0


def _import_adapter(args, model_type: str) -> int:
  """A Llama-family, BERT-family, M2M100/NLLB or Marian base with a PEFT
  LoRA adapter (interop/peft.py)."""
  from jaxformer.config.settings import default_config
  from jaxformer.interop import bert, m2m100, marian, peft
  if model_type in bert.MODEL_TYPES:
    _float32_only(args, 'BERT-family')
  if model_type == m2m100.MODEL_TYPE:
    _float32_only(args, 'M2M100/NLLB')
  if model_type == marian.MODEL_TYPE:
    _float32_only(args, marian.FAMILY)
  config, report = peft.import_folder(
      args.from_, args.adapter, args.out, default_config(), args.dtype,
      args.keep_provenance, args.num_labels)
  print(report + '\n'
        f'  with the LoRA adapter of {args.adapter} (model.lora: rank '
        f'{config.lora.rank} on {config.lora.targets}); '
        f'jaxformer export --format peft --from {args.out} --out DIR '
        'writes it back.')
  return 0


def _float32_only(args, family: str) -> None:
  if args.dtype != 'float32':
    raise ValueError(f'--dtype {args.dtype} applies to Llama-family imports; '
                     f'{family} models import in float32.')


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
  add_weights_arg(average)
  add_provenance_arg(average)
  average.set_defaults(run=cmd_average)

  export = commands.add_parser(
      'export', help='write one checkpoint as a parameters-only jaxformer '
      'export (default), a CTranslate2 model or a Hugging Face folder '
      '(Marian for translation models, Llama/Qwen2 for language models, '
      'BERT/RoBERTa/XLM-R for classifiers and regressors)')
  export.add_argument('--workdir', '--from', dest='workdir', required=True,
                      type=path,
                      help='a training workdir or a jaxformer export')
  export.add_argument('--checkpoint', type=NON_NEGATIVE_INT, default=None,
                      help='step to use (default: the latest)')
  export.add_argument('--out', required=True, type=path,
                      help='directory to create for the export')
  export.add_argument('--format', default='jaxformer',
                      help='jaxformer (default), ct2 (CTranslate2 Translator, '
                      'Generator or Encoder) or hf (Hugging Face '
                      'MarianMTModel, LlamaForCausalLM / Qwen2ForCausalLM, '
                      'or BERT / RoBERTa / XLM-R ForSequenceClassification; '
                      'LoRA adapters merged) or peft (a LoRA model\'s '
                      'adapters as a PEFT folder)')
  export.add_argument('--quantization', default=None,
                      help='ct2 weights: int8, int8_float32, bfloat16 or '
                      'float16 (default: float32)')
  add_weights_arg(export)
  add_provenance_arg(export)
  export.set_defaults(run=cmd_export)

  import_ = commands.add_parser(
      'import', help='convert a Hugging Face folder (by its config.json '
      'model_type: marian, llama, qwen2, mistral, bert, roberta, '
      'xlm-roberta) into a jaxformer export (translate, generate or '
      'predict, evaluate, fine-tune it)')
  import_.add_argument('--from', dest='from_', required=True, type=path,
                       help='a local folder: config.json, model.safetensors '
                       '(or its shards; Marian: or pytorch_model.bin) and '
                       'the tokenizer (Marian: source.spm, target.spm, '
                       'vocab.json; Llama family: tokenizer.json or '
                       'tokenizer.model with tokenizer_config.json)')
  import_.add_argument('--out', required=True, type=path,
                       help='directory to create for the export')
  import_.add_argument('--dtype', default='float32',
                       help='Llama family: the parameters\' dtype, float32 '
                       '(default; bfloat16 checkpoints are widened exactly) '
                       'or bfloat16 (also the dtype it computes in)')
  import_.add_argument('--adapter', type=path, default=None,
                       help='a PEFT LoRA adapter folder '
                       '(adapter_config.json, adapter_model.safetensors) '
                       'made for the --from model, imported as model.lora')
  import_.add_argument('--num-labels', type=POSITIVE_INT, default=None,
                       help='BERT family base models: a fresh head of N '
                       'classes named 0..N-1 (1: a regressor; default: the '
                       'labels of the training TSV)')
  add_provenance_arg(import_)
  import_.set_defaults(run=cmd_import)
