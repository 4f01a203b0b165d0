"""`jaxformer` run as a user runs it: a process of its own, in a working
directory of the test's, with the paths relative to it, and JAX left to
choose its platform (the tests' conftest pins it to the CPU)."""
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def user_environment(**extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_PLATFORMS', 'XLA_FLAGS')}
  env['PYTHONPATH'] = os.pathsep.join(
      [str(REPO)] + [p for p in env.get('PYTHONPATH', '').split(os.pathsep)
                     if p])
  return {**env, **extra}


def run(cwd, *args, stdin: str = '', **env) -> subprocess.CompletedProcess:
  """`jaxformer ARGS` in `cwd`, whatever its exit status."""
  return subprocess.run(
      [sys.executable, '-m', 'jaxformer', *args], cwd=cwd, input=stdin,
      capture_output=True, text=True, env=user_environment(**env),
      timeout=600)


def jaxformer(cwd, *args, stdin: str = '', **env) -> str:
  """`jaxformer ARGS` in `cwd`; asserts that it succeeds with nothing on
  stderr (no library's warnings or start-up lines); returns its stdout."""
  result = run(cwd, *args, stdin=stdin, **env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stderr == '', f'stderr of {args[0]}:\n{result.stderr}'
  return result.stdout
