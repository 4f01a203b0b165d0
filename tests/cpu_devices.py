"""The XLA flags of the test processes and of the `jaxformer` processes
they start: `devices` fake CPU devices, compiled at XLA's lowest backend
optimisation level.

The tests run tiny programs that they compile first, so compiling is most
of their work: at level 0 the quick start's 10-step run takes 14.5 s
instead of 22.8 s, with the same losses to the last digit, and the
in-process trainings of test_ema and test_budget 118 s instead of 160 s.
Every process of a test compiles at the same level, so the results it
compares bitwise come from the same code. Comparisons of two code paths
(scanned and unrolled layers, our scores and CTranslate2's) allow for the
float32 roundings that level 0 orders differently (3e-5 where 2e-5 held at
the default level). The processes of `user_commands` run as a user runs
them, with XLA's defaults."""

OPTIMISATION = '--xla_backend_optimization_level=0'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process of `devices` CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {OPTIMISATION}'
