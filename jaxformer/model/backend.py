"""Which code path runs where: the platform a program is built for, the
attention kernel and compute dtype it gets (the CPU-only decoding kernels
say where they apply in `cpu_kernels.applies`).

Each decision has one function here, so that what runs on a CPU, a GPU and
a TPU can be read (and tested) in one place.
"""
import logging

import jax
import jax.numpy as jnp

PLATFORMS = ('cpu', 'gpu', 'tpu')
ATTENTION_IMPLS = ('auto', 'einsum', 'fused', 'cudnn', 'splash')

_logged: set[str] = set()


def log_once(message: str) -> None:
  """Logs `message` (a warning) the first time it is seen in this process:
  a choice made while tracing is then said once, not at every layer."""
  if message not in _logged:
    _logged.add(message)
    logging.getLogger('jaxformer').warning('jaxformer: %s', message)


def platform(like=None) -> str:
  """'cpu', 'gpu' or 'tpu': the platform of the program being built.

  That of the mesh in context (`jax.set_mesh`); else that of `like`'s
  devices (an array, or a tracer whose inputs carry a sharding: a program
  lowered for TPU devices from a CPU host, without a mesh in context); else
  JAX's default backend.
  """
  name = _mesh_platform(jax.sharding.get_abstract_mesh())
  if name is None and like is not None:
    name = _array_platform(like)
  name = name or jax.default_backend()
  return 'gpu' if name in ('cuda', 'rocm') else name


def _mesh_platform(mesh) -> str | None:
  if mesh is None or mesh.empty:
    return None
  return getattr(getattr(mesh, 'abstract_device', None), 'platform', None)


def _array_platform(x) -> str | None:
  """The platform of a concrete array's devices, or of a traced array's
  abstract mesh; None where it has neither."""
  if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer):
    return next(iter(x.sharding.device_set)).platform
  sharding = getattr(jax.typeof(x), 'sharding', None)
  return _mesh_platform(getattr(sharding, 'mesh', None))


# Splash pads both lengths to its 128-token blocks: below one block the
# padding multiplies its work and memory (compiled for a v5e-4, the
# tsv_example train step of 1024 x (8+8) tokens took 2.65 GiB of
# temporaries per chip with splash and 0.20 GiB with the einsums).
SPLASH_MIN_LENGTH = 128


def attention_kernel(impl: str, platform_name: str, dtype,
                     lengths: tuple[int, int] = (SPLASH_MIN_LENGTH,) * 2
                     ) -> str:
  """The attention path `impl` means on `platform_name` for `dtype` and
  (query, key) `lengths`.

  'auto' is cuDNN flash attention on GPUs in bfloat16/float16 (cuDNN has no
  float32 flash kernel), the Pallas splash kernel on TPUs when both lengths
  fill its blocks (`SPLASH_MIN_LENGTH`), and the einsums elsewhere. 'fused'
  is `jax.nn.dot_product_attention` with XLA's implementation (one fused
  softmax, no flash tiling). 'cudnn' and 'splash' ask for that kernel
  wherever they run ('splash' off a TPU runs in Pallas interpret mode, for
  tests).

  Returns:
    one of 'einsum', 'fused', 'cudnn', 'splash'.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f'model.attention_impl={impl!r} is not one of '
                     f'{ATTENTION_IMPLS}.')
  if impl != 'auto':
    return impl
  if platform_name == 'tpu':
    return 'splash' if min(lengths) >= SPLASH_MIN_LENGTH else 'einsum'
  if platform_name == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16,
                                                     jnp.float16):
    return 'cudnn'
  return 'einsum'


def compute_dtype(name: str, platform_name: str | None = None):
  """model.dtype as a dtype: 'auto' is bfloat16 on GPUs and TPUs (their
  matrix units' native type) and float32 on CPUs (where XLA's bfloat16
  matmuls are slower than float32 ones).

  Args:
    platform_name: None for `platform()`.
  """
  if name == 'auto':
    name = 'float32' if (platform_name or platform()) == 'cpu' else 'bfloat16'
  return jnp.dtype(name)


# Measured on a 2-core AVX2 CPU, 24 matmuls of 256 inputs: (kernel x^T)^T is
# 2x faster at 8 rows, 1.3x at 32, the same from 128.
TRANSPOSED_MATMUL_MAX_ROWS = 64
# The int8 vocabulary screen of greedy search was measured at 8 rows (the
# decode benchmark: 8-13% faster). A step computes all the logits when the
# screen leaves more than two candidates in any row, which more rows make
# likelier.
SCREEN_MAX_ROWS = 64
# Each kernel of `cpu_kernels` and the platforms it was measured to pay on:
# {platform: the most rows it pays for, None for any number}.
CPU_KERNELS = {
    'transposed_matmuls': {'cpu': TRANSPOSED_MATMUL_MAX_ROWS},
    'int8_screen': {'cpu': SCREEN_MAX_ROWS},
    'halving_argmax': {'cpu': None},
    'blocked_top_k': {'cpu': None},
    'prefix_buckets': {'cpu': None},
    'batch_parts': {'cpu': None},
}


def cpu_kernel_applies(kernel: str, platform_name: str,
                       rows: int | None = None) -> bool:
  """Whether `kernel` of `cpu_kernels` (a key of `CPU_KERNELS`) runs in a
  program built for `platform_name` (see `platform`) on `rows` rows (None
  where rows do not matter). Off a CPU the plain path runs: full cache
  reads, `argmax`, `lax.top_k`, one batch, ordinary matmuls."""
  if kernel not in CPU_KERNELS:
    raise ValueError(f'Unknown CPU kernel {kernel!r}; one of '
                     f'{list(CPU_KERNELS)}.')
  if platform_name not in CPU_KERNELS[kernel]:
    return False
  most = CPU_KERNELS[kernel][platform_name]
  return most is None or rows is None or rows <= most
