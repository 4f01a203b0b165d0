"""jaxformer's `EncoderDecoder` parameters as plain matrices, in the
output-major [out, in] layout that PyTorch and CTranslate2 use: what every
exporter reads. Shapes: model width d, heads n, head width h = d / n."""
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta

from jaxformer.model import layers
from jaxformer.model.config import ModelConfig


def numpy_tree(params) -> Any:
  """Unboxed parameters as writable float32 numpy copies on the host
  (CTranslate2 quantizes in place)."""
  return jax.tree.map(lambda x: np.array(x, np.float32), meta.unbox(params))


def stack_layers(stack: dict, count: int) -> list[dict]:
  """The per-layer trees of an encoder or decoder, looped (`layer_{i}`) or
  scanned (`layers`, stacked on a leading axis)."""
  if 'layers' in stack:
    return [jax.tree.map(lambda x, i=i: x[i], stack['layers'])
            for i in range(count)]
  return [stack[f'layer_{i}'] for i in range(count)]


def looped(stack: dict, count: int) -> dict:
  """An encoder or decoder tree with its layers as `layer_{i}`, whether
  they were looped or scanned."""
  tree = {k: v for k, v in stack.items() if k != 'layers'}
  tree.update({f'layer_{i}': layer
               for i, layer in enumerate(stack_layers(stack, count))})
  return tree


def option_blockers(config: ModelConfig, wanted: dict[str, Any]
                    ) -> list[str]:
  """One reason for each `model.*` option of `config` that is not the
  value a family has (`wanted`: option -> the family's value)."""
  return [f'model.{key}={getattr(config, key)!r} (the family has '
          f'{value!r})' for key, value in wanted.items()
          if getattr(config, key) != value]


def paper_attention_blockers(config: ModelConfig) -> list[str]:
  """What the encoder-decoder exporters (the paper's attention and
  LayerNorms) cannot write: one reason per option."""
  reasons = []
  if config.norm_type != 'layer':
    reasons.append(f'model.norm_type={config.norm_type!r}: the exported '
                   "norms are LayerNorms ('layer')")
  if config.kv_heads != config.num_heads:
    reasons.append(f'model.num_kv_heads={config.num_kv_heads}: the exported '
                   f'attention has as many key/value heads as query heads '
                   f'({config.num_heads})')
  if config.head_features * config.num_heads != config.d_model:
    reasons.append(f'model.head_dim={config.head_dim}: the exported heads '
                   f'are d_model / num_heads = '
                   f'{config.d_model // config.num_heads} wide')
  return reasons


def norm_bias(tree: dict) -> np.ndarray:
  """A LayerNorm's bias, zeros where it has none (model.norm_bias=False)."""
  return tree.get('bias', np.zeros_like(tree['scale']))


def linear(tree: dict) -> tuple[np.ndarray, np.ndarray | None]:
  """A `Linear` of one output axis: kernel [out, in], bias [out] or None."""
  return tree['kernel'], tree.get('bias')


def projection(tree: dict, d_model: int) -> tuple[np.ndarray, np.ndarray]:
  """A query/key/value projection: kernel [n, h, d] -> [d, d] and its bias
  [n, h] -> [d] (zeros where there is none, as for keys)."""
  kernel = tree['kernel'].reshape(-1, d_model)
  bias = tree.get('bias')
  bias = np.zeros(kernel.shape[0], np.float32) if bias is None else (
      bias.reshape(-1))
  return kernel, bias


def output(tree: dict, d_model: int) -> tuple[np.ndarray, np.ndarray | None]:
  """The attention output: kernel [d, n, h] -> [d, d], bias [d] or None."""
  return tree['kernel'].reshape(d_model, -1), tree.get('bias')


def position_table(params: dict, config: ModelConfig, stack: str
                   ) -> np.ndarray:
  """What the `stack` ('encoder' or 'decoder') adds at each position:
  [max_len, d] float32, computed by the model's own `AddPositions`."""
  variables = {'params': params[stack].get('positions', {})}
  zeros = jnp.zeros((1, config.max_len, config.d_model), jnp.float32)
  table = layers.AddPositions(config).apply(
      variables, zeros, jnp.arange(config.max_len)[None])
  return np.asarray(table[0], np.float32)


def _as_used(table: np.ndarray, config: ModelConfig) -> np.ndarray:
  """An embedding table as the model reads it: with
  config.zero_pad_embedding, its pad row is zero."""
  if not config.zero_pad_embedding:
    return table
  table = table.copy()
  table[config.pad_id] = 0.0
  return table


def embeddings(params: dict, config: ModelConfig) -> tuple[np.ndarray,
                                                           np.ndarray]:
  """(source table [V_src, d], target table [V_tgt, d]) as the model
  reads them; the same array when all embeddings are shared."""
  source = _as_used(params['source_embed']['embedding'], config)
  if config.share_embeddings == 'all':
    return source, source
  return source, _as_used(params['target_embed']['embedding'], config)


def output_layer(params: dict, config: ModelConfig
                 ) -> tuple[np.ndarray, np.ndarray | None]:
  """The output projection: (kernel [V_tgt, d], bias [V_tgt] or None);
  the target embedding itself when tied."""
  decoder = params['decoder']
  if config.share_embeddings == 'none':
    return decoder['logits']['kernel'], decoder['logits'].get('bias')
  return embeddings(params, config)[1], decoder.get('output_bias')
