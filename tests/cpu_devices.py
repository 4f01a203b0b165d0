"""The XLA flags of the `jaxformer` processes that tests start: `devices`
fake CPU devices, compiled at XLA's lowest backend optimisation level.

Those processes run tiny programs that they compile first, so compiling is
most of their work: at level 0 the quick start's 10-step run takes 14.5 s
instead of 22.8 s, with the same losses to the last digit. The processes
of one test compile at the same level, so the results it compares bitwise
come from the same code. The test processes themselves keep XLA's default
level: they compare two code paths (scanned and unrolled layers, our
scores and CTranslate2's) to within a few float32 roundings, which level 0
changes (3e-5 where 2e-5 held). The processes of `user_commands` run as a
user runs them, with XLA's defaults."""

OPTIMISATION = '--xla_backend_optimization_level=0'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a `jaxformer` process of `devices` CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {OPTIMISATION}'
