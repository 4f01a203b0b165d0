"""The commands that use a trained model (a training workdir or an
export): translate, predict, generate, evaluate (attention and curves,
which draw pictures: `plot_commands.py`)."""
import json
import sys

from jaxformer.cli import chat_args
from jaxformer.cli.input_args import add_input_args, input_files, input_lines
from jaxformer.cli.arguments import (NON_NEGATIVE_FLOAT, NON_NEGATIVE_INT,
                                     POSITIVE_INT, number, path)
from jaxformer.cli import translation_flags
from jaxformer.storage import paths


def load_trained(args, overrides):
  """The trained model of --workdir (--checkpoint), its saved config with
  `overrides` applied: keys that leave the model as trained (decode.*,
  eval.*, the data files...), as a resumed run may change them; the paths
  they name are made absolute."""
  import dataclasses
  from jaxformer.config import resume
  from jaxformer.config import path_keys
  from jaxformer.config import settings as config_lib
  from jaxformer.checkpoints import trained
  from jaxformer.data import language_tokenizer
  model = trained.load(args.workdir, args.checkpoint,
                       getattr(args, 'weights', None))
  saved = config_lib.trained_model_config(model.config)
  overrides = [*overrides, *language_overrides(args)]
  config = path_keys.resolve_paths(
      config_lib.with_overrides(saved, overrides))
  changed = resume.incompatible_keys(saved.to_dict(), config.to_dict())
  if changed:
    raise config_lib.ConfigError(
        f'--config.{changed[0]}: a trained model keeps the settings it was '
        'trained with; only train.*, eval.*, decode.*, checkpoint.* and the '
        'data files may change.')
  source_tok, target_tok = language_tokenizer.bind_pair(
      model.source_tok, model.target_tok, config.data)
  return dataclasses.replace(model, config=config, source_tok=source_tok,
                             target_tok=target_tok)


def language_overrides(args) -> list[str]:
  """--source-lang / --target-lang as the config overrides they stand for."""
  return [f'--config.data.{key}={getattr(args, key)}'
          for key in ('source_lang', 'target_lang')
          if getattr(args, key, None)]


def add_language_args(p) -> None:
  for side in ('source', 'target'):
    p.add_argument(f'--{side}-lang', default=None,
                   help=f'a many-to-many model\'s (M2M100/NLLB) {side} '
                   'language code, e.g. en or deu_Latn (config '
                   f'data.{side}_lang)')


def load_translator(args, overrides):
  """`load_trained`, for the commands that decode translations."""
  model = load_trained(args, overrides)
  if not model.task.translates:
    raise ValueError(f'`jaxformer {args.command}` needs a translation run; '
                     f'{args.workdir} trained task={model.task.name!r} (use '
                     '`jaxformer predict` or `jaxformer generate`).')
  return model


def decode_choices(args, config) -> tuple[int, float, int]:
  """(beam, alpha, max_extra_len): the flags, else the config's decode.*."""
  pick = lambda flag, saved: saved if flag is None else flag  # noqa: E731
  return (pick(args.beam, config.decode.beam_size),
          pick(args.alpha, config.decode.alpha),
          pick(args.max_extra_len, config.decode.max_extra_len))


def _translation(args, overrides, per_line: dict):
  """The `translator.Translation` of `translate`'s flags: the models of
  --workdir and --ensemble, decoding as the flags (else the first model's
  decode.*) say, under `per_line`'s prefixes and constraints."""
  from jaxformer.inference import translator
  members = translation_flags.members(args, overrides, load_translator)
  config = members[0].config
  beam, alpha, extra = decode_choices(args, config)
  settings = translator.TranslateSettings(
      batch_size=args.batch_size, chunk_batches=args.chunk_batches,
      invalid_utf8=args.invalid_utf8, beam_size=beam, alpha=alpha,
      max_extra_len=extra,
      max_source_length=config.data.max_source_length,
      on_too_long=args.on_too_long, target_prefix=args.target_prefix or '')
  return translator.Translation(members, settings, **per_line)


def _bulk_translation(args, overrides):
  """(input files, the decoder of `translate --output`, the manifest's
  words on the models and the per-line files)."""
  from jaxformer.inference import bulk, provenance
  files = input_files(args.input)  # A bad glob fails before the model loads.
  per_line = translation_flags.per_line(args)
  translation = _translation(args, overrides, per_line)
  if any(per_line.values()):
    translation.check_count(sum(1 for _ in bulk.read_lines(
        files, args.invalid_utf8)))
  return (files, translation,
          dict(provenance.model_identity(translation.members[0]),
               **translation.identity()))


def _bulk_generation(args, overrides):
  """(input files, the decoder of `generate --output`, the manifest's
  words on the model)."""
  from jaxformer.inference import bulk_decoders as decoders
  from jaxformer.inference import provenance
  if args.num != 1:
    raise ValueError(f'--num {args.num} with --output: the file holds one '
                     'continuation per input line; repeat the lines in the '
                     'input for more.')
  files = input_files(args.input)
  model = load_trained(args, overrides)
  settings = decoders.GenerateSettings(
      batch_size=args.batch_size, chunk_batches=args.chunk_batches,
      invalid_utf8=args.invalid_utf8, max_new_tokens=args.max_new_tokens,
      max_len=args.max_len, temperature=args.temperature, top_k=args.top_k,
      top_p=args.top_p, seed=args.seed, on_too_long=args.on_too_long,
      jsonl=args.jsonl)
  return (files, decoders.Generation(model, settings),
          provenance.model_identity(model))


def cmd_translate(args, overrides) -> int:
  if args.output:
    from jaxformer.cli import bulk_commands
    return bulk_commands.cmd_bulk(args, overrides, _bulk_translation)
  from jaxformer.inference import translator
  per_line = translation_flags.per_line(args)
  translation = _translation(args, overrides, per_line)
  for line in translator.translate_lines(translation, input_lines(args)):
    print(line, flush=True)
  return 0


def cmd_predict(args, overrides) -> int:
  """Classification: one label per stdin line; regression: its value(s);
  --jsonl: one JSON object each."""
  from jaxformer.inference import predict
  model = load_trained(args, overrides)
  for output in predict.predict_lines(
      model.params, model.model_config, model.config, model.source_tok,
      input_lines(args), args.batch_size, jsonl=args.jsonl,
      warn=lambda text: print(text, file=sys.stderr)):
    if args.jsonl:
      print(json.dumps(output), flush=True)
      continue
    print(output if isinstance(output, str)
          else ' '.join(f'{value:.6g}' for value in output), flush=True)
  return 0


def cmd_generate(args, overrides) -> int:
  """--num continuations of --prompt, or of each line of --input: their
  text with the prompt's, or with --jsonl one JSON object each."""
  from jaxformer.inference import predict
  if args.input and args.prompt is not None:
    raise ValueError('--prompt and --input both give prompts; pass one.')
  chat_args.check_chat(args)
  if args.output:
    from jaxformer.cli import bulk_commands
    return bulk_commands.cmd_bulk(args, overrides, _bulk_generation)
  model = load_trained(args, overrides)
  prompts = input_lines(args) if args.input else [args.prompt or '']
  for out in predict.generate_lines(
      model.params, model.model_config, model.config, model.target_tok,
      prompts, batch_size=args.batch_size, samples=args.num,
      max_new_tokens=args.max_new_tokens, max_len=args.max_len,
      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
      seed=args.seed, on_too_long=args.on_too_long,
      warn=lambda text: print(text, file=sys.stderr), chat=args.chat):
    print(json.dumps(out.record()) if args.jsonl else out.whole, flush=True)
  return 0


def cmd_evaluate(args, overrides) -> int:
  """A training workdir's own data files are read (and named in the
  report), an export's never (cli/workdir_data.py)."""
  from jaxformer.checkpoints import trained
  from jaxformer.cli import workdir_data
  from jaxformer.inference import evaluate, translator
  scorer = translation_flags.comet_model(args)
  data = workdir_data.workdir_data(args.workdir, overrides)
  overrides = [*overrides, *(f'--config.{k}={v}' for k, v in data.items())]
  members = translation_flags.members(args, overrides, load_translator)
  model = members[0]
  if len(members) > 1:
    scores, hypotheses = translator.decode_split(
        _evaluated_ensemble(args, members), model.config.data, args.split)
  else:
    scores, hypotheses = evaluate.decode_split(
        model.params, model.model_config, model.config, model.source_tok,
        model.target_tok, args.split, trained.local_mesh(),
        beam_size=args.beam, alpha=args.alpha)
  scores.update(translation_flags.comet_report(scorer, model.config.data,
                                               args.split, hypotheses))
  report = dict(scores, split=args.split, weights=model.weights,
                **translation_flags.ensemble_report(args))
  read = {k: v for k, v in data.items()
          if f'.{args.split}' in k or k.startswith('data.tfds.')}
  if read:
    report['data'] = read  # The workdir's files this command read.
  if args.hypotheses:
    paths.write_text(args.hypotheses, '\n'.join(hypotheses) + '\n')
    report['hypotheses'] = args.hypotheses
  print(json.dumps(report, indent=2))
  return 0


def add_model_args(p, overrides=True):
  if overrides:
    p.epilog = ('Config overrides of the saved config (decode.*, eval.*, '
                'the data files): --config.KEY=VALUE.')
  p.add_argument('--workdir', required=True, type=path,
                 help='a training workdir')
  p.add_argument('--checkpoint', type=NON_NEGATIVE_INT, default=None,
                 help='step to use (default: the latest)')
  add_weights_arg(p)


def add_weights_arg(p) -> None:
  p.add_argument('--weights', choices=('ema', 'raw'), default=None,
                 help='the moving average of the parameters (ema) or the '
                 'parameters (raw); default: ema where the run keeps one '
                 '(train.ema_decay > 0)')


def add_output_args(p, what: str, batches: str) -> None:
  p.add_argument(
      '--output', type=path, default=None,
      help=f'write the {what} to this file (local or gs://; .gz: '
      'compressed), one line per input line, in chunks that every process '
      'of the run shares out and commits under OUTPUT.parts/; the same '
      'command resumes a stopped run (default: stdout, as they come)')
  p.add_argument('--chunk-batches', type=POSITIVE_INT, default=16,
                 help=f'with --output: batches per committed chunk ({batches})')


def _evaluated_ensemble(args, members):
  """The `translator.Translation` by which `evaluate --ensemble` decodes a
  split: as the first member's decode.* say, unless --beam / --alpha."""
  from jaxformer.inference import translator
  config = members[0].config
  settings = translator.TranslateSettings(
      batch_size=config.decode.batch_size, chunk_batches=1,
      beam_size=config.decode.beam_size if args.beam is None else args.beam,
      alpha=config.decode.alpha if args.alpha is None else args.alpha,
      max_extra_len=config.decode.max_extra_len,
      max_source_length=config.data.max_source_length)
  return translator.Translation(members, settings)


def add_parsers(commands) -> None:
  """translate, predict, generate and evaluate (attention and curves:
  `plot_commands.py`)."""
  translate = commands.add_parser(
      'translate', help='translate lines from stdin (or --input) to stdout, '
      'or a corpus to --output on every process of a run')
  add_model_args(translate)
  add_input_args(translate, 'source sentences')
  add_output_args(translate, 'translations', 'their lines are grouped by '
                  'length into batches')
  add_language_args(translate)
  translate.add_argument('--beam', type=POSITIVE_INT, default=None)
  translate.add_argument('--alpha', type=NON_NEGATIVE_FLOAT, default=None)
  translate.add_argument('--max-extra-len', type=NON_NEGATIVE_INT,
                         default=None)
  translate.add_argument('--batch-size', type=POSITIVE_INT, default=32)
  translate.add_argument('--on-too-long', choices=('truncate', 'error'),
                         default='truncate')
  translation_flags.add_prefix_args(translate)
  translation_flags.add_ensemble_arg(translate)
  translate.set_defaults(run=cmd_translate)

  predict = commands.add_parser(
      'predict', help='classification labels or regression values of the '
      'lines of stdin (or --input)')
  add_model_args(predict)
  add_input_args(predict, 'texts')
  predict.add_argument('--batch-size', type=POSITIVE_INT, default=64)
  predict.add_argument('--jsonl', action='store_true',
                       help='print {"label", "logits"} (classification: the '
                       'raw logits) or {"values"} (regression) per line; a '
                       'tab in a line separates a sentence pair for models '
                       'with token types')
  predict.set_defaults(run=cmd_predict)

  generate = commands.add_parser(
      'generate', help='continue prompts with a language model (greedy or '
      'sampled), one output line per prompt (--jsonl: JSON objects)')
  add_model_args(generate)
  add_input_args(generate, 'prompts', default='--prompt')
  add_output_args(generate, 'continuations', 'its prompts are grouped by '
                  'length into batches; a prompt\'s samples depend on its '
                  'line number and --seed alone')
  generate.add_argument('--prompt', default=None,
                        help='text to continue (default: the empty text)')
  chat_args.add_chat_arg(generate)
  generate.add_argument('--num', type=POSITIVE_INT, default=1,
                        help='continuations of each prompt')
  generate.add_argument('--jsonl', action='store_true',
                        help='print {"prompt", "ids", "text"} per '
                        'continuation: its new token ids (ending with EOS '
                        'if one came) and their text')
  generate.add_argument('--temperature', type=NON_NEGATIVE_FLOAT, default=1.0,
                        help='0: greedy')
  generate.add_argument('--top-k', type=NON_NEGATIVE_INT, default=0,
                        help='0: off')
  generate.add_argument('--top-p', type=number(float, 'UNIT_INTERVAL'),
                        default=1.0, help='1: off')
  generate.add_argument('--max-new-tokens', type=POSITIVE_INT, default=None,
                        help='new tokens per prompt (default: as many as '
                        '--max-len leaves)')
  generate.add_argument('--max-len', type=NON_NEGATIVE_INT, default=0,
                        help='positions of a prompt and its continuation '
                        '(0: the model\'s max_len with --max-new-tokens, '
                        'else data.max_target_length)')
  generate.add_argument('--seed', type=NON_NEGATIVE_INT, default=0)
  generate.add_argument('--batch-size', type=POSITIVE_INT, default=32)
  generate.add_argument('--on-too-long', choices=('truncate', 'error'),
                        default='truncate', help='a prompt longer than '
                        '--max-len: cut it, with a warning, or stop')
  generate.set_defaults(run=cmd_generate)

  evaluate = commands.add_parser(
      'evaluate', help='BLEU/chrF (and COMET) of a split, printed as JSON')
  add_model_args(evaluate)
  evaluate.add_argument('--split', default='test',
                        choices=('train', 'dev', 'test'))
  add_language_args(evaluate)
  evaluate.add_argument('--beam', type=POSITIVE_INT, default=None)
  evaluate.add_argument('--alpha', type=NON_NEGATIVE_FLOAT, default=None)
  translation_flags.add_ensemble_arg(evaluate)
  translation_flags.add_comet_arg(evaluate)
  evaluate.add_argument('--hypotheses', type=path, default=None,
                        help='file to write the decoded split to, one line '
                        'each (default: none written)')
  evaluate.set_defaults(run=cmd_evaluate)
