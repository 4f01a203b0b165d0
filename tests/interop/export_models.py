"""Tiny random translation models with a tokenizer trained on the built-in
data, as `trained.Trained`, for the export tests (test_export_*.py)."""
import jax
import ml_collections
from flax.core import meta
import numpy as np

from jaxformer.checkpoints import trained as trained_lib
from jaxformer.config.settings import default_config
from jaxformer.data import builtin
from jaxformer.data.tokenizer import train_tokenizer
from jaxformer.model import EncoderDecoder, ModelConfig
from jaxformer.model.config import to_config_dict
from jaxformer.train.tasks import get_task

VOCAB = 100
PAIRS = builtin.generate(8, 0, 'test')
SENTENCES = [english for english, _ in PAIRS]
REFERENCES = [german for _, german in PAIRS]


def tokenizer(directory: str):
  pairs = builtin.generate(300, 0, 'train')
  return train_tokenizer(
      [text for pair in pairs for text in pair], f'{directory}/tok',
      ml_collections.ConfigDict(dict(type='unigram', vocab_size=VOCAB,
                                     character_coverage=1.0)))


def source_rows(tok, texts=SENTENCES) -> np.ndarray:
  """[len(texts), width] int32, right-padded with 0, EOS-terminated."""
  ids = tok.encode(texts)
  rows = np.zeros((len(ids), max(map(len, ids))), np.int32)
  for row, sentence in zip(rows, ids):
    row[:len(sentence)] = sentence
  return rows


def model(tok, seed: int = 0, scale: float = 1.0, **options):
  """A `Trained` of random parameters (times `scale`) with 1 encoder and 2
  decoder layers of width 32."""
  config = ModelConfig(vocab_size=VOCAB, d_model=32, num_heads=4, d_ff=64,
                       num_encoder_layers=1, num_decoder_layers=2, max_len=64,
                       **options)
  rows = source_rows(tok)
  params = EncoderDecoder(config).init(jax.random.PRNGKey(seed), rows,
                                       rows)['params']
  params = jax.tree.map(lambda x: x * scale, meta.unbox(params))
  run = default_config()
  run.model = to_config_dict(config)
  run.data.tokenizer.vocab_size = VOCAB
  return trained_lib.Trained(params, config, run, tok, tok, None,
                             get_task('translation'))


def until_eos(row, eos: int = 1) -> list[int]:
  """The tokens of a decoded row before EOS (all of them without one)."""
  row = [int(t) for t in row]
  return row[:row.index(eos)] if eos in row else row
