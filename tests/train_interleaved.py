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

from jaxformer.cli import main as cli
from jaxformer.config import settings as config_lib
from jaxformer.parallel import cluster
from jaxformer.run import trainer as trainer_lib

from global_batches import interleaved_devices  # This script's folder.


def main() -> int:
  # The runtime first (from JAX_* variables), to see every process's devices;
  # the Trainer then finds it running.
  cluster.initialize_distributed(config_lib.default_config().distributed)
  trainer_lib.Trainer.__init__ = functools.partialmethod(
      trainer_lib.Trainer.__init__, devices=interleaved_devices())
  return cli.main()


if __name__ == '__main__':
  sys.exit(main())
