"""Writes the global training batches one process of a run sees, as an .npz.

  python tests/global_batches.py TOKENIZER_MODEL TOKEN_CACHE_DIR OUT.npz [interleaved]

Started as 1 process or as each of several (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID): each process builds its own rows of
every batch through the input pipeline and the token cache, the rows are
assembled into global arrays over all devices, and process 0 writes them.
With `interleaved`, the mesh takes the processes' devices in turn (as
`jax.make_mesh` orders the hosts of a TPU pod), so each process feeds row
shards that are not neighbours.
"""
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxformer.config import settings as config_lib
from jaxformer.parallel import cluster
from jaxformer.parallel import mesh as mesh_lib
from jaxformer.data import task_batches
from jaxformer.data import tokenizer as tokenizer_lib

START_STEP, NUM_BATCHES = 30, 3


def interleaved_devices() -> list:
  """Every process's first device, then every process's second, ..."""
  by_process: dict[int, list] = {}
  for device in sorted(jax.devices(), key=lambda d: d.id):
    by_process.setdefault(device.process_index, []).append(device)
  return [device for devices in zip(*by_process.values())
          for device in devices]


def main(model_path: str, token_cache: str, out: str, order: str = '') -> None:
  config = config_lib.default_config()
  cluster.initialize_distributed(config.distributed)
  config.data.builtin.update(num_train=600, num_dev=10, num_test=10)
  config.data.update(batch_size=8, tokens_per_batch=384)
  config.data.tokenizer.vocab_size = 200
  tok = tokenizer_lib.load_tokenizer(model_path)
  mesh = mesh_lib.make_mesh(
      {'data': -1}, interleaved_devices() if order == 'interleaved' else None)
  batches = {}
  for batching in ('pack', 'bucket'):
    config.data.batching = batching
    stream = task_batches.train_batches(
        config, tok, tok, start_step=START_STEP,
        process_index=jax.process_index(), share=mesh_lib.row_share(mesh),
        row_multiple=task_batches.row_multiple(config, mesh_lib.row_shards(mesh)),
        token_cache=token_cache)
    for step, local in zip(range(START_STEP, START_STEP + NUM_BATCHES), stream):
      for key, value in mesh_lib.global_batch(local, mesh).items():
        batches[f'{batching}/{step}/{key}'] = np.asarray(
            multihost_utils.process_allgather(value, tiled=True))
  if jax.process_index() == 0:
    np.savez(out, **batches)


if __name__ == '__main__':
  main(*sys.argv[1:])
