"""Hugging Face Llama-family tokenizer folders built offline, as the hub
has them: byte-level BPE trained here with `tokenizers` (Llama 3 style:
tokenizer.json, PreTrainedTokenizerFast; Qwen2 style: Qwen2Tokenizer with
the chat template's tokens) and SentencePiece trained here (tokenizer.model
only, with tokenizer_config.json as Llama 2 and Mistral ship it)."""
import io
import json
import os
import random

import sentencepiece as spm

WORDS = ('the house is small . a cat sat on the mat , we bought forty-two '
         'red apples and 3 green pears ! where is the station ? she reads '
         "books every evening ; he doesn't write letters . it's 2024 : "
         'café naïve résumé über straße').split()
# Characters seldom or never in the training text: unknown to SentencePiece
# (byte fallback), single bytes to byte-level BPE.
RARE = ('東京', '中文字', '한국어', '😀', '👍🏽', '🇫🇷', 'e\u0301', 'Ångström',
        'ﬁ', '\u200b', '\x07', '\x00', '\t', '\n', '\r\n', '  ', '\u00a0',
        'Ωμέγα', 'ﾊﾝｶｸ', '\U0010ffff')
LLAMA3_SPECIAL = ['<|begin_of_text|>', '<|end_of_text|>', '<|start_header_id|>',
                  '<|end_header_id|>', '<|eot_id|>']
QWEN2_SPECIAL = ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
QWEN2_PLAIN_ADDED = '<tool_call>'  # An added token that decoding keeps.
SPM_CHAT = ['[INST]', '[/INST]']
# Every folder's special text, so that each folder also sees the others'
# as plain text.
SPECIAL_TEXT = (LLAMA3_SPECIAL + QWEN2_SPECIAL + [QWEN2_PLAIN_ADDED]
                + SPM_CHAT + ['<s>', '</s>', '<unk>', '<|im_st'])
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
                r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|"
                r"\s+")


def training_texts(count: int = 400, seed: int = 0) -> list[str]:
  rng = random.Random(seed)
  return [' '.join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
          for _ in range(count)]


def sentences(count: int = 300, seed: int = 1) -> list[str]:
  """Texts of known words, rare characters and special tokens' text, with
  spaces around them or not; the first few are edge cases."""
  rng = random.Random(seed)
  pool = WORDS * 3 + list(RARE) + SPECIAL_TEXT
  texts = ['', ' ', 'the', ' the', 'the ', '<|im_start|>user\nhi<|im_end|>\n',
           '<s>[INST] hi [/INST]</s>', '<|begin_of_text|><|eot_id|>']
  while len(texts) < count:
    parts = [rng.choice(pool) for _ in range(rng.randint(1, 14))]
    texts.append(''.join(p + rng.choice(['', ' ', ' ', '  '])
                         for p in parts))
  return texts


def _write_json(folder: str, name: str, data) -> None:
  with open(os.path.join(folder, name), 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=2, ensure_ascii=False)


def _train_byte_level(regex: str, nfc: bool, specials: list[str]):
  from tokenizers import (Regex, Tokenizer, decoders, models, normalizers,
                          pre_tokenizers, trainers)
  tok = Tokenizer(models.BPE())
  if nfc:
    tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(regex), behavior='isolated'),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(training_texts(), trainers.BpeTrainer(
      vocab_size=500, show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.add_special_tokens(specials)  # After the pieces, as the hub's are.
  return tok


def write_llama3(folder: str) -> dict:
  """A Llama 3 style folder: tokenizer.json whose post-processor adds
  <|begin_of_text|>, tokenizer_config.json as PreTrainedTokenizerFast
  saves it (with Meta's clean_up_tokenization_spaces=true), and a
  generation_config.json ending generation at two ids."""
  from tokenizers import processors
  from transformers import PreTrainedTokenizerFast
  tok = _train_byte_level(LLAMA3_REGEX, False, LLAMA3_SPECIAL)
  bos = tok.token_to_id('<|begin_of_text|>')
  tok.post_processor = processors.TemplateProcessing(
      single='<|begin_of_text|> $A:0',
      pair='<|begin_of_text|> $A:0 <|begin_of_text|>:1 $B:1',
      special_tokens=[('<|begin_of_text|>', bos)])
  hf = PreTrainedTokenizerFast(tokenizer_object=tok,
                               bos_token='<|begin_of_text|>',
                               eos_token='<|eot_id|>',
                               clean_up_tokenization_spaces=True)
  hf.save_pretrained(folder)
  eos_ids = [tok.token_to_id('<|end_of_text|>'), tok.token_to_id('<|eot_id|>')]
  _write_json(folder, 'generation_config.json',
              {'bos_token_id': bos, 'eos_token_id': eos_ids})
  _write_json(folder, 'config.json', {
      'model_type': 'llama', 'vocab_size': tok.get_vocab_size() + 11,
      'bos_token_id': bos, 'eos_token_id': eos_ids})
  return {'eos_ids': eos_ids, 'bos_id': bos, 'pad_id': eos_ids[0],
          'chat': LLAMA3_SPECIAL}


def write_qwen2(folder: str) -> dict:
  """A Qwen2 style folder: Qwen2Tokenizer (NFC, Qwen's regex, no BOS) with
  the chat template's tokens and a non-special added token."""
  from tokenizers import AddedToken
  from transformers import Qwen2Tokenizer
  from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
  model = json.loads(_train_byte_level(PRETOKENIZE_REGEX, True, []).to_str())
  hf = Qwen2Tokenizer(
      vocab=model['model']['vocab'],
      merges=[tuple(m) for m in model['model']['merges']],
      unk_token=None, eos_token='<|im_end|>', pad_token='<|endoftext|>',
      extra_special_tokens=['<|im_start|>', '<|im_end|>'],
      chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                    "{{ m['content'] }}<|im_end|>\n{% endfor %}")
  hf.add_tokens([AddedToken(QWEN2_PLAIN_ADDED, special=False)])
  hf.save_pretrained(folder)
  ids = hf.convert_tokens_to_ids
  eos_ids = [ids('<|im_end|>'), ids('<|endoftext|>')]
  _write_json(folder, 'generation_config.json', {'eos_token_id': eos_ids,
                                                 'pad_token_id': eos_ids[1]})
  _write_json(folder, 'config.json', {
      'model_type': 'qwen2', 'vocab_size': len(hf) + 64,
      'eos_token_id': eos_ids[1]})
  return {'eos_ids': eos_ids, 'bos_id': None, 'pad_id': eos_ids[1],
          'chat': ['<|im_start|>', '<|im_end|>', QWEN2_PLAIN_ADDED]}


def train_spm(user_defined: list[str]) -> bytes:
  """A SentencePiece BPE model trained as Llama 2's: byte fallback, no
  normalisation, digits split, <unk> <s> </s> = 0 1 2, no pad."""
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(training_texts()), model_writer=model,
      vocab_size=400, model_type='bpe', byte_fallback=True,
      normalization_rule_name='identity', remove_extra_whitespaces=False,
      split_digits=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
      user_defined_symbols=user_defined, character_coverage=0.9995,
      minloglevel=2)
  return model.getvalue()


def _added(content: str) -> dict:
  return {'content': content, 'lstrip': False, 'normalized': False,
          'rstrip': False, 'single_word': False, 'special': True}


def write_sentencepiece(folder: str, *, mistral: bool) -> dict:
  """tokenizer.model with tokenizer_config.json as Llama 2 ships it, or
  (mistral) as Mistral's: legacy, [INST]/[/INST] pieces as special added
  tokens, and here also add_eos_token."""
  os.makedirs(folder)
  chat = SPM_CHAT if mistral else []
  with open(os.path.join(folder, 'tokenizer.model'), 'wb') as f:
    f.write(train_spm(chat))
  pieces = ['<unk>', '<s>', '</s>'] + chat
  _write_json(folder, 'tokenizer_config.json', {
      'add_bos_token': True, 'add_eos_token': mistral,
      'added_tokens_decoder': {str(i): _added(p) for i, p in enumerate(pieces)},
      'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>',
      'pad_token': None, 'clean_up_tokenization_spaces': False,
      'legacy': mistral, 'model_max_length': 4096, 'sp_model_kwargs': {},
      'tokenizer_class': 'LlamaTokenizer'})
  _write_json(folder, 'special_tokens_map.json', {
      'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '<unk>'})
  _write_json(folder, 'generation_config.json', {
      'bos_token_id': 1, 'eos_token_id': 2, 'pad_token_id': 0})
  _write_json(folder, 'config.json', {
      'model_type': 'mistral' if mistral else 'llama', 'vocab_size': 400})
  return {'eos_ids': [2], 'bos_id': 1, 'pad_id': 0, 'chat': pieces}


FOLDERS = {
    'llama3-bytelevel': write_llama3,
    'qwen2-bytelevel': write_qwen2,
    'llama2-sentencepiece': lambda f: write_sentencepiece(f, mistral=False),
    'mistral-sentencepiece': lambda f: write_sentencepiece(f, mistral=True),
}
