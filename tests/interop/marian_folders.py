"""Random-weight Hugging Face Marian folders built offline: tiny
SentencePiece models trained here, Marian-style vocab.json files (EOS 0,
UNK 1, PAD last) and a `MarianMTModel` of random weights."""
import io
import json
import os
import random

import sentencepiece as spm

WORDS = ('the house is small . a cat sat on the mat . we bought forty-two red '
         'apples and three green pears . where is the station ? she reads '
         'books every evening , he writes letters . my friend lives near '
         'the river').split()
FOREIGN = ('das haus ist klein . eine katze sass auf der matte . wir kauften '
           'zweiundvierzig rote aepfel und drei gruene birnen . wo ist der '
           'bahnhof ? sie liest jeden abend buecher').split()


def sentences(words, count: int, seed: int) -> list[str]:
  rng = random.Random(seed)
  return [' '.join(rng.choice(words) for _ in range(rng.randint(3, 12)))
          for _ in range(count)]


def train_spm(texts, vocab_size: int, model_type: str = 'unigram') -> bytes:
  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(texts), model_writer=model,
      vocab_size=vocab_size, model_type=model_type, character_coverage=1.0,
      unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2,
      hard_vocab_limit=False)
  return model.getvalue()


def marian_vocab(model: bytes, left_out: int) -> dict:
  """Marian's vocab.json of a SentencePiece model: '</s>' 0, '<unk>' 1,
  the pieces (less the `left_out` last ones: unknown pieces), '<pad>' last."""
  processor = spm.SentencePieceProcessor()
  processor.LoadFromSerializedProto(model)
  pieces = [processor.id_to_piece(i) for i in range(3, processor.vocab_size())]
  pieces = pieces[:len(pieces) - left_out]
  vocab = {'</s>': 0, '<unk>': 1}
  for piece in pieces:
    vocab.setdefault(piece, len(vocab))
  vocab['<pad>'] = len(vocab)
  return vocab


def write_folder(folder: str, *, separate: bool, activation: str,
                 scale_embedding: bool, encoder_layers: int,
                 decoder_layers: int, seed: int, d_model: int = 16,
                 heads: int = 2, d_ff: int = 32, left_out: int = 3) -> dict:
  """Writes a Marian folder; returns {'config': MarianConfig, ...}."""
  import torch
  from transformers import MarianConfig, MarianMTModel
  os.makedirs(folder)
  source_model = train_spm(sentences(WORDS, 300, seed), 60)
  target_model = (train_spm(sentences(FOREIGN, 300, seed + 1), 50)
                  if separate else source_model)
  vocab = marian_vocab(source_model, left_out)
  files = {'source.spm': source_model, 'target.spm': target_model}
  target_vocab = marian_vocab(target_model, left_out) if separate else vocab
  for name, data in files.items():
    with open(os.path.join(folder, name), 'wb') as f:
      f.write(data)
  # One pad id for both sides, as Marian's configs have.
  size = max(len(vocab), len(target_vocab))
  vocab = _padded(vocab, size)
  target_vocab = _padded(target_vocab, size) if separate else vocab
  for name, v in (('vocab.json', vocab),) + (
      (('target_vocab.json', target_vocab),) if separate else ()):
    with open(os.path.join(folder, name), 'w') as f:
      json.dump(v, f)
  torch.manual_seed(seed)
  config = MarianConfig(
      vocab_size=size, decoder_vocab_size=size, d_model=d_model,
      encoder_layers=encoder_layers, decoder_layers=decoder_layers,
      encoder_attention_heads=heads, decoder_attention_heads=heads,
      encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff, max_position_embeddings=64,
      activation_function=activation, scale_embedding=scale_embedding,
      share_encoder_decoder_embeddings=not separate,
      pad_token_id=size - 1, eos_token_id=0, decoder_start_token_id=size - 1,
      forced_eos_token_id=None, dropout=0.0)
  model = MarianMTModel(config).eval()
  with torch.no_grad():  # Weights that make decoding depend on the source
    for name, p in model.named_parameters():  # (peaky attention), so that
      if 'layer_norm' not in name and 'embed_positions' not in name:
        p.normal_(0.0, _std(name, scale_embedding))
    model.final_logits_bias.normal_(0.0, 0.1)
    model.final_logits_bias[0, 0] += SCALES[scale_embedding]['eos_bias']
    for embed in {model.get_encoder().embed_tokens,
                  model.get_decoder().embed_tokens}:
      embed.weight[size - 1] = 0.0
  model.save_pretrained(folder)
  return {'config': config, 'model': model, 'vocab': vocab,
          'target_vocab': target_vocab}


# Weight scales found to give outputs that differ between sentences while
# float32 stays within ~3e-6 of float64 (larger weights, peakier attention:
# PyTorch's own float32 logits drift 1e-4..1e-3 from float64); by
# scale_embedding, as the embeddings are 4x larger with it.
SCALES = {True: dict(embed=0.3, cross=1.5, eos_bias=0.0),
          False: dict(embed=0.5, cross=1.0, eos_bias=0.5)}


def _std(name: str, scale_embedding: bool) -> float:
  if name.endswith('bias'):
    return 0.1
  if 'embed' in name or 'shared' in name:
    return SCALES[scale_embedding]['embed']
  if 'encoder_attn.v_proj' in name or 'encoder_attn.out_proj' in name:
    return SCALES[scale_embedding]['cross']
  return 0.3


def _padded(vocab: dict, size: int) -> dict:
  """vocab with filler pieces before '<pad>' so that it has `size` ids."""
  del vocab['<pad>']
  for i in range(size - 1 - len(vocab)):
    vocab[f'<filler{i}>'] = len(vocab)
  vocab['<pad>'] = len(vocab)
  return vocab


def hf_tokenizer(folder: str, separate: bool):
  from transformers import MarianTokenizer
  names = dict(source_spm=os.path.join(folder, 'source.spm'),
               target_spm=os.path.join(folder, 'target.spm'),
               vocab=os.path.join(folder, 'vocab.json'))
  if separate:
    names['target_vocab_file'] = os.path.join(folder, 'target_vocab.json')
  return MarianTokenizer(**names, separate_vocabs=separate)


def test_texts(count: int, seed: int) -> list[str]:
  """Sentences of known words, and some with unseen characters and
  pieces left out of the vocabulary."""
  texts = sentences(WORDS, count // 2, seed)
  odd = sentences(WORDS + ['zebra', 'quixotic', 'x!y', 'ñandú', '42'],
                  count - len(texts), seed + 1)
  return texts + odd




def up_to_eos(row, eos: int) -> list[int]:
  """The ids of `row` up to its first `eos` (kept), or all of them."""
  row = [int(t) for t in row]
  return row[:row.index(eos) + 1] if eos in row else row


def logit_difference(ours, hf_model, sources, targets) -> float:
  """The largest difference between the logits of `ours` (a
  `trained.Trained`) and of the Hugging Face model `hf_model` at the real
  target positions of source and target rows (padded with the pad id)."""
  import numpy as np
  import torch
  from jaxformer.model import EncoderDecoder
  pad = ours.model_config.pad_id
  mine = np.asarray(EncoderDecoder(ours.model_config).apply(
      {'params': ours.params}, sources, targets))
  with torch.no_grad():
    theirs = hf_model(
        input_ids=torch.tensor(sources, dtype=torch.long),
        attention_mask=torch.tensor(sources != pad),
        labels=torch.tensor(np.where(targets == pad, -100, targets),
                            dtype=torch.long)).logits.numpy()
  difference = float(np.abs(mine - theirs)[targets != pad].max())
  print(f'max abs logit difference: {difference:.3g} '
        f'(|logits| up to {np.abs(theirs).max():.3g})')
  return difference
