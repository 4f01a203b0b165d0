"""Loading the PyTorch reference Transformer's weights gives the same logits."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
from torch import nn  # noqa: E402

from jaxformer.model import EncoderDecoder  # noqa: E402
from jaxformer.interop.torch_port import (config_from_state_dict,  # noqa: E402
                                        config_from_torch,
                                        params_from_torch_state_dict)

SRC_VOCAB, TGT_VOCAB, D_MODEL, HEADS, D_FF, MAX_LEN = 50, 40, 32, 4, 64, 64


class Transformer(nn.Module):
  """The seeds' PyTorch reference model (post-LN, ReLU, separate embeddings)."""

  def __init__(self, src_vocab_size, tgt_vocab_size, d_model, n_heads,
               num_encoder_layers, num_decoder_layers, d_ff, max_seq_len,
               dropout=0.1):
    super().__init__()
    self.d_model = d_model
    self.src_embed = nn.Embedding(src_vocab_size, d_model)
    self.tgt_embed = nn.Embedding(tgt_vocab_size, d_model)
    self.register_buffer('pe', self._make_pe(max_seq_len, d_model))
    encoder_layer = nn.TransformerEncoderLayer(d_model, n_heads, d_ff, dropout,
                                               batch_first=True)
    decoder_layer = nn.TransformerDecoderLayer(d_model, n_heads, d_ff, dropout,
                                               batch_first=True)
    self.encoder = nn.TransformerEncoder(encoder_layer, num_encoder_layers)
    self.decoder = nn.TransformerDecoder(decoder_layer, num_decoder_layers)
    self.output_proj = nn.Linear(d_model, tgt_vocab_size)
    self.dropout = nn.Dropout(dropout)
    for p in self.parameters():
      if p.dim() > 1:
        nn.init.xavier_uniform_(p)

  def _make_pe(self, max_len, d_model):
    pe = torch.zeros(1, max_len, d_model)
    pos = torch.arange(0, max_len).unsqueeze(1).float()
    div = torch.exp(torch.arange(0, d_model, 2).float() *
                    (-math.log(10000.0) / d_model))
    pe[0, :, 0::2] = torch.sin(pos * div)
    pe[0, :, 1::2] = torch.cos(pos * div)
    return pe

  def encode(self, src, src_key_padding_mask=None):
    x = self.dropout(self.src_embed(src) * math.sqrt(self.d_model))
    x = x + self.pe[:, :x.size(1)]
    return self.encoder(x, src_key_padding_mask=src_key_padding_mask)

  def decode(self, tgt, memory, tgt_mask=None, memory_key_padding_mask=None):
    x = self.dropout(self.tgt_embed(tgt) * math.sqrt(self.d_model))
    x = x + self.pe[:, :x.size(1)]
    return self.decoder(x, memory, tgt_mask=tgt_mask,
                        memory_key_padding_mask=memory_key_padding_mask)

  def forward(self, src, tgt, src_key_padding_mask=None, tgt_mask=None):
    memory = self.encode(src, src_key_padding_mask)
    out = self.decode(tgt, memory, tgt_mask, src_key_padding_mask)
    return self.output_proj(out)


def reference_model(seed=0):
  torch.manual_seed(seed)
  model = Transformer(SRC_VOCAB, TGT_VOCAB, D_MODEL, HEADS, 2, 2, D_FF,
                      MAX_LEN).eval()
  # Random non-trivial biases and LayerNorm parameters too.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.dim() == 1:
        p.uniform_(-0.5, 0.5) if 'bias' in name else p.uniform_(0.5, 1.5)
  return model


def padded_batch():
  """Two rows; token 0 is padding (at the end of source and target)."""
  rng = np.random.default_rng(0)
  src = rng.integers(1, SRC_VOCAB, size=(2, 9))
  tgt = rng.integers(1, TGT_VOCAB, size=(2, 7))
  src[0, 6:] = 0
  tgt[0, 4:] = 0
  src[1, 8:] = 0
  return src, tgt


def torch_logits(model, src, tgt):
  length = tgt.shape[1]
  causal = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
  with torch.no_grad():
    return model(torch.from_numpy(src), torch.from_numpy(tgt),
                 src_key_padding_mask=torch.from_numpy(src == 0),
                 tgt_mask=causal).numpy()


def jax_logits(config, params, src, tgt):
  """The torch decoder reads `tgt` as given (no shift): use decode_logits."""
  model = EncoderDecoder(config)
  variables = {'params': params}
  src_segments = jnp.asarray(src != 0, jnp.int32)
  tgt_segments = jnp.asarray(tgt != 0, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tgt.shape[1]), tgt.shape)
  encoded = model.apply(variables, jnp.asarray(src), method='encode')
  return np.asarray(model.apply(variables, encoded, src_segments,
                                jnp.asarray(tgt), tgt_segments, positions,
                                method='decode_logits'))


def test_config_from_torch_matches_the_reference_architecture():
  config = config_from_torch(reference_model())
  assert (config.vocab_size, config.output_vocab_size) == (SRC_VOCAB, TGT_VOCAB)
  assert (config.d_model, config.num_heads) == (D_MODEL, HEADS)
  assert config.d_ff == D_FF
  assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 2)
  assert config.max_len == MAX_LEN
  assert config.share_embeddings == 'none'
  assert config.norm_position == 'post'
  assert config.layer_norm_epsilon == 1e-5
  assert config.residual_dropout == config.attention_dropout == 0.1


# torch's encoder takes its nested-tensor fast path for padded batches in eval.
@pytest.mark.slow
@pytest.mark.filterwarnings('ignore:The PyTorch API of nested tensors')
@pytest.mark.parametrize('scan_layers', [False, True])
def test_converted_weights_give_the_reference_logits(scan_layers):
  torch_model = reference_model()
  src, tgt = padded_batch()
  config = config_from_torch(torch_model, scan_layers=scan_layers)
  params = params_from_torch_state_dict(torch_model.state_dict(), config)

  want = torch_logits(torch_model, src, tgt)
  got = jax_logits(config, params, src, tgt)

  assert got.shape == want.shape == (2, 7, TGT_VOCAB)
  # The reference has no target padding mask, so its padding queries attend
  # to the real targets before them; compare at real target positions only.
  real = tgt != 0
  np.testing.assert_allclose(got[real], want[real], atol=1e-4, rtol=0)


def test_numpy_state_dict_converts_like_tensors():
  torch_model = reference_model()
  tensors = torch_model.state_dict()
  arrays = {k: v.numpy() for k, v in tensors.items()}
  config = config_from_state_dict(arrays, num_heads=HEADS)
  from_arrays = params_from_torch_state_dict(arrays, config)
  from_tensors = params_from_torch_state_dict(tensors, config)
  jax.tree.map(np.testing.assert_array_equal, from_arrays, from_tensors)
  attention = from_arrays['encoder']['layer_0']['self_attention']
  assert attention['key']['kernel'].shape == (HEADS, D_MODEL // HEADS, D_MODEL)
  assert attention['out']['kernel'].shape == (D_MODEL, HEADS, D_MODEL // HEADS)


def test_missing_and_unexpected_keys_are_named():
  state_dict = {k: v.numpy() for k, v in reference_model().state_dict().items()}
  config = config_from_state_dict(state_dict, num_heads=HEADS)
  state_dict['decoder.layers.1.norm4.weight'] = state_dict.pop(
      'decoder.layers.1.norm3.weight')
  with pytest.raises(ValueError) as error:
    params_from_torch_state_dict(state_dict, config)
  assert "missing keys ['decoder.layers.1.norm3.weight']" in str(error.value)
  assert "unexpected keys ['decoder.layers.1.norm4.weight']" in str(error.value)


def test_shape_mismatch_is_named():
  state_dict = {k: v.numpy() for k, v in reference_model().state_dict().items()}
  config = config_from_state_dict(state_dict, num_heads=HEADS)
  state_dict['encoder.layers.0.linear1.weight'] = np.zeros((D_FF + 1, D_MODEL))
  with pytest.raises(ValueError, match=r"encoder\.layers\.0\.linear1\.weight"):
    params_from_torch_state_dict(state_dict, config)


def test_config_that_cannot_match_the_reference_is_rejected():
  state_dict = {k: v.numpy() for k, v in reference_model().state_dict().items()}
  config = config_from_state_dict(state_dict, num_heads=HEADS,
                                  norm_position='pre')
  with pytest.raises(ValueError, match='norm_position'):
    params_from_torch_state_dict(state_dict, config)


def test_position_table_other_than_sinusoidal_is_rejected():
  state_dict = {k: v.numpy() for k, v in reference_model().state_dict().items()}
  config = config_from_state_dict(state_dict, num_heads=HEADS)
  state_dict['pe'] = state_dict['pe'] * 2
  with pytest.raises(ValueError, match='sinusoidal'):
    params_from_torch_state_dict(state_dict, config)
