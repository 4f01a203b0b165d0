"""The commands that draw pictures: attention (the cross-attention of one
translation) and curves (a workdir's metrics)."""
from jaxformer.cli.arguments import NON_NEGATIVE_INT, path
from jaxformer.cli.model_commands import (add_language_args, add_model_args,
                                          load_translator)


def cmd_attention(args, overrides) -> int:
  import numpy as np
  from jaxformer.data import language_tokenizer
  from jaxformer.inference import search
  from jaxformer.inference import evaluate
  from jaxformer.inference import plots
  model = load_translator(args, overrides)
  config, model_config = model.config, model.model_config
  source_tok, target_tok = model.source_tok, model.target_tok
  rows, _ = evaluate.encode_sources(source_tok, [args.src],
                                    config.data.max_source_length)
  forced = language_tokenizer.first_id(target_tok)
  tokens, weights = search.greedy_decode(
      model.params, model_config, rows, return_attention=True,
      forced_ids=-1 if forced is None else forced,
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


def add_parsers(commands) -> None:
  """attention and curves."""
  attention = commands.add_parser(
      'attention', help='plot the cross-attention of one translation')
  add_model_args(attention)
  attention.add_argument('--src', required=True, help='the source sentence')
  add_language_args(attention)
  attention.add_argument('--layer', type=NON_NEGATIVE_INT, default=0)
  attention.add_argument('--head', type=NON_NEGATIVE_INT, default=None,
                         help='default: the mean over heads')
  attention.add_argument('--out', required=True, type=path,
                         help='a .png path')
  attention.set_defaults(run=cmd_attention)

  curves = commands.add_parser('curves',
                               help='plot loss/BLEU curves of a run')
  curves.add_argument('--workdir', required=True, type=path)
  curves.add_argument('--out', required=True, type=path, help='a .png path')
  curves.set_defaults(run=cmd_curves)
