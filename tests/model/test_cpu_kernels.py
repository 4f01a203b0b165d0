"""The CPU decoding kernels against the plain operations they replace, and
the policy that says where each applies (`backend.cpu_kernel_applies`)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer.inference import search
from jaxformer.model import backend, cpu_kernels


@pytest.mark.parametrize('platform', ['cpu', 'gpu', 'tpu'])
def test_cpu_kernels_apply_on_cpus_only(platform):
  for kernel in backend.CPU_KERNELS:
    assert backend.cpu_kernel_applies(kernel, platform) is (platform == 'cpu')


def test_each_row_threshold_bounds_its_own_kernel():
  most = {'transposed_matmuls': backend.TRANSPOSED_MATMUL_MAX_ROWS,
          'int8_screen': backend.SCREEN_MAX_ROWS}
  for kernel, rows in most.items():
    assert backend.cpu_kernel_applies(kernel, 'cpu', rows)
    assert not backend.cpu_kernel_applies(kernel, 'cpu', rows + 1)
    assert not backend.cpu_kernel_applies(kernel, 'tpu', 1)
  assert backend.cpu_kernel_applies('halving_argmax', 'cpu', 10**6)
  with pytest.raises(ValueError, match='Unknown CPU kernel'):
    backend.cpu_kernel_applies('fast_argmax', 'cpu')


def test_platform_of_an_array_is_that_of_its_devices():
  assert backend.platform(jnp.zeros(3)) == 'cpu'
  assert backend.platform(np.zeros(3)) == jax.default_backend()
  seen = []
  jax.jit(lambda x: seen.append(backend.platform(x)) or x)(jnp.zeros(3))
  assert seen == ['cpu']


@pytest.mark.parametrize('vocab', [8000, 7999, 32])
@pytest.mark.parametrize('argmax', [cpu_kernels.halving_argmax,
                                    search.greedy_choice])
def test_argmax_including_ties_and_nan(argmax, vocab):
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(6, vocab)).astype(np.float32)
  logits[1] = np.round(logits[1])  # ties: the first maximum wins
  logits[2, [5, vocab - 1]] = np.nan  # NaN is the maximum, as in argmax
  logits[3] = -np.inf
  logits[4, :] = 0.0
  logits[4, [3, vocab // 2]] = 1.0
  got = jax.jit(argmax)(jnp.asarray(logits))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


def screening_case(name):
  """(x [rows, 64], kernel [1000, 64]) float32 for `screened_argmax`."""
  rng = np.random.default_rng(0)
  kernel = rng.normal(0.0, 0.125, (1000, 64)).astype(np.float32)
  x = rng.normal(0.0, 1.0, (16, 64)).astype(np.float32)
  if name == 'peaked':  # A clear winner in every row, as in trained models.
    x += 8.0 * kernel[rng.integers(0, 1000, 16)]
  elif name == 'outliers':  # Coarse int8 steps in both.
    kernel[3, 5] = 40.0
    x[:, 7] *= 50.0
  elif name == 'exact ties':  # Tokens 7 and 700 share the largest logit.
    kernel[700] = kernel[7]
    x = np.tile(kernel[7] * 20.0, (16, 1))
  elif name == 'near ties':  # Tokens 100-109 within 1e-6 of each other.
    kernel[100:110] = kernel[100] + rng.normal(0.0, 1e-6, (10, 64))
    x = np.tile(kernel[100] * 20.0, (16, 1)).astype(np.float32)
  elif name == 'nan, inf, zero':
    x[1, 3] = np.nan
    x[2, 4] = np.inf
    x[3] = 0.0
  return x, kernel


@pytest.mark.parametrize('case', [
    'peaked', 'random', 'outliers', 'exact ties', 'near ties',
    'nan, inf, zero'])
def test_screened_argmax_is_greedy_choice_of_the_logits(case):
  x, kernel = screening_case(case)
  logits = jnp.asarray(x) @ jnp.asarray(kernel).T
  got = jax.jit(cpu_kernels.screened_argmax)(jnp.asarray(x), jnp.asarray(kernel))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
  if case == 'exact ties':
    np.testing.assert_array_equal(got, 7)


@pytest.mark.slow
def test_int8_candidates_hold_the_winner_and_few_others():
  for case in ['peaked', 'random', 'outliers', 'exact ties', 'near ties']:
    x, kernel = screening_case(case)
    count, first, last = jax.jit(cpu_kernels.int8_candidates)(x, kernel)
    winner = np.argmax(x.astype(np.float64) @ kernel.T.astype(np.float64), -1)
    assert np.all((first <= winner) & (winner <= last)), case
    few = count <= 2  # Then the winner is one of them.
    assert np.all(((winner == first) | (winner == last))[few]), case
    if case == 'peaked':  # Where the screen is meant to pay off:
      np.testing.assert_array_equal(count, 1)
    if case == 'exact ties':
      np.testing.assert_array_equal(count, 2)
      np.testing.assert_array_equal([first, last], [[7] * 16, [700] * 16])
    if case == 'near ties':
      assert np.all(count >= 10)
  count, _, _ = cpu_kernels.int8_candidates(*screening_case('nan, inf, zero'))
  np.testing.assert_array_equal(count[1:3], 0)  # NaN and inf screen nothing.
  assert count[3] == 1000  # All logits are zero.


# Whole blocks, a part block, too few values for blocks.
@pytest.mark.parametrize('n', [1000, 1003, 100])
def test_blocked_top_k_equals_lax_top_k_including_ties(n):
  rng = np.random.default_rng(0)
  ties = np.round(rng.normal(size=(3, n)) * 3)
  ties[1, 500:] = -np.inf
  for values in [rng.normal(size=(3, n)), ties]:
    want = jax.lax.top_k(values, 8)
    got = cpu_kernels.blocked_top_k(jnp.asarray(values), 8)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])



def test_search_in_parts_joins_rows_and_keeps_the_largest_scalar():
  inputs = jnp.arange(10, dtype=jnp.int32).reshape(5, 2)
  rows, largest = cpu_kernels.search_in_parts(
      lambda block: (block * 2, jnp.max(block)), inputs, parts=2)
  np.testing.assert_array_equal(rows, inputs * 2)
  assert largest == 9
  seen = []
  cpu_kernels.search_in_parts(lambda block: seen.append(block) or block,
                              (inputs, inputs[:, 0]), parts=2, fill=(7, -1))
  tokens, forced = (np.concatenate(leaves) for leaves in zip(*seen))
  assert (7, 7) in set(map(tuple, tokens.tolist()))  # The filler row.
  assert -1 in forced.tolist()
  with pytest.raises(ValueError, match='batch_parts must be at least 1'):
    cpu_kernels.search_in_parts(lambda block: block, inputs, parts=0)


@pytest.mark.slow
def test_default_batch_parts_is_one_per_core_on_a_single_cpu_device():
  env = {k: v for k, v in os.environ.items() if k != 'XLA_FLAGS'}
  env['JAX_PLATFORMS'] = 'cpu'
  script = ('import jax.numpy as jnp; from jaxformer.model import cpu_kernels; '
            'print([cpu_kernels.default_batch_parts(jnp.zeros((n, 5), jnp.int32))'
            ' for n in (1, 3, 64)])')
  printed = subprocess.run([sys.executable, '-c', script], env=env,
                           capture_output=True, text=True, check=True).stdout
  cores = len(os.sched_getaffinity(0))
  assert printed.split()[-3:] == [
      '[1,', f'{min(3, cores)},', f'{min(64, cores)}]']


