"""`jaxformer train` on a mesh that takes the processes' devices in turn.

  launch/local.sh --processes 2 --devices 2 -- \
    python tests/train_interleaved.py train --config ... --workdir ...

A TPU pod's mesh interleaves hosts (jax.make_mesh orders chips by the
interconnect); CPU processes own neighbouring devices. This runs the
command line's own `train` with one difference, the order of the devices
given to the Trainer: every process's first device, then every process's
second, ... as `tests/global_batches.py interleaved` does.
"""
import functools
import sys

from jaxformer import cli
from jaxformer import config as config_lib
from jaxformer import parallel
from jaxformer.train import loop

from global_batches import interleaved_devices  # This script's folder.


def main() -> int:
  # The runtime first (from JAX_* variables), to see every process's devices;
  # the Trainer then finds it running.
  parallel.initialize_distributed(config_lib.default_config().distributed)
  loop.Trainer.__init__ = functools.partialmethod(
      loop.Trainer.__init__, devices=interleaved_devices())
  return cli.main()


if __name__ == '__main__':
  sys.exit(main())
