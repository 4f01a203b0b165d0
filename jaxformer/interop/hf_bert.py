"""A jaxformer encoder-only classifier or regressor of BERT-family blocks as
a Hugging Face folder that `AutoModelForSequenceClassification` and
`AutoTokenizer.from_pretrained` load: config.json (model_type 'bert'
without a position offset, else 'xlm-roberta' for a SentencePiece
(Unigram) tokenizer or 'roberta'), model.safetensors and the tokenizer's
files (`HFTokenizer.hf_files`, with the encoder's special tokens named).
Written with safetensors alone.

The weights are named by bert.py's table (`weight_table`), the one both
directions read; the key bias jaxformer does without is written as zeros.
A model that is not of the family (`blockers`: pre-LN, RMSNorm, positions
other than learned, no embedding norm or pooler, ...) is refused, naming
the option.
"""
import json
import os

import numpy as np

from jaxformer.interop import bert, folders, hf_llama, layout, weight_table
from jaxformer.model.config import ModelConfig

# model.activation -> hidden_act.
ACTIVATIONS = {'gelu_exact': 'gelu', 'gelu': 'gelu_new', 'relu': 'relu'}


def blockers(config: ModelConfig) -> list[str]:
  """Why `config` is not a BERT-family encoder: one reason per option."""
  wanted = {'norm_position': 'post', 'norm_type': 'layer', 'norm_bias': True,
            'use_bias': True, 'position_embedding': 'learned',
            'embedding_norm': True, 'pooler': True, 'pooling': 'first',
            'scale_embedding': False, 'zero_pad_embedding': False}
  reasons = layout.option_blockers(config, wanted)
  if config.activation not in ACTIVATIONS:
    reasons.append(f'model.activation={config.activation!r} (the family has '
                   f'{", ".join(ACTIVATIONS)})')
  if not config.type_vocab_size:
    reasons.append('model.type_vocab_size=0 (the family has token types)')
  if config.position_offset not in (0, config.pad_id + 1):
    reasons.append(f'model.position_offset={config.position_offset} (the '
                   'family counts positions from 0, or from pad_id + 1)')
  return reasons + layout.paper_attention_blockers(config)


def model_type(config: ModelConfig, tokenizer) -> str:
  if not config.position_offset:
    return 'bert'
  kind = json.loads(tokenizer.hf_files()['tokenizer.json'])['model']['type']
  return 'xlm-roberta' if kind == 'Unigram' else 'roberta'


ARCHITECTURES = {'bert': 'BertForSequenceClassification',
                 'roberta': 'RobertaForSequenceClassification',
                 'xlm-roberta': 'XLMRobertaForSequenceClassification'}


def hf_config(config: ModelConfig, kind: str, task: str, labels,
              bos_id: int | None = None) -> dict:
  """config.json of `config` (bert.model_config's inverse)."""
  size = config.num_classes if task == 'classification' else (
      config.regression_dim)
  names = list(labels) or [f'LABEL_{i}' for i in range(size)]
  if task == 'regression':
    names = [f'LABEL_{i}' for i in range(size)]
  hf = dict(
      architectures=[ARCHITECTURES[kind]], model_type=kind,
      vocab_size=config.vocab_size, hidden_size=config.d_model,
      num_hidden_layers=config.num_encoder_layers,
      num_attention_heads=config.num_heads, intermediate_size=config.d_ff,
      hidden_act=ACTIVATIONS[config.activation],
      hidden_dropout_prob=config.residual_dropout,
      attention_probs_dropout_prob=config.attention_dropout,
      max_position_embeddings=config.max_len + config.position_offset,
      type_vocab_size=config.type_vocab_size,
      layer_norm_eps=config.layer_norm_epsilon, pad_token_id=config.pad_id,
      position_embedding_type='absolute',
      problem_type=('single_label_classification' if task == 'classification'
                    else 'regression'),
      id2label={str(i): name for i, name in enumerate(names)},
      label2id={name: i for i, name in enumerate(names)},
      torch_dtype='float32')
  if kind != 'bert':
    hf.update(bos_token_id=bos_id, eos_token_id=config.eos_id)
  return hf


def state_dict(params, config: ModelConfig, kind: str, task: str
               ) -> dict[str, np.ndarray]:
  """The Hugging Face tensors of `params` (float32), named and shaped by
  bert.py's table; the key biases zeros."""
  params = layout.numpy_tree(params)
  body = params['body']
  body['encoder'] = layout.looped(body['encoder'], config.num_encoder_layers)
  return weight_table.write(
      params, bert.weight_table(config, kind, task, with_head=True))


def tokenizer_files(tokenizer) -> dict[str, bytes]:
  """The tokenizer's Hugging Face files, tokenizer_config.json naming the
  encoder's special tokens (what it puts first and last, pad, unknown,
  mask) where the folder's did not."""
  files = tokenizer.hf_files()
  settings = json.loads(files['tokenizer_config.json'])
  first = tokenizer.encode([''])[0]
  piece = tokenizer.id_to_piece
  special = {'cls_token': first[0], 'sep_token': tokenizer.eos_id,
             'pad_token': tokenizer.pad_id, 'unk_token': tokenizer.unk_id}
  if tokenizer.bos_id is not None:  # RoBERTa's <s> and </s>; not BERT's.
    special.update(bos_token=tokenizer.bos_id, eos_token=tokenizer.eos_id)
  for name, token_id in special.items():
    if token_id is not None:
      settings.setdefault(name, piece(token_id))
  added = [t['content'] for t in json.loads(files['tokenizer.json']).get(
      'added_tokens', [])]
  for mask in ('[MASK]', '<mask>'):
    if mask in added:
      settings.setdefault('mask_token', mask)
  files['tokenizer_config.json'] = json.dumps(
      {k: v for k, v in settings.items() if v is not None}, indent=2,
      ensure_ascii=False).encode()
  return files


def check_exportable(trained, what: str) -> None:
  """Raises naming what keeps `trained` from being written as a
  BERT-family model in `what` ('--format hf' ...)."""
  if trained.task.name not in ('classification', 'regression'):
    raise ValueError(f'{what} writes encoder-only models as BERT-family '
                     f'models; this one was trained for '
                     f'task={trained.task.name!r}.')
  reasons = blockers(trained.model_config)
  if reasons:
    raise ValueError(f'{what}: this encoder is not of the BERT family: '
                     + '; '.join(reasons) + '.')
  if not trained.source_tok.hf_files():
    raise ValueError(f'{what} writes Hugging Face tokenizers (of imported '
                     "models); this model's tokenizer is jaxformer's own "
                     'SentencePiece model.')


def export(trained, out: str) -> tuple[str, str]:
  """Writes `trained` (a `trained.Trained` encoder of the family) as a
  Hugging Face folder to the new local folder `out`; returns it and its
  model_type."""
  check_exportable(trained, '--format hf')
  config, tokenizer, task = (trained.model_config, trained.source_tok,
                             trained.task.name)
  kind = model_type(config, tokenizer)
  state = state_dict(trained.params, config, kind, task)
  hf = hf_config(config, kind, task, trained.config.data.labels,
                 tokenizer.encode([''])[0][0])

  def fill(directory: str) -> None:
    hf_llama.write_weights(directory, state)
    with open(os.path.join(directory, 'config.json'), 'w',
              encoding='utf-8') as f:
      json.dump(hf, f, indent=2, ensure_ascii=False)
    for name, contents in tokenizer_files(tokenizer).items():
      with open(os.path.join(directory, name), 'wb') as f:
        f.write(contents)

  return folders.write_folder(out, fill), kind
