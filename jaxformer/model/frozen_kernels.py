"""How the frozen base kernels of a model with adapters are held
(`model.lora.base_dtype`): float32 as trained, bfloat16, or int8 with one
float32 scale per output feature (weight-only: the matmul runs in the
compute dtype on the kernel dequantized, q * scale).

Written here rather than with `qwix`: qwix is not installed in this
environment and its LoRA/QLoRA path wraps Flax modules from outside
(interception by module path), while jaxformer's projections already
build their kernels in one place (`layers.Linear.weights`); the int8 form
is a few lines there, and keeps the parameters plain arrays that Orbax,
the mesh rules and the interop tables handle as they are.

Only the projections of attention and the FFN (those adapters can
target) are held so; embeddings, norms and heads keep float32.
"""
import jax
import jax.numpy as jnp
from flax import linen as nn

# The kernel's own parameter, and the int8 form's scales beside it.
SCALE = 'kernel_scale'


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
  if dtype != 'int8':
    raise ValueError(f'model.lora.base_dtype={dtype!r} is not supported yet; '
                     "use 'float32', 'bfloat16' or 'int8'.")
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


def quantize(params, abstract) -> dict:
  """`params` (float kernels, e.g. an export's) in the form `abstract`
  (the model's abstract parameters) holds them: int8 kernels with their
  scales where it has a SCALE beside them, every leaf cast to its dtype."""
  def convert(tree, target):
    if not isinstance(target, dict):
      return tree.astype(target.dtype)
    out = {name: convert(tree[name], target[name])
           for name in target if name != SCALE}
    if SCALE in target:  # Scanned layers: both lead with the layer axis.
      out['kernel'], out[SCALE] = int8_of(tree['kernel'],
                                          target[SCALE].ndim)
    return out
  return convert(params, abstract)
