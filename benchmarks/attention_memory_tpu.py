"""Splash attention against the einsums on a TPU, from any machine: the
train step of `wmt14_ende_big` compiled by libtpu's compile-only client
(`jaxformer compile`) with each attention kernel, at several lengths.

  python benchmarks/attention_memory_tpu.py [--topology v5e-8] \
      [--lengths 128,512] [--rows 64]

Per kernel and length (packed batches of ROWS x (LENGTH + LENGTH), data
parallel over every chip, scanned layers without rematerialisation, so the
activations the backward pass keeps are what the kernel leaves):
per-chip temporaries and total memory, the custom calls in the compiled
program (splash is a Mosaic kernel: `tpu_custom_call`), compile seconds and
the cost model's time. Needs `pip install -e ".[tpu]"`.

Printed here (2-core CPU host, libtpu 0.0.42.1, v5e-8, 64 rows; compile
106-233 s each on a shared host; the cost model gave no time for v5e):

      L  kernel  temporaries      total   custom calls
    128  einsum     2.48 GiB   4.91 GiB   (no tpu_custom_call)
    128  splash     2.48 GiB   4.92 GiB   tpu_custom_call 9
    512  einsum    10.75 GiB  13.19 GiB   (no tpu_custom_call)
    512  splash     7.05 GiB   9.49 GiB   tpu_custom_call 9
"""
import argparse
import os
import pathlib

from jaxformer.aot import topology as topology_lib
from jaxformer.aot.compile_run import compile_run
from jaxformer.config.settings import load_config

CONFIG = str(pathlib.Path(__file__).resolve().parents[1] / 'configs'
             / 'wmt14_ende_big.py') + ':bf16'


def overrides(kernel: str, length: int, rows: int, chips: int) -> list[str]:
  return [f'model.attention_impl={kernel}', 'data.batching=pack',
          f'data.batch_size={rows}', f'data.max_source_length={length}',
          f'data.max_target_length={length}', f'model.max_len={length}',
          'model.scan_layers=true', 'model.remat_policy=none',
          f'mesh.data={chips}', 'mesh.fsdp=1']


def measure(topology: str, kernel: str, length: int, rows: int) -> dict:
  chips = topology_lib.topology(topology).chips
  config = load_config(CONFIG, overrides(kernel, length, rows, chips))
  [program] = compile_run(config, topology, kinds=('train',))['programs']
  return program


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--topology', default='v5e-8')
  parser.add_argument('--lengths', default='128,512')
  parser.add_argument('--rows', type=int, default=64)
  args = parser.parse_args()
  os.environ.setdefault('ALLOW_MULTIPLE_LIBTPU_LOAD', '1')
  print(f'wmt14_ende_big bf16 train step on {args.topology}, packed '
        f'{args.rows} x (L+L), data parallel, scanned layers, no remat')
  print(f'{"L":>5} {"kernel":>7} {"temporaries":>12} {"total":>10} '
        f'{"compile":>8} {"cost model":>11}  custom calls')
  for length in (int(n) for n in args.lengths.split(',')):
    for kernel in ('einsum', 'splash'):
      p = measure(args.topology, kernel, length, args.rows)
      memory = p['memory_gib']
      estimate = p['estimated_seconds']
      estimate = f'{estimate * 1e3:.1f} ms' if estimate else 'none'
      calls = ', '.join(f'{t} {n}' for t, n in
                        sorted(p['custom_calls'].items())) or '-'
      print(f'{length:>5} {kernel:>7} {memory["temporaries"]:>8.2f} GiB '
            f'{memory["total"]:>6.2f} GiB {p["compile_seconds"]:>6.0f} s '
            f'{estimate:>11}  {calls}', flush=True)


if __name__ == '__main__':
  main()
