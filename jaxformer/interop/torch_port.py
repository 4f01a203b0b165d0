"""Loading weights of a PyTorch `nn.Transformer`-style translation model.

The supported model is the common PyTorch reference: separate source and
target `nn.Embedding`s scaled by sqrt(d_model), the sinusoidal table of the
paper added to them (buffer `pe`, [1, max_len, d_model]), an
`nn.TransformerEncoder` and `nn.TransformerDecoder` of post-LN ReLU layers
with `batch_first=True` and no final norm, and a biased `nn.Linear` output
projection. Its `state_dict` keys are

  src_embed.weight, tgt_embed.weight, pe (optional), output_proj.{weight,bias},
  encoder.layers.{i}.{self_attn.in_proj_*, self_attn.out_proj.*,
                      linear1.*, linear2.*, norm1.*, norm2.*},
  decoder.layers.{i}.{self_attn.*, multihead_attn.*, linear1.*, linear2.*,
                      norm1.*, norm2.*, norm3.*}.

The matching jaxformer model is `EncoderDecoder` with share_embeddings='none',
norm_position='post', activation='relu', sinusoidal positions and
layer_norm_epsilon=1e-5 (PyTorch's default); `config_from_torch` and
`config_from_state_dict` build that config. The one remaining difference is
in training only: the reference applies embedding dropout before adding
positions, jaxformer after.

Usage:

  config = config_from_torch(torch_model)            # or config_from_state_dict
  params = params_from_torch_state_dict(torch_model.state_dict(), config)
  model = EncoderDecoder(config)
  encoded = model.apply({'params': params}, src, method='encode')
  logits = model.apply({'params': params}, encoded, src_segment_ids, tgt_in,
                       tgt_segment_ids, tgt_positions, method='decode_logits')

The torch model's decoder reads its target input unshifted, so call
`decode_logits` with what it would be given (`EncoderDecoder.__call__` shifts
targets right with start token 0). Source padding must be token 0.

Conversion needs only numpy: torch is never imported here; tensors are turned
into arrays with `.detach().cpu().float().numpy()`.
"""
from typing import Any, Mapping

import jax
import numpy as np
from flax import linen as nn

from jaxformer.model.config import ModelConfig
from jaxformer.model.layers import sinusoidal_positions
from jaxformer.model.transformer import EncoderDecoder

# jaxformer layer module -> torch layer submodule, per stack.
_ENCODER_ATTENTION = {'self_attention': 'self_attn'}
_DECODER_ATTENTION = {'self_attention': 'self_attn',
                      'cross_attention': 'multihead_attn'}
_ENCODER_NORMS = {'self_attention_norm': 'norm1', 'ffn_norm': 'norm2'}
_DECODER_NORMS = {'self_attention_norm': 'norm1',
                  'cross_attention_norm': 'norm2', 'ffn_norm': 'norm3'}


def config_from_state_dict(state_dict: Mapping[str, Any], num_heads: int,
                           **overrides) -> ModelConfig:
  """The ModelConfig of the reference model whose weights are `state_dict`.

  Sizes (vocabularies, d_model, d_ff, layer counts, max_len from `pe`) are
  read from the shapes; `num_heads` is not in the weights and must be given.
  `overrides` set any other ModelConfig field (dropouts, scan_layers, ...).
  """
  def shape(key):
    if key not in state_dict:
      raise ValueError(f'state_dict has no {key!r}; is it the reference '
                       'Transformer (src_embed, tgt_embed, encoder, decoder, '
                       'output_proj)?')
    return tuple(state_dict[key].shape)

  vocab_size, d_model = shape('src_embed.weight')
  target_vocab_size = shape('tgt_embed.weight')[0]
  d_ff = shape('encoder.layers.0.linear1.weight')[0]

  def num_layers(prefix):
    return len({k.split('.')[2] for k in state_dict if k.startswith(prefix)})

  values = dict(
      vocab_size=vocab_size, target_vocab_size=target_vocab_size,
      d_model=d_model, num_heads=num_heads, d_ff=d_ff,
      num_encoder_layers=num_layers('encoder.layers.'),
      num_decoder_layers=num_layers('decoder.layers.'),
      share_embeddings='none', norm_position='post', activation='relu',
      position_embedding='sinusoidal', layer_norm_epsilon=1e-5, use_bias=True)
  if 'pe' in state_dict:
    values['max_len'] = shape('pe')[-2]
  values.update(overrides)
  return ModelConfig(**values)


def config_from_torch(model, **overrides) -> ModelConfig:
  """The ModelConfig of a reference torch model instance: sizes from its
  weights, heads, LayerNorm epsilon and dropout rates from its first encoder
  layer. Rejects pre-LN (`norm_first=True`) and non-ReLU layers, which the
  converted model would not reproduce."""
  layer = model.encoder.layers[0]
  if getattr(layer, 'norm_first', False):
    raise ValueError('norm_first=True (pre-LN) torch layers are not supported: '
                     'the reference has no final LayerNorm, jaxformer pre-LN '
                     'has one.')
  activation = getattr(layer.activation, '__name__', repr(layer.activation))
  if activation != 'relu':
    raise ValueError(f'Only ReLU torch layers are supported, got {activation}.')
  rate = float(layer.dropout.p)
  values = dict(layer_norm_epsilon=float(layer.norm1.eps),
                embedding_dropout=rate, residual_dropout=rate,
                attention_dropout=float(layer.self_attn.dropout),
                ffn_dropout=rate)
  values.update(overrides)
  return config_from_state_dict(model.state_dict(),
                                num_heads=layer.self_attn.num_heads, **values)


def _to_numpy(value) -> np.ndarray:
  if hasattr(value, 'detach'):  # A torch tensor.
    value = value.detach().cpu().float().numpy()
  return np.asarray(value, dtype=np.float32)


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Every state_dict key of the reference model and its torch shape."""
  d, f = config.d_model, config.d_ff
  shapes = {
      'src_embed.weight': (config.vocab_size, d),
      'tgt_embed.weight': (config.output_vocab_size, d),
      'output_proj.weight': (config.output_vocab_size, d),
      'output_proj.bias': (config.output_vocab_size,),
  }

  def add_layer(prefix, attentions, norms):
    for torch_name in attentions.values():
      shapes[f'{prefix}.{torch_name}.in_proj_weight'] = (3 * d, d)
      shapes[f'{prefix}.{torch_name}.in_proj_bias'] = (3 * d,)
      shapes[f'{prefix}.{torch_name}.out_proj.weight'] = (d, d)
      shapes[f'{prefix}.{torch_name}.out_proj.bias'] = (d,)
    shapes.update({f'{prefix}.linear1.weight': (f, d),
                   f'{prefix}.linear1.bias': (f,),
                   f'{prefix}.linear2.weight': (d, f),
                   f'{prefix}.linear2.bias': (d,)})
    for torch_name in norms.values():
      shapes[f'{prefix}.{torch_name}.weight'] = (d,)
      shapes[f'{prefix}.{torch_name}.bias'] = (d,)

  for i in range(config.num_encoder_layers):
    add_layer(f'encoder.layers.{i}', _ENCODER_ATTENTION, _ENCODER_NORMS)
  for i in range(config.num_decoder_layers):
    add_layer(f'decoder.layers.{i}', _DECODER_ATTENTION, _DECODER_NORMS)
  return shapes


def _check_config(config: ModelConfig):
  wanted = dict(share_embeddings='none', norm_position='post',
                activation='relu', position_embedding='sinusoidal',
                use_bias=True)
  wrong = {k: getattr(config, k) for k, v in wanted.items()
           if getattr(config, k) != v}
  if wrong:
    raise ValueError(f'The torch reference model needs config {wanted}; '
                     f'got {wrong}. Use config_from_torch or '
                     'config_from_state_dict.')


def params_from_torch_state_dict(state_dict: Mapping[str, Any],
                                 config: ModelConfig) -> dict:
  """Converts the reference model's `state_dict` to `EncoderDecoder(config)`
  parameters (the tree under 'params'), looped (`layer_{i}`) or stacked
  (`layers`, when config.scan_layers).

  Raises:
    ValueError: naming missing or unexpected keys, a shape that does not
      match `config`, a `pe` buffer that is not the sinusoidal table, or a
      config that cannot match the reference.
  """
  _check_config(config)
  expected = _expected_shapes(config)
  missing = sorted(set(expected) - set(state_dict))
  unexpected = sorted(set(state_dict) - set(expected) - {'pe'})
  if missing or unexpected:
    raise ValueError(f'state_dict does not match the config: missing keys '
                     f'{missing}, unexpected keys {unexpected}.')
  sd = {key: _to_numpy(value) for key, value in state_dict.items()}
  for key, shape in expected.items():
    if sd[key].shape != shape:
      raise ValueError(f'state_dict[{key!r}] has shape {sd[key].shape}, '
                       f'expected {shape} for d_model={config.d_model}, '
                       f'd_ff={config.d_ff}, vocab_size={config.vocab_size}, '
                       f'target_vocab_size={config.output_vocab_size}.')
  if 'pe' in sd:
    _check_positions(sd['pe'], config)

  d, n, h = config.d_model, config.num_heads, config.head_features

  def attention(prefix):
    w, b = sd[f'{prefix}.in_proj_weight'], sd[f'{prefix}.in_proj_bias']
    # torch: q = x @ W_q.T + b_q, with features ordered (head, head_dim);
    # jaxformer's kernels are output-major too.
    params = {name: {'kernel': w[j * d:(j + 1) * d].reshape(n, h, d),
                     'bias': b[j * d:(j + 1) * d].reshape(n, h)}
              for j, name in enumerate(('query', 'key', 'value'))}
    # jaxformer has no key bias: it adds q.b_k to all logits of a query,
    # which the softmax cancels, so dropping torch's changes nothing.
    del params['key']['bias']
    params['out'] = {
        'kernel': sd[f'{prefix}.out_proj.weight'].reshape(d, n, h),
        'bias': sd[f'{prefix}.out_proj.bias']}
    return params

  def layer(prefix, attentions, norms):
    params = {ours: attention(f'{prefix}.{theirs}')
              for ours, theirs in attentions.items()}
    params['ffn'] = {
        'wi': {'kernel': sd[f'{prefix}.linear1.weight'],
               'bias': sd[f'{prefix}.linear1.bias']},
        'wo': {'kernel': sd[f'{prefix}.linear2.weight'],
               'bias': sd[f'{prefix}.linear2.bias']}}
    for ours, theirs in norms.items():
      params[ours] = {'scale': sd[f'{prefix}.{theirs}.weight'],
                      'bias': sd[f'{prefix}.{theirs}.bias']}
    return params

  def stack(name, count, attentions, norms):
    per_layer = [layer(f'{name}.layers.{i}', attentions, norms)
                 for i in range(count)]
    if config.scan_layers:
      return {'layers': jax.tree.map(lambda *xs: np.stack(xs), *per_layer)}
    return {f'layer_{i}': p for i, p in enumerate(per_layer)}

  decoder = stack('decoder', config.num_decoder_layers, _DECODER_ATTENTION,
                  _DECODER_NORMS)
  decoder['logits'] = {'kernel': sd['output_proj.weight'],
                       'bias': sd['output_proj.bias']}
  params = {
      'source_embed': {'embedding': sd['src_embed.weight']},
      'target_embed': {'embedding': sd['tgt_embed.weight']},
      'encoder': stack('encoder', config.num_encoder_layers,
                       _ENCODER_ATTENTION, _ENCODER_NORMS),
      'decoder': decoder,
  }
  _check_against_model(params, config)
  return params


def _check_positions(pe: np.ndarray, config: ModelConfig):
  table = pe.reshape(-1, config.d_model)
  if table.shape[0] > config.max_len:
    raise ValueError(f"state_dict['pe'] covers {table.shape[0]} positions but "
                     f'config.max_len={config.max_len}.')
  ours = sinusoidal_positions(table.shape[0], config.d_model)
  if not np.allclose(table, ours, atol=1e-3):
    raise ValueError("state_dict['pe'] is not the sinusoidal table of the "
                     'paper; jaxformer cannot reproduce it.')


def _check_against_model(params: dict, config: ModelConfig):
  """The converted tree must be exactly the model's parameter tree."""
  tokens = np.ones((1, 1), np.int32)
  variables = jax.eval_shape(
      lambda: EncoderDecoder(config).init(jax.random.PRNGKey(0), tokens,
                                          tokens))
  want = {jax.tree_util.keystr(path): leaf.shape for path, leaf in
          jax.tree_util.tree_leaves_with_path(nn.unbox(variables['params']))}
  got = {jax.tree_util.keystr(path): leaf.shape
         for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
  if want != got:
    differ = sorted(k for k in want.keys() | got.keys()
                    if want.get(k) != got.get(k))
    raise ValueError(f'Converted parameters do not fit EncoderDecoder(config) '
                     f'at {differ}.')
