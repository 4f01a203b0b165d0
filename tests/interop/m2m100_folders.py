"""Random-weight Hugging Face M2M100 and NLLB folders built offline: a
SentencePiece model trained here, the tokenizer's files (M2M100: vocab.json
in fairseq's order and the .model; NLLB: the tokenizer.json NllbTokenizer
converts it to, with its language codes) and an
`M2M100ForConditionalGeneration` of random weights."""
import json
import os

import marian_folders

# Words of two languages, so that sentences of both tokenise to pieces.
WORDS = marian_folders.WORDS + marian_folders.FOREIGN


def _m2m100_tokenizer_files(folder: str, model: bytes, language_codes: str,
                            left_out: int) -> tuple[int, int]:
  """vocab.json ('<s>' 0, '<pad>' 1, '</s>' 2, '<unk>' 3, then the pieces
  less the `left_out` last: unknown pieces), the SentencePiece model and
  tokenizer_config.json; returns the ids the tokenizer has and the first
  language token's."""
  import sentencepiece as spm
  from transformers.models.m2m_100 import tokenization_m2m_100 as tm
  processor = spm.SentencePieceProcessor()
  processor.LoadFromSerializedProto(model)
  vocab = {'<s>': 0, '<pad>': 1, '</s>': 2, '<unk>': 3}
  pieces = [processor.id_to_piece(i) for i in range(3, processor.vocab_size())]
  for piece in pieces[:len(pieces) - left_out]:
    vocab.setdefault(piece, len(vocab))
  with open(os.path.join(folder, 'sentencepiece.bpe.model'), 'wb') as f:
    f.write(model)
  with open(os.path.join(folder, 'vocab.json'), 'w') as f:
    json.dump(vocab, f)
  with open(os.path.join(folder, 'tokenizer_config.json'), 'w') as f:
    json.dump({'tokenizer_class': 'M2M100Tokenizer', 'src_lang': 'en',
               'language_codes': language_codes, 'num_madeup_words': 8}, f)
  return len(vocab) + len(tm.FAIRSEQ_LANGUAGE_CODES[language_codes]), len(
      vocab)


def _nllb_tokenizer_files(folder: str, model: bytes) -> tuple[int, int]:
  """The files NllbTokenizer saves (tokenizer.json, tokenizer_config.json)
  for the SentencePiece model, with NLLB-200's language codes; returns the
  ids it has and the first language token's."""
  import tempfile
  from transformers import AutoTokenizer
  from transformers.models.nllb import tokenization_nllb as tn
  with tempfile.TemporaryDirectory() as spm_folder:
    with open(os.path.join(spm_folder, 'sentencepiece.bpe.model'), 'wb') as f:
      f.write(model)
    with open(os.path.join(spm_folder, 'tokenizer_config.json'), 'w') as f:
      json.dump({'tokenizer_class': 'NllbTokenizer', 'src_lang': 'eng_Latn',
                 'additional_special_tokens': tn.FAIRSEQ_LANGUAGE_CODES}, f)
    tokenizer = AutoTokenizer.from_pretrained(spm_folder)
  tokenizer.src_lang = 'eng_Latn'
  tokenizer.save_pretrained(folder)
  return len(tokenizer), min(tokenizer.convert_tokens_to_ids(
      tn.FAIRSEQ_LANGUAGE_CODES))


def write_folder(folder: str, *, tokenizer: str, encoder_layers: int,
                 decoder_layers: int, seed: int, d_model: int = 16,
                 heads: int = 2, d_ff: int = 32, spm_size: int = 60,
                 scale_embedding: bool = True, extra_ids: int = 8,
                 language_codes: str = 'm2m100', eos_boost: float = 0.0
                 ) -> dict:
  """Writes an M2M100 (tokenizer='m2m100') or NLLB ('nllb') folder whose
  model has `extra_ids` ids past the tokenizer's (fairseq's made-up
  words) and whose decoder leans towards EOS by `eos_boost` (so that some
  outputs end before the length cap); returns {'config': M2M100Config,
  'model': ...}."""
  import torch
  from transformers import M2M100Config, M2M100ForConditionalGeneration
  os.makedirs(folder)
  texts = marian_folders.sentences(WORDS, 400, seed)
  if tokenizer == 'nllb':
    size, languages = _nllb_tokenizer_files(
        folder, marian_folders.train_spm(texts, spm_size, 'bpe'))
  else:
    size, languages = _m2m100_tokenizer_files(
        folder, marian_folders.train_spm(texts, spm_size, 'bpe'),
        language_codes, left_out=3)
  torch.manual_seed(seed)
  config = M2M100Config(
      vocab_size=size + extra_ids, d_model=d_model,
      encoder_layers=encoder_layers, decoder_layers=decoder_layers,
      encoder_attention_heads=heads, decoder_attention_heads=heads,
      encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff, max_position_embeddings=64,
      scale_embedding=scale_embedding, dropout=0.0, attention_dropout=0.0,
      activation_dropout=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
      pad_token_id=1, bos_token_id=0, eos_token_id=2,
      decoder_start_token_id=2)
  model = M2M100ForConditionalGeneration(config).eval()
  with torch.no_grad():  # Weights that make decoding depend on the source.
    for name, p in model.named_parameters():
      if 'layer_norm' in name:
        p.normal_(1.0 if name.endswith('weight') else 0.0, 0.2)
      elif name.endswith('bias'):
        p.normal_(0.0, 0.1)
      else:
        p.normal_(0.0, _std(name, scale_embedding))
    model.model.shared.weight[config.pad_token_id] = 0.0
    # Small language (and made-up word) rows: mostly text is generated.
    model.model.shared.weight[languages:] *= 0.2
    eos = model.model.shared.weight[config.eos_token_id]
    model.model.decoder.layer_norm.bias += eos_boost * eos / eos.norm()
  model.save_pretrained(folder)
  return {'config': config, 'model': model}


def _std(name: str, scale_embedding: bool) -> float:
  if 'shared' in name or 'embed' in name:
    return 0.3 if scale_embedding else 0.4
  if 'encoder_attn.v_proj' in name or 'encoder_attn.out_proj' in name:
    return 1.0
  return 0.3


def hf_tokenizer(folder: str):
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(folder)


def test_texts(count: int, seed: int) -> list[str]:
  """Sentences of known words, and some with unseen characters."""
  return marian_folders.test_texts(count, seed)
