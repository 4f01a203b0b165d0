"""Chat conversations rendered with the tokenizer folder's own chat template
(data/chat_template.py): token ids and assistant masks equal transformers'
`apply_chat_template(..., return_dict=True,
return_assistant_tokens_mask=True)` for Llama-3-, Qwen2- and Mistral-style
templates; bad conversations and a missing template fail with one line."""
import json
import os

import pytest

transformers = pytest.importorskip('transformers')
pytest.importorskip('tokenizers')

import hf_tokenizer_folders  # noqa: E402

from jaxformer.data import chat_template  # noqa: E402
from jaxformer.interop import hf_folders  # noqa: E402

LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{% if m['role'] == 'assistant' %}{% generation %}"
    "{{ m['content'] | trim }}<|eot_id|>{% endgeneration %}{% else %}"
    "{{ m['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}")
QWEN2 = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
    "[INST] {{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %}"
    "{% generation %} {{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}")
# folder -> (template, where it is kept).
STYLES = {'llama3-bytelevel': (LLAMA3, 'jinja'),
          'qwen2-bytelevel': (QWEN2, 'jinja'),
          'mistral-sentencepiece': (MISTRAL, 'tokenizer_config')}
CONVERSATIONS = [
    [{'role': 'user', 'content': 'What is 2 + 2?'},
     {'role': 'assistant', 'content': 'It is 4.'}],
    [{'role': 'system', 'content': 'Answer briefly, Ωμέγα.'},
     {'role': 'user', 'content': 'Name a colour.'},
     {'role': 'assistant', 'content': 'Blue'},
     {'role': 'user', 'content': 'Another one, in full sentences please.'},
     {'role': 'assistant', 'content': 'Green is another colour ﬁne.'}],
]


def write_folder(root, name: str, template: str, where: str) -> str:
  folder = str(root / name)
  hf_tokenizer_folders.FOLDERS[name](folder)
  if where == 'jinja':
    with open(os.path.join(folder, 'chat_template.jinja'), 'w') as f:
      f.write(template)
  else:
    path = os.path.join(folder, 'tokenizer_config.json')
    settings = json.load(open(path))
    settings['chat_template'] = template
    json.dump(settings, open(path, 'w'))
  return folder


@pytest.fixture(scope='module', params=sorted(STYLES))
def style(request, tmp_path_factory):
  template, where = STYLES[request.param]
  folder = write_folder(tmp_path_factory.mktemp('chat'), request.param,
                        template, where)
  return (hf_folders.load_tokenizer(folder),
          transformers.AutoTokenizer.from_pretrained(folder))


@pytest.mark.parametrize('number', range(len(CONVERSATIONS)))
def test_ids_and_assistant_mask_equal_apply_chat_template(style, number):
  ours, theirs = style
  messages = CONVERSATIONS[number]
  expected = theirs.apply_chat_template(
      messages, tokenize=True, return_dict=True,
      return_assistant_tokens_mask=True)
  template = chat_template.template_of(ours)
  ids, mask = chat_template.conversation_ids(ours, template, messages)
  assert ids == list(expected['input_ids'])
  assert mask == list(expected['assistant_masks'])
  assert sum(mask) > 2 and 0 in mask


def test_the_generation_prompt_equals_apply_chat_template(style):
  ours, theirs = style
  messages = CONVERSATIONS[1][:-1]
  expected = theirs.apply_chat_template(messages, tokenize=True,
                                        add_generation_prompt=True,
                                        return_dict=True)['input_ids']
  assert chat_template.prompt_ids(
      ours, chat_template.template_of(ours), messages) == list(expected)


def test_a_template_without_generation_blocks_masks_each_turn(tmp_path):
  template = LLAMA3.replace('{% generation %}', '').replace(
      '{% endgeneration %}', '')
  folder = write_folder(tmp_path, 'llama3-bytelevel', template, 'jinja')
  ours = hf_folders.load_tokenizer(folder)
  theirs = transformers.AutoTokenizer.from_pretrained(folder)
  messages = CONVERSATIONS[1]
  ids, mask = chat_template.conversation_ids(ours, template, messages)
  assert ids == theirs.apply_chat_template(messages, tokenize=True,
                                           return_dict=True)['input_ids']
  masked = theirs.decode([i for i, m in zip(ids, mask) if m])
  assert masked == 'Blue<|eot_id|>Green is another colour ﬁne.<|eot_id|>'


def test_a_folder_without_a_template_says_so(tmp_path):
  folder = str(tmp_path / 'plain')
  hf_tokenizer_folders.FOLDERS['llama2-sentencepiece'](folder)
  with pytest.raises(chat_template.ChatError) as error:
    chat_template.template_of(hf_folders.load_tokenizer(folder), folder)
  assert str(error.value) == (
      f'{folder} has no chat template (chat_template in '
      'tokenizer_config.json, or chat_template.jinja): import a model folder '
      'that has one, or add it there')


@pytest.mark.parametrize('line, words', [
    ('{"messages": [{"role": "user", "content": "hi"}]}',
     'line 2: no assistant turn'),
    ('{"messages": [{"role": "bot", "content": "hi"}]}',
     "line 2: message 1 has role 'bot'; the roles are system, user, "
     'assistant'),
    ('{"text": "hi"}', 'line 2: not a conversation'),
    ('{"messages": [', 'line 2: not JSON')])
def test_bad_conversations_fail_with_one_line(line, words):
  good = json.dumps({'messages': CONVERSATIONS[0]})
  with pytest.raises(chat_template.ChatError) as error:
    chat_template.read_conversations([good, line], 'train.jsonl')
  assert str(error.value).startswith(f'train.jsonl {words}')
  assert len(str(error.value).splitlines()) == 1


def test_chat_rows_train_on_the_assistant_tokens(style):
  """data.lm_rows='chat': a conversation a row, the BOS the template
  writes left to the model's start token (a tokenizer without BOS: the
  first token starts the row), the loss mask the assistant mask."""
  import ml_collections
  from jaxformer.data import lm_rows
  ours, _ = style
  lines = [json.dumps({'messages': c}) for c in CONVERSATIONS]
  rows = lm_rows.language_model_rows(
      ml_collections.ConfigDict(dict(max_target_length=300, lm_rows='chat')),
      lines, [''] * len(lines), 'train', ours)
  template = chat_template.template_of(ours)
  for row, messages in enumerate(CONVERSATIONS):
    ids, mask = chat_template.conversation_ids(ours, template, messages)
    start = rows[lm_rows.ROW_START][row]
    if ours.bos_id is not None:
      assert ids[0] == ours.bos_id and start == -1
    else:
      assert start == ids[0]
    length = len(ids) - 1
    assert list(rows['targets'][row, :length]) == ids[1:]
    assert list(rows[lm_rows.LOSS_MASK][row, :length]) == mask[1:]
    assert not rows['targets_segment_ids'][row, length:].any()


@pytest.mark.parametrize('source', ['text', 'jsonl'])
def test_chat_rows_from_the_token_cache_are_the_rows_made_in_memory(
    style, source, tmp_path):
  """The input engine's chat rows (a JSON line of data.source=text, or a
  record's 'messages' of data.source=jsonl), tokenized in pieces, equal
  `language_model_rows`' of the whole split."""
  import ml_collections
  import numpy as np
  from jaxformer.data import lm_rows, task_batches
  from jaxformer.data.defaults import default_data_config
  ours, _ = style
  lines = [json.dumps({'messages': c, 'id': i})
           for i, c in enumerate(CONVERSATIONS * 4)]
  (tmp_path / 'chat.jsonl').write_text('\n'.join(lines) + '\n')
  config = ml_collections.ConfigDict(dict(
      task='language_model', model=dict(), init=dict(pretrained=''),
      data=default_data_config()))
  config.data.update(source=source, lm_rows='chat', max_target_length=300,
                     token_cache_piece_bytes=600)
  config.data[source].train = str(tmp_path / 'chat.jsonl')
  table = task_batches.task_table(config, 'train', ours,
                                  str(tmp_path / 'cache'))
  rows = table.take(np.arange(table.num_rows))
  expected = lm_rows.language_model_rows(config.data, lines,
                                         [''] * len(lines), 'train', ours)
  assert sorted(rows) == sorted(expected)
  for key in expected:
    np.testing.assert_array_equal(rows[key], expected[key], err_msg=key)


def test_generate_chat_prompts_are_the_generation_prompt(style):
  """`generate --chat`: a line of JSON is a conversation, any other text
  a user's message; both rendered with the generation prompt."""
  from jaxformer.inference import predict
  ours, theirs = style
  conversation = CONVERSATIONS[1][:-1]
  batch = [(1, 0, json.dumps({'messages': conversation})),
           (2, 0, 'Name a colour.')]
  expected = [theirs.apply_chat_template(
      messages, tokenize=True, add_generation_prompt=True,
      return_dict=True)['input_ids'] for messages in (
          conversation, [{'role': 'user', 'content': 'Name a colour.'}])]
  assert predict.chat_prompt_tokens(ours, batch) == expected
  with pytest.raises(chat_template.ChatError, match="prompt 1: message 1 "
                     "has role 'robot'"):
    predict.chat_prompt_tokens(ours, [(1, 0, json.dumps({'messages': [
        {'role': 'robot', 'content': 'x'}]}))])
