"""How the frozen base kernels of a model with adapters are held
(`model.lora.base_dtype`): float32 as trained, bfloat16, int8 with one
float32 scale per output feature, or nf4 (QLoRA's 4-bit NormalFloat,
Dettmers et al. 2023): each value the nearest of 16 levels (quantiles of a
normal distribution scaled to [-1, 1]) times the absolute maximum of its
block, two 4-bit codes to a byte along the inputs, one float32 scale a
block (4.5 bits a weight; QLoRA's double quantization of the scales is not
done). A block is up to 64 consecutive output features of one input
(bitsandbytes blocks the flattened [out, in] kernel along its inputs):
so the scales keep the kernel's input axes and are sharded as it is,
where blocks along the inputs could be too few to shard. Weight-only: the
matmul runs in the compute dtype on the kernel dequantized.

Written here rather than with `qwix`: qwix is not installed in this
environment and its LoRA/QLoRA path wraps Flax modules from outside
(interception by module path), while jaxformer's projections already
build their kernels in one place (`layers.Linear.weights`); the int8 form
is a few lines there, and keeps the parameters plain arrays that Orbax,
the mesh rules and the interop tables handle as they are.

Only the projections of attention and the FFN (those adapters can
target) are held so; embeddings, norms and heads keep float32.
"""
import math

import jax
import jax.numpy as jnp
from flax import linen as nn

# The kernel's own parameter, and the int8 and nf4 forms' scales beside it.
SCALE = 'kernel_scale'
# NF4's 16 levels, as QLoRA (and bitsandbytes) define them; level 7 is 0.
NF4_LEVELS = (-1.0, -0.6961928009986877, -0.5250730514526367,
              -0.39491748809814453, -0.28444138169288635,
              -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0)
NF4_ZERO = 0x77  # A byte of two zero codes.
NF4_BLOCK = 64


def base_dtype(config) -> str:
  """The dtype the projections' kernels are held in: model.lora's
  base_dtype where the model has adapters, else float32."""
  return config.lora.base_dtype if config.lora.enabled else 'float32'


def kernel(module: nn.Module, shape: tuple[int, ...], out_ndim: int,
           axes: tuple, init) -> jax.Array:
  """The kernel [*shape] of a projection, as float (called inside its
  compact method): its parameter in the base dtype, an int8 one
  dequantized with its scales [*shape[:out_ndim]]. A fresh int8 kernel
  is zero (its values come from an export: `quantize`)."""
  dtype = base_dtype(module.config)
  if dtype in ('float32', 'bfloat16'):
    return module.param('kernel', nn.with_logical_partitioning(init, axes),
                        shape, jnp.dtype(dtype))
  if dtype == 'nf4':
    if shape[-1] % 2:
      raise ValueError(f'model.lora.base_dtype=nf4 packs two inputs a '
                       f'byte; a projection has {shape[-1]} (odd): use int8.')
    codes = module.param('kernel', nn.with_logical_partitioning(
        nn.initializers.constant(NF4_ZERO), axes),
                         (*shape[:-1], shape[-1] // 2), jnp.uint8)
    blocks = list(shape)
    blocks[out_ndim - 1] //= nf4_block(shape[out_ndim - 1])
    scale = module.param(SCALE, nn.with_logical_partitioning(
        nn.initializers.ones, (*axes[:out_ndim - 1], None,
                               *axes[out_ndim:])), tuple(blocks), jnp.float32)
    return nf4_values(codes, scale)
  if dtype != 'int8':
    raise ValueError(f'model.lora.base_dtype={dtype!r} is not supported; '
                     "use 'float32', 'bfloat16', 'int8' or 'nf4'.")
  values = module.param('kernel', nn.with_logical_partitioning(
      nn.initializers.zeros, axes), shape, jnp.int8)
  scale = module.param(SCALE, nn.with_logical_partitioning(
      nn.initializers.ones, axes[:out_ndim]), shape[:out_ndim], jnp.float32)
  return values.astype(jnp.float32) * scale.reshape(
      scale.shape + (1,) * (len(shape) - out_ndim))


def int8_of(kernel_values: jax.Array, out_ndim: int
            ) -> tuple[jax.Array, jax.Array]:
  """(int8 values, float32 scales [*out]) of a float kernel [*out, *in]:
  symmetric, per output feature, the largest |value| at 127."""
  in_axes = tuple(range(out_ndim, kernel_values.ndim))
  largest = jnp.max(jnp.abs(kernel_values.astype(jnp.float32)),
                    axis=in_axes)
  scale = jnp.where(largest > 0, largest / 127.0, 1.0)
  values = jnp.round(kernel_values / scale.reshape(
      scale.shape + (1,) * len(in_axes)))
  return jnp.clip(values, -127, 127).astype(jnp.int8), scale


def nf4_block(features: int) -> int:
  """The block along an output axis of `features`: 64, or fewer where 64
  does not divide them (their greatest common divisor)."""
  return math.gcd(NF4_BLOCK, features)


def _block_axis(kernel_shape, scale_shape) -> int:
  """The axis of an nf4 kernel [*shape] its scales are blocked along: the
  one where the scales are fewer (0 where blocks are single values)."""
  fewer = [i for i, (k, s) in enumerate(zip(kernel_shape, scale_shape))
           if k != s]
  return fewer[0] if fewer else 0


def _blocked(values: jax.Array, axis: int, blocks: int) -> jax.Array:
  """values [..., n, ...] -> [..., blocks, n / blocks, ...] at `axis`."""
  shape = values.shape
  return values.reshape(*shape[:axis], blocks, shape[axis] // blocks,
                        *shape[axis + 1:])


def nf4_of(kernel_values: jax.Array, out_ndim: int
           ) -> tuple[jax.Array, jax.Array]:
  """(codes [..., n / 2] uint8, two inputs a byte, the first in the high
  half; scales float32, the kernel's shape with its last output axis cut
  to its blocks) of a float kernel [*out, *in], out_ndim output axes
  (after a scanned kernel's layer axis): each value the nearest NF4 level
  of value / its block's largest |value|."""
  axis = out_ndim - 1
  size = kernel_values.shape[axis]
  return _nf4(kernel_values, axis, size // nf4_block(size))


def _nf4(kernel_values: jax.Array, axis: int, blocks: int):
  """`nf4_of` with `blocks` blocks along `axis`."""
  values = kernel_values.astype(jnp.float32)
  blocked = _blocked(values, axis, blocks)
  largest = jnp.max(jnp.abs(blocked), axis=axis + 1, keepdims=True)
  scale = jnp.where(largest > 0, largest, 1.0)
  levels = jnp.asarray(NF4_LEVELS, jnp.float32)
  codes = jnp.argmin(jnp.abs((blocked / scale)[..., None] - levels),
                     axis=-1).astype(jnp.uint8).reshape(values.shape)
  pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
  return ((pairs[..., 0] << 4) | pairs[..., 1],
          jnp.squeeze(scale, axis + 1))


def nf4_values(codes: jax.Array, scale: jax.Array) -> jax.Array:
  """The float32 kernel of `nf4_of`'s codes and scales."""
  codes = jnp.asarray(codes).astype(jnp.uint8)
  pairs = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(
      *codes.shape[:-1], 2 * codes.shape[-1])
  values = jnp.asarray(NF4_LEVELS, jnp.float32)[pairs.astype(jnp.int32)]
  axis = _block_axis(values.shape, scale.shape)
  blocked = _blocked(values, axis, scale.shape[axis])
  return (blocked * jnp.expand_dims(scale, axis + 1)).reshape(values.shape)


def dequantized(tree: dict) -> jax.Array:
  """The float kernel of a projection's parameters `tree` (its 'kernel',
  and SCALE where quantized), in the shape the float model holds it."""
  values = tree['kernel']
  if SCALE not in tree:
    return values
  scale = tree[SCALE]
  if scale.ndim == values.ndim:  # nf4's, per block; int8's, per output.
    return nf4_values(values, scale)
  return values.astype(jnp.float32) * scale.reshape(
      scale.shape + (1,) * (values.ndim - scale.ndim))


def quantize(params, abstract) -> dict:
  """`params` (float kernels, e.g. an export's) in the form `abstract`
  (the model's abstract parameters) holds them: int8 or nf4 kernels with
  their scales where it has a SCALE beside them, every leaf cast to its
  dtype."""
  def convert(tree, target):
    if not isinstance(target, dict):
      return tree.astype(target.dtype)
    out = {name: convert(tree[name], target[name])
           for name in target if name != SCALE}
    if SCALE in target and target['kernel'].dtype == jnp.uint8:
      axis = _block_axis(tree['kernel'].shape, target[SCALE].shape)
      out['kernel'], out[SCALE] = _nf4(tree['kernel'], axis,
                                       target[SCALE].shape[axis])
    elif SCALE in target:  # Scanned layers: both lead with the layer axis.
      out['kernel'], out[SCALE] = int8_of(tree['kernel'],
                                          target[SCALE].ndim)
    return out
  return convert(params, abstract)
