"""Which code path runs where: the platform a program is built for, the
attention kernel it gets, and whether the CPU-only decoding tricks apply.

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


def platform() -> str:
  """'cpu', 'gpu' or 'tpu': that of the mesh in context (`jax.set_mesh`),
  so that a program compiled from a CPU host for TPU devices takes the TPU
  paths; without a mesh, JAX's default backend."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, 'abstract_device', None)
  name = getattr(device, 'platform', None) or jax.default_backend()
  return 'gpu' if name in ('cuda', 'rocm') else name


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
  fill its blocks (`SPLASH_MIN_LENGTH`), and the einsums elsewhere. 'fused' is `jax.nn.dot_product_attention` with XLA's
  implementation (one fused softmax, no flash tiling). 'cudnn' and 'splash'
  ask for that kernel wherever they run ('splash' off a TPU runs in Pallas
  interpret mode, for tests).

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


def cpu_decoding_tricks(platform_name: str | None = None) -> bool:
  """Whether decoding takes the paths that were measured to pay on XLA's
  CPU backend only: cache reads in prefix buckets under `lax.switch`, the
  halving greedy argmax and int8 screen, blocked top-k, the batch decoded in
  concurrent parts, and kernel-transposed matmuls for few rows. On GPUs and
  TPUs the plain path (full cache reads, `argmax`, `lax.top_k`, one batch,
  ordinary matmuls) runs.

  Args:
    platform_name: None for `platform()`.
  """
  return (platform_name or platform()) == 'cpu'
