"""The XLA flags of the test processes and of the `jaxformer` processes
they start: `devices` fake CPU devices, compiled at XLA's lowest backend
optimisation level.

The tests' programs are tiny and compiled once or twice each, so compiling
is most of their time: at level 0 the quick start's 10-step run takes
14.5 s instead of 22.8 s in a process of its own, the same losses to the
last digit, and the fast tier 92 s instead of 111 s (2 cores). Every
process of a test compiles at the same level, so results that tests compare
bitwise come from the same code. The processes of `user_commands` run
as a user runs them, with XLA's defaults."""

OPTIMISATION = '--xla_backend_optimization_level=0'


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a process of `devices` CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {OPTIMISATION}'
