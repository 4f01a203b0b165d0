"""`generate --chat`: prompts rendered with the tokenizer's chat template
(data/chat_template.py)."""


def add_chat_arg(generate) -> None:
  generate.add_argument('--chat', action='store_true',
                        help='each prompt is a conversation ({"messages": '
                        '[...]}) or a user\'s text, rendered with the '
                        'tokenizer\'s chat template and its generation '
                        'prompt')


def check_chat(args) -> None:
  """--chat renders the prompts it prints; the --output path reads lines
  as they are."""
  if args.chat and args.output:
    raise ValueError('--chat applies to prompts printed (without '
                     '--output); render the conversations first.')
