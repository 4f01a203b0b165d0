"""The host's malloc, set to keep the memory XLA frees for the next step.

XLA on CPU allocates each execution's temporaries with malloc and frees them
when it ends. Out of the box glibc serves XLA's threads from arenas of their
own, whose freed tops go back to the kernel, and large blocks from fresh
mmap()s: every train step then faults its temporaries back in page by page.

`keep_freed_memory` sets glibc (mallopt) to serve every thread from the main
heap, never by mmap, and never to give freed memory back: the temporaries
are then reused from one step to the next. Measured on 2 cores, one process
each, alternately:

  the `small` step (benchmarks/train_throughput.py): 137,000 minor page
  faults and 0.32 s of kernel time per step, 0.98 s a step; with it, none,
  0.01 s and 0.81 s;
  the quick start, end to end: 2 min 39 s, peak RSS 1.74 GB; with it,
  2 min 15 s and 2.21 GB, the same losses and BLEU.

The cost is that a process keeps its peak heap until it exits. It must run
before XLA's threads first allocate, that is before JAX starts its backend:
`import jaxformer` calls it.

It is skipped where malloc is not glibc's, where the user set glibc's malloc
tunables (MALLOC_* or GLIBC_TUNABLES) or preloads another allocator, with
JAXFORMER_SYSTEM_MALLOC=1, and where an accelerator computes (a GPU or TPU
device file, or JAX_PLATFORMS naming another platform first): XLA's
temporaries live on the device there, and what one heap for all the
host's threads (the input pipeline's among them) would cost there is
unmeasured.
"""
import ctypes
import glob
import os
import sys

# mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

# Grow the heap by at least this much at a time (fewer brk calls).
_TOP_PAD_BYTES = 256 << 20
# The largest value mallopt takes: freed memory is never trimmed.
_NEVER = 2 ** 31 - 1

SETTINGS = {
    _M_ARENA_MAX: 1,  # XLA's threads allocate from the main heap...
    _M_MMAP_MAX: 0,  # ... large blocks too, not from fresh mappings...
    _M_TRIM_THRESHOLD: _NEVER,  # ... and what they free stays mapped.
    _M_TOP_PAD: _TOP_PAD_BYTES,
}


# Device files of NVIDIA GPUs and of Cloud TPUs (v2-v4: accel, v5 on: vfio;
# another device passed through VFIO also counts: skipping costs only speed).
ACCELERATOR_DEVICES = ('nvidiactl', 'accel[0-9]*', 'vfio/[0-9]*')


def why_skipped(environ=os.environ, platform: str = sys.platform,
                dev: str = '/dev') -> str:
  """Why `keep_freed_memory` leaves malloc as it is; '' where it applies.

  `dev` is the directory of device files to look for accelerators in.
  """
  if environ.get('JAXFORMER_SYSTEM_MALLOC', '') not in ('', '0'):
    return 'JAXFORMER_SYSTEM_MALLOC is set'
  first_platform = environ.get('JAX_PLATFORMS', '').split(',')[0].strip()
  if first_platform and first_platform != 'cpu':
    return f'JAX_PLATFORMS puts {first_platform} first'
  if not first_platform:
    found = [path for pattern in ACCELERATOR_DEVICES
             for path in glob.glob(os.path.join(dev, pattern))]
    if found:
      return f'an accelerator is present ({found[0]})'
  if platform != 'linux' or not _is_glibc():
    return "malloc is not glibc's"
  own = sorted(key for key in environ
               if key == 'GLIBC_TUNABLES' or key.startswith('MALLOC_'))
  if own:
    return f'the user set {", ".join(own)}'
  if 'malloc' in environ.get('LD_PRELOAD', ''):
    return 'another allocator is preloaded (LD_PRELOAD)'
  return ''


def _is_glibc() -> bool:
  try:
    return (os.confstr('CS_GNU_LIBC_VERSION') or '').startswith('glibc')
  except (ValueError, OSError):
    return False


def keep_freed_memory() -> bool:
  """Applies `SETTINGS` with mallopt; False where it is skipped or glibc
  refuses one of them."""
  if why_skipped():
    return False
  try:
    libc = ctypes.CDLL(None)
    return all(libc.mallopt(key, value) == 1
               for key, value in SETTINGS.items())
  except (OSError, AttributeError):
    return False
