"""Low-rank adapters (model.lora): one mechanism in the projections of
every family; a zero B gives the base model exactly, a non-zero one adds
scale * B A to each targeted kernel; bad targets and ranks are refused."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from jaxformer.interop import layout as layout_of
from jaxformer.model import ModelConfig, lora
from jaxformer.model.config import from_config_dict, to_config_dict
from jaxformer.train.tasks import get_task

FAMILIES = {
    # Encoder-decoder (the paper's blocks), decoder-only (Llama's: RMSNorm,
    # SwiGLU, rotary, grouped-query) and encoder-only (BERT's classifier).
    'translation': dict(num_encoder_layers=2, num_decoder_layers=2),
    'language_model': dict(
        num_encoder_layers=0, num_decoder_layers=2, norm_position='pre',
        norm_type='rms', activation='swiglu', position_embedding='rope',
        num_kv_heads=2, use_bias=False, share_embeddings='none',
        logits_bias=False),
    'classification': dict(num_encoder_layers=2, num_decoder_layers=0,
                           activation='gelu_exact', learned=True),
}


def family_config(task_name: str, **overrides) -> ModelConfig:
  fields = dict(vocab_size=64, d_model=32, num_heads=4, d_ff=48, max_len=32,
                embedding_dropout=0.0, residual_dropout=0.0)
  fields.update(FAMILIES[task_name])
  if fields.pop('learned', False):
    fields.update(position_embedding='learned', num_classes=3)
  fields.update(overrides)
  return ModelConfig(**fields)


def batch_of(task_name: str) -> dict[str, np.ndarray]:
  tokens = (np.arange(2 * 10).reshape(2, 10) * 7) % 60 + 3
  if task_name == 'translation':
    return {'inputs': tokens, 'targets': tokens[:, ::-1].copy()}
  if task_name == 'language_model':
    return {'targets': tokens}
  return {'inputs': tokens, 'labels': np.array([0, 2], np.int32)}


def outputs(task_name, config, params, batch):
  task = get_task(task_name)
  model = task.model(config)
  if task_name == 'translation':
    return model.apply({'params': params}, batch['inputs'], batch['targets'])
  if task_name == 'language_model':
    return model.apply({'params': params}, batch['targets'])
  return model.apply({'params': params}, batch['inputs'])


def init(task_name, config, batch, seed=0):
  task = get_task(task_name)
  variables = task.init_variables(task.model(config), jax.random.key(seed),
                                  batch)
  return jax.tree.map(np.asarray, _unbox(variables['params']))


def _unbox(tree):
  from flax import linen as nn
  return nn.unbox(tree)


def with_base(adapted, base):
  """The adapted model's parameters with the base's weights in place."""
  flat = traverse_util.flatten_dict(adapted)
  flat.update(traverse_util.flatten_dict(base))
  return traverse_util.unflatten_dict(flat)


def adapter_paths(params):
  return [path for path in traverse_util.flatten_dict(params)
          if lora.is_adapter(path)]


@pytest.mark.slow
@pytest.mark.parametrize('task_name', sorted(FAMILIES))
@pytest.mark.parametrize('use_rslora', [False, True])
def test_zero_b_gives_the_base_model_exactly(task_name, use_rslora):
  base_config = family_config(task_name)
  config = base_config.replace(lora=lora.LoraConfig(
      targets='all', rank=4, alpha=8.0, use_rslora=use_rslora))
  batch = batch_of(task_name)
  base = init(task_name, base_config, batch)
  params = with_base(init(task_name, config, batch, seed=1), base)
  assert adapter_paths(params)
  np.testing.assert_array_equal(
      outputs(task_name, config, params, batch),
      outputs(task_name, base_config, base, batch))


def _merged(params, config):
  """Each adapted kernel replaced by W + scale * B A, adapters dropped."""
  flat = traverse_util.flatten_dict(params)
  merged = {}
  for path, leaf in flat.items():
    if lora.is_adapter(path):
      continue
    if path[-1] == 'kernel' and path[:-1] + ('lora_a',) in flat:
      a, b = flat[path[:-1] + ('lora_a',)], flat[path[:-1] + ('lora_b',)]
      delta = config.lora.scale * (b @ a)
      leaf = leaf + delta.reshape(leaf.shape)
    merged[path] = leaf
  return traverse_util.unflatten_dict(merged)


@pytest.mark.slow
@pytest.mark.parametrize('task_name', sorted(FAMILIES))
@pytest.mark.parametrize('targets', ['q,v', 'all'])
def test_an_adapter_adds_scale_b_a_to_its_kernel(task_name, targets):
  config = family_config(task_name).replace(lora=lora.LoraConfig(
      targets=targets, rank=3, alpha=6.0, use_rslora=targets == 'all'))
  batch = batch_of(task_name)
  params = init(task_name, config, batch)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: rng.normal(0, 0.3, x.shape).astype(np.float32)
      if path[-1].key == 'lora_b' else x, params)
  names = {path[-2] for path in adapter_paths(params)}
  assert names == ({'query', 'value'} if targets == 'q,v' else
                   names | {'query', 'key', 'value', 'out', 'wo'})
  plain = dataclasses.replace(config, lora=lora.LoraConfig())
  adapted = outputs(task_name, config, params, batch)
  reference = outputs(task_name, plain, _merged(params, config), batch)
  assert not np.allclose(adapted, outputs(task_name, plain, _merged(
      jax.tree.map(np.zeros_like, params), config), batch))
  np.testing.assert_allclose(adapted, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize('layout', [
    dict(scan_layers=True), dict(remat_policy='full'),
    dict(scan_layers=True, remat_policy='dots'),
    dict(attention_impl='splash')])
def test_adapters_under_scan_remat_and_kernels(layout):
  """Scanned layers stack the adapters like the kernels; remat and the
  attention kernels (run as their reference where the platform has none)
  give the unrolled einsum model's logits."""
  config = family_config('language_model', **layout).replace(
      lora=lora.LoraConfig(targets='q,k,v,o,gate,up,down', rank=2))
  batch = batch_of('language_model')
  params = init('language_model', config, batch)
  if layout.get('scan_layers'):
    a = traverse_util.flatten_dict(params)[
        ('decoder', 'layers', 'self_attention', 'query', 'lora_a')]
    assert a.shape == (2, 2, 32)
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.1 if path[-1].key == 'lora_b' else x, params)
  plain = config.replace(scan_layers=False, remat_policy='none',
                         attention_impl='einsum')
  unrolled = {**params, 'decoder': layout_of.looped(params['decoder'],
                                                    config.num_decoder_layers)}
  np.testing.assert_allclose(
      outputs('language_model', config, params, batch),
      outputs('language_model', plain, unrolled, batch), atol=5e-5)


def test_config_dict_round_trip():
  config = family_config('language_model').replace(
      lora=lora.LoraConfig(targets='q,v', rank=16, alpha=32.0))
  again = from_config_dict(to_config_dict(config))
  assert again == config and again.lora_targets == {'q', 'v'}
  assert lora.LoraConfig(rank=16, alpha=32.0).scale == 2.0
  assert lora.LoraConfig(rank=16, alpha=32.0, use_rslora=True).scale == 8.0


def test_a_target_the_model_lacks_names_the_projections_there_are():
  """A name of no projection at all is refused with the config; one the
  model lacks when the model is known (a fine-tune's config may name the
  gated projections of the export it starts from)."""
  config = family_config('translation', lora=dict(targets='q,gate'))
  with pytest.raises(ValueError) as error:
    config.lora_targets
  assert str(error.value) == (
      "model.lora.targets='q,gate': gate matches no projection of this "
      'model; its projections are q, k, v, o, ffn_in, ffn_out (or all).')
  with pytest.raises(ValueError) as error:
    init('translation', config, batch_of('translation'))
  assert 'gate matches no projection' in str(error.value)
  with pytest.raises(ValueError, match='wq is no projection name; choose '
                     'from q, k, v, o, gate, up, down, ffn_in, ffn_out'):
    family_config('language_model', lora=dict(targets='wq'))


@pytest.mark.parametrize('rank', [0, -2])
def test_rank_below_one_is_refused(rank):
  with pytest.raises(ValueError, match=f'model.lora.rank={rank} must be 1'):
    family_config('translation', lora=dict(targets='all', rank=rank))


def test_an_unknown_lora_key_is_refused():
  with pytest.raises(ValueError, match=r"Unknown model.lora key\(s\) \['r'\]"):
    family_config('translation', lora=dict(targets='q', r=4))


def test_no_targets_is_the_plain_model():
  config = family_config('translation', lora=dict(rank=0))
  assert not config.lora_targets
  assert not adapter_paths(init('translation', config,
                                batch_of('translation')))


def quantized(config, params, batch, base_dtype):
  """(config with model.lora.base_dtype, `params` of the language model
  `config` in that form: `frozen_kernels.quantize` of the float ones)."""
  from flax import linen as nn
  from jaxformer.model import frozen_kernels
  held = config.replace(lora=dataclasses.replace(config.lora,
                                                 base_dtype=base_dtype))
  task = get_task('language_model')
  abstract = nn.unbox(jax.eval_shape(lambda: task.init_variables(
      task.model(held), jax.random.key(0), batch))['params'])
  return held, frozen_kernels.quantize(params, abstract)


@pytest.mark.slow
def test_an_int8_base_computes_the_float_model_within_its_rounding():
  """model.lora.base_dtype='int8': the projections' kernels are int8 with
  a scale per output feature (`frozen_kernels.quantize` of the float
  ones); the logits stay within the rounding of 8 bits."""
  from jaxformer.model import frozen_kernels
  config = family_config('language_model', lora=lora.LoraConfig(
      targets='q,v', rank=2))
  batch = batch_of('language_model')
  params = init('language_model', config, batch)
  int8, held = quantized(config, params, batch, 'int8')
  flat = traverse_util.flatten_dict(held)
  kernel = ('decoder', 'layer_0', 'ffn', 'wi_0', 'kernel')
  assert flat[kernel].dtype == np.int8
  assert flat[kernel[:-1] + (frozen_kernels.SCALE,)].shape == (48,)
  assert flat[('decoder', 'layer_0', 'self_attention', 'query', 'lora_a')
              ].dtype == np.float32
  reference = outputs('language_model', config, params, batch)
  got = outputs('language_model', int8, held, batch)
  error = np.abs(np.asarray(got) - reference).max()
  assert 0 < error < 0.02 * np.abs(reference).max()


@pytest.mark.slow
def test_a_bfloat16_base_holds_the_projections_in_bfloat16():
  config = family_config('translation', lora=dict(
      targets='q', base_dtype='bfloat16'))
  flat = traverse_util.flatten_dict(init('translation', config,
                                         batch_of('translation')))
  assert flat[('encoder', 'layer_0', 'ffn', 'wi', 'kernel')].dtype.name == (
      'bfloat16')
  assert flat[('encoder', 'layer_0', 'self_attention', 'query', 'lora_b')
              ].dtype == np.float32


def numpy_nf4(values, out_ndim):
  """NF4 in numpy, as QLoRA defines it: each value the nearest of the 16
  levels times its block's largest |value|, a block up to 64 consecutive
  values along the last output axis."""
  import math
  from jaxformer.model import frozen_kernels
  levels = np.asarray(frozen_kernels.NF4_LEVELS, np.float32)
  axis = out_ndim - 1
  size = values.shape[axis]
  block = math.gcd(64, size)
  moved = np.moveaxis(values.astype(np.float32), axis, -1)
  blocks = moved.reshape(*moved.shape[:-1], size // block, block)
  scale = np.abs(blocks).max(-1, keepdims=True)
  nearest = np.abs((blocks / scale)[..., None] - levels)
  rounded = (levels[nearest.argmin(-1)] * scale).reshape(moved.shape)
  return np.moveaxis(rounded, -1, axis)


@pytest.mark.parametrize('shape, out_ndim, blocks', [
    ((128, 6), 1, 2), ((3, 48, 10), 2, 3), ((10, 4, 8), 1, 5)])
def test_nf4_values_are_the_nearest_levels_times_the_block_maximum(
    shape, out_ndim, blocks):
  from jaxformer.model import frozen_kernels
  values = np.random.default_rng(len(shape)).normal(
      size=shape).astype(np.float32)
  codes, scale = frozen_kernels.nf4_of(values, out_ndim)
  assert codes.dtype == np.uint8
  assert codes.shape == (*shape[:-1], shape[-1] // 2)
  blocked = list(shape)
  blocked[out_ndim - 1] = blocks
  assert scale.shape == tuple(blocked)
  np.testing.assert_array_equal(
      np.asarray(frozen_kernels.nf4_values(codes, scale)),
      numpy_nf4(values, out_ndim))


@pytest.mark.slow
@pytest.mark.parametrize('base_dtype', ['int8', 'nf4'])
def test_a_quantized_base_merges_into_the_plain_model_it_computes(
    base_dtype):
  """An adapted model with an int8 or nf4 base, merged (`peft.merged_params`:
  what `jaxformer export --format hf` writes), is the plain float32 model
  with the dequantized kernels plus scale * B A: the same logits."""
  from jaxformer.interop import peft
  from jaxformer.model import frozen_kernels
  floats = family_config('language_model', lora=lora.LoraConfig(
      targets='q,v', rank=2))
  batch = batch_of('language_model')
  flat = traverse_util.flatten_dict(init('language_model', floats, batch))
  rng = np.random.default_rng(0)
  for path in flat:
    if path[-1] == 'lora_b':
      flat[path] = rng.normal(size=flat[path].shape).astype(np.float32)
  config, held = quantized(floats, traverse_util.unflatten_dict(flat), batch,
                           base_dtype)
  kernel = ('decoder', 'layer_0', 'ffn', 'wi_0', 'kernel')
  assert traverse_util.flatten_dict(held)[kernel].dtype == (
      np.uint8 if base_dtype == 'nf4' else np.int8)
  adapted = outputs('language_model', config, held, batch)
  plain = config.replace(lora=lora.LoraConfig())
  merged = peft.merged_params(held, config)
  assert not any(frozen_kernels.SCALE in path or lora.is_adapter(path)
                 for path in traverse_util.flatten_dict(merged))
  np.testing.assert_allclose(
      np.asarray(outputs('language_model', plain, merged, batch)),
      np.asarray(adapted), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_an_nf4_base_computes_the_float_model_on_its_rounded_kernels():
  from jaxformer.model import frozen_kernels
  config = family_config('language_model', lora=lora.LoraConfig(
      targets='q,v', rank=2))
  batch = batch_of('language_model')
  params = init('language_model', config, batch)
  nf4, held = quantized(config, params, batch, 'nf4')
  flat = traverse_util.flatten_dict(held)
  kernel = ('decoder', 'layer_0', 'ffn', 'wi_0', 'kernel')
  assert flat[kernel].dtype == np.uint8 and flat[kernel].shape == (48, 16)
  assert flat[kernel[:-1] + (frozen_kernels.SCALE,)].shape == (3, 32)
  # The float model on kernels rounded to NF4 in numpy computes the same.
  rounded = traverse_util.flatten_dict(params)
  for path in rounded:
    scale = path[:-1] + (frozen_kernels.SCALE,)
    if scale in flat:  # Blocked along the axis the scales have fewer of.
      fewer = [i for i, (k, n) in enumerate(zip(rounded[path].shape,
                                                 flat[scale].shape)) if k != n]
      rounded[path] = numpy_nf4(rounded[path], fewer[0] + 1)
  reference = outputs('language_model', config,
                      traverse_util.unflatten_dict(rounded), batch)
  got = outputs('language_model', nf4, held, batch)
  np.testing.assert_allclose(np.asarray(got), np.asarray(reference),
                             atol=1e-5, rtol=1e-5)
  exact = outputs('language_model', config, params, batch)
  assert not np.allclose(np.asarray(got), np.asarray(exact), atol=1e-3)


def test_a_fresh_nf4_kernel_is_zero():
  config = family_config('translation', lora=dict(targets='q',
                                                   base_dtype='nf4'))
  from jaxformer.model import frozen_kernels
  flat = traverse_util.flatten_dict(init('translation', config,
                                         batch_of('translation')))
  ffn = ('encoder', 'layer_0', 'ffn', 'wi')
  values = frozen_kernels.nf4_values(flat[ffn + ('kernel',)],
                                     flat[ffn + (frozen_kernels.SCALE,)])
  assert not np.asarray(values).any()


def test_an_unknown_base_dtype_is_refused_with_the_supported_ones():
  with pytest.raises(ValueError, match="base_dtype='fp4' is not one of "
                     r"\('float32', 'bfloat16', 'int8', 'nf4'\)"):
    family_config('translation', lora=dict(targets='q', base_dtype='fp4'))
