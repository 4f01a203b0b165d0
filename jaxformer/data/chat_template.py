"""Chat conversations rendered with a tokenizer's own chat template, as
transformers' `apply_chat_template` renders them: token ids and the mask
of the assistant's tokens (the loss falls there).

A conversation is `{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}` (one JSON object a line in a
JSONL file). The template (the folder's tokenizer_config.json
`chat_template`, or chat_template.jinja) is Jinja, rendered in a sandbox
with the settings, filters and globals transformers gives it (trim_blocks,
lstrip_blocks, loop controls, an unescaped `tojson`, `raise_exception`,
`strftime_now`) and the tokenizer's special tokens (`bos_token`, ...).
The assistant's tokens are those the template marks with
`{% generation %}...{% endgeneration %}` (transformers'
`return_assistant_tokens_mask`): every token whose characters overlap a
marked span. A template without such blocks marks each assistant turn by
rendering the conversation up to it (with the generation prompt) and up to
its end: the text between is the turn.

The rendered text is tokenized without added special tokens (the template
writes them), as `apply_chat_template` does.
"""
from __future__ import annotations

import datetime
import json
from collections.abc import Sequence

from jaxformer.data import sources

ROLES = ('system', 'user', 'assistant')
# Marks around a {% generation %} block's output while rendering; removed
# before tokenizing (Unicode noncharacters: never in text).
OPEN, CLOSE = '\ufdd0', '\ufdd1'


class ChatError(sources.DataError):
  """A conversation or template that cannot be rendered; the message names
  it and the fix."""


def template_of(tokenizer, name: str = 'the tokenizer') -> str:
  """The chat template a Hugging Face tokenizer's folder came with
  (chat_template.jinja, else tokenizer_config.json's chat_template, its
  'default' one where it holds several)."""
  files = getattr(tokenizer, 'files', {})
  if 'chat_template.jinja' in files:
    return files['chat_template.jinja']
  template = json.loads(files.get('tokenizer_config.json') or '{}').get(
      'chat_template')
  if isinstance(template, list):
    named = {t.get('name'): t.get('template') for t in template}
    template = named.get('default')
  if not isinstance(template, str) or not template:
    raise ChatError(f'{name} has no chat template (chat_template in '
                    'tokenizer_config.json, or chat_template.jinja): import '
                    'a model folder that has one, or add it there')
  return template


def special_tokens(tokenizer) -> dict[str, str]:
  """bos_token, eos_token, unk_token, pad_token as the template sees them:
  tokenizer_config.json's, else the pieces of the tokenizer's ids."""
  settings = json.loads(getattr(tokenizer, 'files', {}).get(
      'tokenizer_config.json') or '{}')
  tokens = {}
  for kind in ('bos', 'eos', 'unk', 'pad'):
    value = settings.get(f'{kind}_token')
    if isinstance(value, dict):
      value = value.get('content')
    token_id = getattr(tokenizer, f'{kind}_id', None)
    if value is None and token_id is not None:
      value = tokenizer.id_to_piece(token_id)
    if value is not None:
      tokens[f'{kind}_token'] = value
  return tokens


def _environment():
  """A sandboxed Jinja environment as transformers sets it up, with a
  `generation` tag that wraps its output in OPEN ... CLOSE."""
  import jinja2
  from jinja2 import ext, nodes, sandbox

  class GenerationMarks(ext.Extension):
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',),
                                     drop_needle=True)
      return nodes.CallBlock(self.call_method('_marked'), [], [],
                             body).set_lineno(lineno)

    def _marked(self, caller):
      return OPEN + caller() + CLOSE

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  environment = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[GenerationMarks, ext.loopcontrols])
  environment.filters['tojson'] = tojson
  environment.globals.update(
      raise_exception=raise_exception,
      strftime_now=lambda f: datetime.datetime.now().strftime(f))
  return environment


def render(template: str, messages: Sequence[dict], tokens: dict[str, str],
           add_generation_prompt: bool = False
           ) -> tuple[str, list[tuple[int, int]]]:
  """(the rendered text, the character spans of its generation blocks)."""
  import jinja2
  try:
    compiled = _environment().from_string(template)
    marked = compiled.render(messages=list(messages), tools=None,
                             documents=None,
                             add_generation_prompt=add_generation_prompt,
                             **tokens)
  except jinja2.exceptions.TemplateError as e:
    raise ChatError(f'the chat template cannot render this conversation: '
                    f'{e}') from None
  text, spans, start = [], [], None
  length = 0
  for char in marked:
    if char == OPEN:
      start = length
    elif char == CLOSE:
      spans.append((start, length))
    else:
      text.append(char)
      length += 1
  return ''.join(text), spans


def check_conversation(conversation, where: str,
                       needs_assistant: bool = True) -> list[dict]:
  """The messages of one conversation, each role known (and one of them
  the assistant's, if `needs_assistant`); a ChatError naming `where` (the
  file and line) otherwise."""
  messages = conversation.get('messages') if isinstance(
      conversation, dict) else None
  if not isinstance(messages, list) or not messages:
    raise ChatError(f'{where}: not a conversation; each line is '
                    '{"messages": [{"role": ..., "content": ...}, ...]}')
  for number, message in enumerate(messages, 1):
    role = message.get('role') if isinstance(message, dict) else None
    if role not in ROLES:
      raise ChatError(f'{where}: message {number} has role {role!r}; the '
                      f'roles are {", ".join(ROLES)}')
    if not isinstance(message.get('content'), str):
      raise ChatError(f'{where}: message {number} has no text content')
    if OPEN in message['content'] or CLOSE in message['content']:
      raise ChatError(f'{where}: message {number} holds the noncharacter '
                      'U+FDD0 or U+FDD1; remove it')
  if needs_assistant and not any(m['role'] == 'assistant'
                                 for m in messages):
    raise ChatError(f'{where}: no assistant turn, so nothing to train on; '
                    'each conversation needs one')
  return messages


def _turn_spans(template, messages, tokens, text) -> list[tuple[int, int]]:
  """Each assistant turn's characters in `text`, for a template without
  generation blocks: between the render up to it (with the generation
  prompt) and the render up to its end."""
  spans = []
  for index, message in enumerate(messages):
    if message['role'] != 'assistant':
      continue
    before, _ = render(template, messages[:index], tokens, True)
    through, _ = render(template, messages[:index + 1], tokens)
    if not (text.startswith(before) and text.startswith(through)):
      raise ChatError('the chat template renders an earlier part of the '
                      'conversation differently from the whole, so its '
                      'assistant turns cannot be found; add {% generation %}'
                      ' blocks around them in the template')
    spans.append((len(before), len(through)))
  return spans


def assistant_mask(offsets: Sequence[tuple[int, int]],
                   spans: Sequence[tuple[int, int]]) -> list[int]:
  """1 for each token whose characters overlap a span (spans and offsets
  in order), else 0."""
  mask = [0] * len(offsets)
  span = 0
  for token, (start, end) in enumerate(offsets):
    while span < len(spans) and start >= spans[span][1]:
      span += 1
    if span == len(spans):
      break
    if end > spans[span][0]:
      mask[token] = 1
  return mask


def conversation_ids(tokenizer, template: str, messages: Sequence[dict]
                     ) -> tuple[list[int], list[int]]:
  """(token ids, assistant mask) of a checked conversation, as
  `apply_chat_template(messages, return_dict=True,
  return_assistant_tokens_mask=True)` gives them."""
  tokens = special_tokens(tokenizer)
  text, spans = render(template, messages, tokens)
  if not spans:
    spans = _turn_spans(template, messages, tokens, text)
  ids, offsets = tokenizer.encode_with_offsets(text)
  return ids, assistant_mask(offsets, spans)


def prompt_ids(tokenizer, template: str, messages: Sequence[dict]
               ) -> list[int]:
  """The ids of a conversation to continue: rendered with the generation
  prompt (`add_generation_prompt=True`), as `generate --chat` feeds it."""
  text, _ = render(template, messages, special_tokens(tokenizer), True)
  return tokenizer.encode_with_offsets(text)[0]


def read_conversations(lines: Sequence[str], name: str) -> list[list[dict]]:
  """The checked conversations of JSONL lines (blank lines skipped)."""
  conversations = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    where = f'{name} line {number}'
    try:
      conversation = json.loads(line)
    except json.JSONDecodeError as e:
      raise ChatError(f'{where}: not JSON ({e.msg})') from None
    conversations.append(check_conversation(conversation, where))
  return conversations


def prompt_messages(line: str, where: str) -> list[dict]:
  """The messages of a prompt to continue: a JSON conversation, or plain
  text as one user message."""
  if not line.lstrip().startswith('{'):
    return [{'role': 'user', 'content': line}]
  try:
    conversation = json.loads(line)
  except json.JSONDecodeError as e:
    raise ChatError(f'{where}: not JSON ({e.msg})') from None
  return check_conversation(conversation, where, needs_assistant=False)
