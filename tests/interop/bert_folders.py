"""Random-weight Hugging Face BERT, RoBERTa and XLM-R folders built
offline: a model of `BertConfig`, `RobertaConfig` or `XLMRobertaConfig`
with weights drawn here (every tensor, LayerNorm scales around 1, so that
a mapping error shows), saved with `save_pretrained` beside a tokenizer
trained here in the form the hub ships it: WordPiece as vocab.txt (with
do_lower_case / strip_accents) or tokenizer.json, byte-level BPE as
vocab.json + merges.txt, SentencePiece as XLM-R's sentencepiece.bpe.model
(fairseq's ids) or tokenizer.json."""
import io
import json
import os

import numpy as np

import hf_tokenizer_folders

BERT_SPECIAL = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']
ROBERTA_SPECIAL = ['<s>', '<pad>', '</s>', '<unk>', '<mask>']
LABELS5 = ['very bad', 'bad', 'neutral', 'good', 'very good']
# name -> (tokenizer, config class, model class, config arguments).
SHAPES = {
    # vocab.txt only, lower-cased; 2 labels; exact GELU; eps 1e-12.
    'bert-cls2-vocab-txt': ('wordpiece-lower', 'BertConfig',
                            'BertForSequenceClassification', dict(
                                hidden_size=32, num_attention_heads=4,
                                intermediate_size=48, num_hidden_layers=2,
                                max_position_embeddings=40, num_labels=2,
                                id2label={0: 'negative', 1: 'positive'})),
    # A base model without a pooler, tokenizer.json keeping case and
    # accents; imported with a fresh head of 3 classes.
    'bert-base-nopooler-json': ('wordpiece-cased-json', 'BertConfig',
                                'BertModel', dict(
                                    hidden_size=24, num_attention_heads=2,
                                    intermediate_size=40, num_hidden_layers=1,
                                    max_position_embeddings=64,
                                    type_vocab_size=3, add_pooling_layer=False)),
    # Regression (problem_type), 3 layers, vocab.json + merges.txt.
    'roberta-regression-bpe': ('bytelevel', 'RobertaConfig',
                               'RobertaForSequenceClassification', dict(
                                   hidden_size=32, num_attention_heads=2,
                                   intermediate_size=64, num_hidden_layers=3,
                                   max_position_embeddings=42, num_labels=1,
                                   problem_type='regression',
                                   type_vocab_size=1, pad_token_id=1,
                                   bos_token_id=0, eos_token_id=2)),
    # 5 labels, sentencepiece.bpe.model only (fairseq's id offset).
    'xlmr-cls5-sentencepiece': ('sentencepiece', 'XLMRobertaConfig',
                                'XLMRobertaForSequenceClassification', dict(
                                    hidden_size=32, num_attention_heads=4,
                                    intermediate_size=48, num_hidden_layers=2,
                                    max_position_embeddings=34, num_labels=5,
                                    id2label=dict(enumerate(LABELS5)),
                                    type_vocab_size=1, pad_token_id=1,
                                    bos_token_id=0, eos_token_id=2)),
    # The body of a masked-LM checkpoint (its LM head left behind),
    # tokenizer.json, tanh GELU; imported with a fresh head of 4 classes.
    'xlmr-masked-lm-json': ('sentencepiece-json', 'XLMRobertaConfig',
                            'XLMRobertaForMaskedLM', dict(
                                hidden_size=16, num_attention_heads=2,
                                intermediate_size=32, num_hidden_layers=1,
                                max_position_embeddings=66,
                                hidden_act='gelu_new', type_vocab_size=1,
                                pad_token_id=1, bos_token_id=0,
                                eos_token_id=2)),
}
# The fresh head's classes of the base models' imports.
NUM_LABELS = {'bert-base-nopooler-json': 3, 'xlmr-masked-lm-json': 4}


def _write_json(folder: str, name: str, data) -> None:
  with open(os.path.join(folder, name), 'w', encoding='utf-8') as f:
    json.dump(data, f, indent=2, ensure_ascii=False)


def _wordpiece_vocab(lowercase: bool) -> list[str]:
  from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
  from tokenizers import trainers
  tok = Tokenizer(models.WordPiece(unk_token='[UNK]'))
  tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
  tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
  tok.train_from_iterator(
      hf_tokenizer_folders.training_texts(), trainers.WordPieceTrainer(
          vocab_size=300, special_tokens=BERT_SPECIAL, show_progress=False))
  return [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]


def write_wordpiece(folder: str, lowercase: bool, as_json: bool,
                    strip_accents: bool | None = None) -> None:
  """vocab.txt with BertTokenizer's settings (lower-casing; accent
  stripping, None: with lower-casing), or that saved as tokenizer.json."""
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, 'vocab.txt'), 'w', encoding='utf-8') as f:
    f.write(''.join(f'{t}\n' for t in _wordpiece_vocab(lowercase)))
  _write_json(folder, 'tokenizer_config.json', {
      'tokenizer_class': 'BertTokenizer', 'do_lower_case': lowercase,
      'strip_accents': strip_accents, 'model_max_length': 512})
  if as_json:
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    os.remove(os.path.join(folder, 'vocab.txt'))
    tokenizer.save_pretrained(folder)


def write_bytelevel(folder: str) -> None:
  """RoBERTa's vocab.json and merges.txt."""
  from tokenizers import ByteLevelBPETokenizer
  os.makedirs(folder, exist_ok=True)
  tok = ByteLevelBPETokenizer()
  tok.train_from_iterator(hf_tokenizer_folders.training_texts(),
                          vocab_size=400, special_tokens=ROBERTA_SPECIAL,
                          show_progress=False)
  tok.save_model(folder)
  _write_json(folder, 'tokenizer_config.json',
              {'tokenizer_class': 'RobertaTokenizer'})


def write_sentencepiece(folder: str, as_json: bool) -> None:
  """XLM-R's sentencepiece.bpe.model (a unigram model, ids shifted by
  fairseq's offset in the tokenizer), or that saved as tokenizer.json."""
  import sentencepiece as spm
  os.makedirs(folder, exist_ok=True)
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(hf_tokenizer_folders.training_texts()),
      model_writer=model, vocab_size=80, model_type='unigram',
      hard_vocab_limit=False, minloglevel=2)
  with open(os.path.join(folder, 'sentencepiece.bpe.model'), 'wb') as f:
    f.write(model.getvalue())
  _write_json(folder, 'tokenizer_config.json',
              {'tokenizer_class': 'XLMRobertaTokenizer'})
  if as_json:
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    os.remove(os.path.join(folder, 'sentencepiece.bpe.model'))
    tokenizer.save_pretrained(folder)


TOKENIZERS = {
    'wordpiece-lower': lambda f: write_wordpiece(f, True, False),
    'wordpiece-cased-json': lambda f: write_wordpiece(f, False, True),
    'bytelevel': write_bytelevel,
    'sentencepiece': lambda f: write_sentencepiece(f, False),
    'sentencepiece-json': lambda f: write_sentencepiece(f, True),
}


def _randomize(model, seed: int) -> None:
  """Every weight drawn anew: matrices N(0, 1/fan_in), embeddings N(0,
  0.25), biases N(0, 0.01), LayerNorm scales N(1, 0.01)."""
  import torch
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, tensor in model.named_parameters():
      noise = torch.randn(tensor.shape, generator=generator)
      if tensor.ndim == 1 and name.endswith('weight'):  # A LayerNorm.
        tensor.copy_(1 + 0.1 * noise)
      elif name.endswith('bias'):
        tensor.copy_(0.1 * noise)
      elif 'embeddings' in name:
        tensor.copy_(0.5 * noise)
      else:
        tensor.copy_(noise / tensor.shape[1] ** 0.5)


def write_folder(folder: str, name: str, seed: int = 0):
  """Writes the folder of SHAPES[name]; returns its transformers config."""
  import torch
  import transformers
  tokenizer_name, config_class, model_class, arguments = SHAPES[name]
  TOKENIZERS[tokenizer_name](folder)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  arguments = dict(arguments)
  pooling = arguments.pop('add_pooling_layer', True)
  config = getattr(transformers, config_class)(
      vocab_size=len(tokenizer) + 3, **arguments)
  torch.manual_seed(seed)
  cls = getattr(transformers, model_class)
  model = (cls(config, add_pooling_layer=pooling) if model_class.endswith(
      'Model') else cls(config)).eval()
  _randomize(model, seed)
  model.save_pretrained(folder)
  return config


def hf_model(folder: str, name: str):
  """The folder's model in float32, eval mode: with its head, or the body
  of a base model."""
  import transformers
  auto = (transformers.AutoModelForSequenceClassification
          if SHAPES[name][2].endswith('ForSequenceClassification')
          else transformers.AutoModel)
  return auto.from_pretrained(folder).eval()


def hf_outputs(model, ids: np.ndarray, types: np.ndarray, pad_id: int):
  """[b, s] ids and token types -> the head's logits [b, labels], or the
  base model's first-token states [b, d]."""
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids, dtype=torch.long),
                attention_mask=torch.tensor(ids != pad_id, dtype=torch.long),
                token_type_ids=torch.tensor(types, dtype=torch.long))
  if hasattr(out, 'logits'):
    return out.logits.numpy()
  return out.last_hidden_state[:, 0].numpy()


def pad_rows(rows: list[list[int]], pad_id: int) -> np.ndarray:
  width = max(map(len, rows))
  return np.array([r + [pad_id] * (width - len(r)) for r in rows], np.int64)
