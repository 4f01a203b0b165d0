"""The steps between two log lines of a run: their metrics, fetched from the
devices without stalling them, and what they did per second (tokens, the
model's FLOPs against the devices' peak: MFU).

Steps run ahead of the host by at most one: before step n + 1 is
dispatched, step n - 1 has finished (its metrics are fetched). So a stop is
acted on within two steps, not after a whole log window.
"""
import functools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.train import flops as flops_lib
from jaxformer.train.run_spec import RunSpec

def real_tokens(local: dict[str, np.ndarray]) -> int:
  """Real (not padding) tokens of a batch: segment ids are 0 at padding
  (token 0 may be a real one, Marian's EOS)."""
  return int(sum(np.count_nonzero(local.get(f'{k}_segment_ids', local[k]))
                 for k in ('inputs', 'targets') if k in local))


def batch_flops(run: RunSpec, local: dict[str, np.ndarray]) -> float:
  """Training FLOPs of the global batch whose part `local` is (every
  process holds as many rows)."""
  rows = next(iter(local.values())).shape[0] * jax.process_count()
  return flops_lib.training_flops_per_step(
      run.model_config, run.task, rows,
      local['inputs'].shape[1] if 'inputs' in local else 0,
      local['targets'].shape[1] if 'targets' in local else 0)


# A CPU's peak, measured as benchmarks/train_throughput.py measures it: a
# matmul large enough to keep every core busy, compiled and run once before
# the timing, and the fastest of several calls (a call that other work
# shared a core with is slower, not faster). A 1024 x 1024 matmul timed on
# average while start-up work shared the cores read low: the quick start
# printed an MFU of 84.6%.
PEAK_SIZES = {'cpu': 2048}
ACCELERATOR_PEAK_SIZE = 8192
PEAK_REPEATS = 10


def peak_flops(configured: float = 0.0,
               log: Callable[[str], None] = lambda text: None) -> float:
  """FLOP/s of one device: `configured` (train.peak_flops), else the chip's
  from the table (TPUs, GPUs), else measured (CPUs), which `log` is told
  once with its value. A measurement needs the cores to itself: call this
  before the input pipeline's threads start."""
  kind = jax.devices()[0].device_kind
  known = configured or flops_lib.device_peak_flops(kind)
  if known:
    return known
  measured = measure_peak_flops()
  size = peak_size(jax.devices()[0].platform)
  log(f'MFU is against {measured / 1e9:,.1f} GFLOP/s per device, measured '
      f'on this {kind} (the fastest of {PEAK_REPEATS} {size}x{size} '
      'matmuls); set train.peak_flops to use another peak.')
  return measured


def peak_size(platform: str) -> int:
  """The side of the square matmul that measures a `platform` device."""
  return PEAK_SIZES.get(platform, ACCELERATOR_PEAK_SIZE)


@functools.cache
def measure_peak_flops(repeats: int = PEAK_REPEATS) -> float:
  """FLOP/s of one device on a large float32 matmul (bf16 on accelerators):
  the fastest of `repeats` calls after a warm-up one. Measured once per
  process (about 2 s on 2 CPU cores)."""
  device = jax.devices()[0]
  dtype = jnp.float32 if device.platform == 'cpu' else jnp.bfloat16
  n = peak_size(device.platform)
  a = jax.device_put(jnp.ones((n, n), dtype), device)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  fastest = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    fastest = min(fastest, time.perf_counter() - start)
  return 2 * n ** 3 / fastest


class NonFiniteLossError(RuntimeError):
  """The loss or gradient norm became NaN or Inf."""


def fetch(pending: list, nan_policy: str = 'stop',
          last_good: Callable[[], str] = lambda: 'unknown'
          ) -> list[tuple[int, dict[str, float]]]:
  """The metrics of `pending` [(step, metrics on the devices)] on the host
  (waiting for those steps to finish), as floats. A non-finite step stops
  the run (or is counted, with nan_policy='skip'); bad updates were never
  applied. `last_good`: the last good checkpoint, for the error."""
  records = [(s, jax.device_get(m)) for s, m in pending]
  for s, metrics in records:
    if metrics['finite'] < 1 and nan_policy == 'stop':
      raise NonFiniteLossError(
          f'Non-finite loss or gradient at step {s} (loss='
          f'{float(metrics["loss"])}, grad_norm='
          f'{float(metrics["grad_norm"])}). The last good checkpoint is '
          f'{last_good()}; nothing newer was saved. Lower '
          'train.learning_rate or set train.grad_clip_norm, or '
          '--config.train.nan_policy=skip to skip such steps.')
  return [(s, {k: float(np.asarray(v)) for k, v in m.items()
               if np.ndim(v) == 0}) for s, m in records]


class Window:
  """The steps since the last log line. `nan_policy` and `last_good`: as
  `fetch` takes them."""

  def __init__(self, nan_policy: str = 'stop',
               last_good: Callable[[], str] = lambda: 'unknown'):
    self._fetch = functools.partial(fetch, nan_policy=nan_policy,
                                    last_good=last_good)
    self.start = time.perf_counter()
    self.tokens, self.flops = 0, 0.0
    self.pending, self.records = [], []

  def add(self, step: int, metrics, tokens: int, flops: float) -> None:
    """Step `step` was dispatched: fetches the metrics of the step before
    (so that at most one runs ahead) and counts its tokens and FLOPs."""
    self.pending.append((step, metrics))
    self.records += self._fetch(self.pending[:-1])
    del self.pending[:-1]
    self.tokens += tokens
    self.flops += flops

  def summary(self, peak_flops: float) -> dict[str, float]:
    """The last step's metrics, with the window's tokens per second, seconds
    per step, MFU against `peak_flops` (FLOP/s of all devices) and count of
    skipped (non-finite) steps; fetches every step first."""
    self.records += self._fetch(self.pending)
    self.pending = []
    elapsed = time.perf_counter() - self.start
    final = dict(self.records[-1][1])
    final.update(tokens_per_second=self.tokens / elapsed,
                 step_time=elapsed / len(self.records),
                 mfu=self.flops / elapsed / peak_flops)
    final['skipped_steps'] = float(sum(1 - r['finite']
                                       for _, r in self.records))
    return final
