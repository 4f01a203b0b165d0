"""What a plain `pip install .` brings, for the tests that must not pass on
packages only the test extra installs (gcsfs once was one).

`environment()` gives the variables that make a Python subprocess see only
the distributions that pyproject.toml's core dependencies need (read from
the installed packages' metadata, transitively, with their extras): every
other top-level module installed here (pytest, gcp_storage_emulator, torch,
libtpu...) fails to import in it, as it would on a machine that ran `pip
install .` alone. It works through a `sitecustomize` module on PYTHONPATH
(this folder's `plain_install_site/`).
"""
import importlib.metadata
import os
import pathlib
import re
import tomllib

from packaging.requirements import Requirement

REPO = pathlib.Path(__file__).resolve().parents[1]
SITE = pathlib.Path(__file__).resolve().parent / 'plain_install_site'
HIDDEN = 'JAXFORMER_HIDDEN_MODULES'


def _name(distribution: str) -> str:
  return re.sub(r'[-_.]+', '-', distribution).lower()


def core_requirements() -> list[Requirement]:
  project = tomllib.loads((REPO / 'pyproject.toml').read_text())['project']
  return [Requirement(text) for text in project['dependencies']]


def core_distributions() -> set[str]:
  """Normalised names of the distributions the core dependencies pull in
  (those installed here; a marker that excludes this platform, none)."""
  wanted = [(r, '') for r in core_requirements()]
  seen, names = set(), set()
  while wanted:
    requirement, extra = wanted.pop()
    if requirement.marker and not requirement.marker.evaluate({'extra': extra}):
      continue
    name = _name(requirement.name)
    for wanted_extra in {''} | requirement.extras:
      if (name, wanted_extra) in seen:
        continue
      seen.add((name, wanted_extra))
      names.add(name)
      try:
        requires = importlib.metadata.distribution(name).requires or []
      except importlib.metadata.PackageNotFoundError:
        continue
      wanted += [(Requirement(text), wanted_extra) for text in requires]
  return names


def _packages(distribution: str, top: str) -> set[str]:
  """'top.name' of the packages `distribution` installs in namespace `top`."""
  files = importlib.metadata.distribution(distribution).files or []
  return {f'{top}.{f.parts[1]}' for f in files
          if len(f.parts) > 2 and f.parts[0] == top}


def hidden_modules() -> list[str]:
  """Modules installed here that no core distribution provides: top-level
  ones, and within a namespace shared with a core distribution (google.*)
  the packages of the others."""
  keep = core_distributions() | {'jaxformer'}
  hidden = set()
  for module, owners in importlib.metadata.packages_distributions().items():
    others = {o for o in owners if _name(o) not in keep}
    if len(others) == len(owners):
      hidden.add(module)
    elif others:
      kept = set().union(*(_packages(o, module) for o in set(owners) - others))
      hidden |= set().union(*(_packages(o, module) for o in others)) - kept
  return sorted(hidden)


def environment(base: dict) -> dict:
  """`base` with the variables of a plain-install subprocess."""
  python_path = [str(SITE), str(REPO)] + [
      p for p in base.get('PYTHONPATH', '').split(os.pathsep) if p]
  return dict(base, PYTHONPATH=os.pathsep.join(python_path),
              **{HIDDEN: ','.join(hidden_modules())})
