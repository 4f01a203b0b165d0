"""`jaxformer compile`'s reports, kept in the compilation cache directory
(`compilation_cache.directory`), so that compiling the same programs again
loads their reports instead of compiling.

libtpu's compile-only client writes executables to JAX's persistent cache
but cannot load them back (it has no devices to load them on), so what is
kept is each program's report, keyed by everything its compile depends on:
the lowered program (StableHLO with its shardings), the topology, the jax,
jaxlib and libtpu versions, XLA_FLAGS and LIBTPU_INIT_ARGS, and the code
that measures it (every module of aot/).
"""
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib

from jaxformer.runtime import compilation_cache
from jaxformer.storage import paths

FOLDER = 'jaxformer-compile'


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return ''


def key(lowered_text: str, program, topology_name: str,
        environ=os.environ) -> str:
  """The report's cache key: a sha256 of what its compile depends on."""
  here = pathlib.Path(__file__).parent
  parts = [lowered_text, program.name, program.kind, repr(program.model_flops),
           topology_name, _version('jax'), _version('jaxlib'),
           _version('libtpu'), environ.get('XLA_FLAGS', ''),
           environ.get('LIBTPU_INIT_ARGS', '')]
  parts += [path.read_text() for path in sorted(here.glob('*.py'))]
  digest = hashlib.sha256()
  for part in parts:
    digest.update(part.encode())
    digest.update(b'\0')
  return digest.hexdigest()


def report(program, topo, num_devices: int, measure) -> dict:
  """`measure(program, topo, num_devices)` (report.program_report), or the
  report it gave before for the same key ('from_cache': True)."""
  directory = compilation_cache.directory()
  if directory is None:
    return measure(program, topo, num_devices)
  lowered = program.lower()
  path = paths.join(directory, FOLDER,
                    key(lowered.as_text(), program, topo.name) + '.json')
  if paths.exists(path):
    return dict(json.loads(paths.read_text(path)), from_cache=True)
  result = measure(dataclasses.replace(program, lower=lambda: lowered), topo,
                   num_devices)
  paths.make_dirs(paths.parent(path))
  paths.write_text(path, json.dumps(result))
  return result
