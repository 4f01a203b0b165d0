"""Which of a base model's linear modules a PEFT adapter adapts, for any
interop family: the modules come from the family's weight table (each
2-D `kernel` row is a Linear, named by their module and our path), and
PEFT's `target_modules` are matched against them by PEFT's own rule (a
module is adapted when its name is a target, ends with '.' + a target,
or fully matches a target given as one regex string).

jaxformer adapts projections by kind (`model/lora.py`: q, k, v, o, gate,
up, down, ffn_in, ffn_out), every attention of the model alike (an
encoder-decoder's cross-attention has q, k, v and o too): so an adapter
must adapt every module of a projection or none, and no module that is
not a projection (a pooler, a classifier).
"""
import re
from typing import NamedTuple

from jaxformer.interop.weight_table import Tensor

# jaxformer's parameter name of a Linear -> its projection; 'wo' is 'down'
# under a gated FFN.
PROJECTION_OF = {'query': 'q', 'key': 'k', 'value': 'v', 'out': 'o',
                 'wi_0': 'gate', 'wi_1': 'up', 'wi': 'ffn_in',
                 'wo': 'ffn_out'}


class Module(NamedTuple):
  """A Linear of their model: its name (less '.weight'), our path to it
  (less 'kernel'), its projection (None: not one) and shape [out, in]."""
  name: str
  path: tuple[str, ...]
  projection: str | None
  shape: tuple[int, int]


def linear_modules(table: list[Tensor], gated_ffn: bool) -> list[Module]:
  """Every Linear of a family's `table`, in its order."""
  modules = []
  for row in table:
    if row.path is None or row.path[-1] != 'kernel' or len(row.shape) != 2:
      continue
    kind = PROJECTION_OF.get(row.path[-2])
    if kind == 'ffn_out' and gated_ffn:
      kind = 'down'
    modules.append(Module(row.name[:-len('.weight')], row.path[:-1], kind,
                          row.shape))
  return modules


def matches(name: str, targets: str | list[str]) -> bool:
  """PEFT's rule: does `targets` (target_modules) adapt module `name`?"""
  if isinstance(targets, str):
    return re.fullmatch(targets, name) is not None
  return name in targets or any(name.endswith(f'.{t}') for t in targets)


def _suffixes(names: list[str]) -> list[str]:
  """The dotted suffixes every one of `names` ends with, shortest first."""
  parts = [name.split('.') for name in names]
  common = []
  for pieces in zip(*(reversed(p) for p in parts)):
    if len(set(pieces)) > 1:
      break
    common.insert(0, pieces[0])
  return ['.'.join(common[-i:]) for i in range(1, len(common) + 1)]


def projections(modules: list[Module]) -> dict[str, list[Module]]:
  """The projection modules by projection, in the table's order."""
  kinds: dict[str, list[Module]] = {}
  for module in modules:
    if module.projection:
      kinds.setdefault(module.projection, []).append(module)
  return kinds


def own_name(modules: list[Module], kind: str) -> str | None:
  """The shortest target that adapts exactly the modules of projection
  `kind` ('q_proj', 'attention.output.dense'); None if no suffix does."""
  mine = [m.name for m in modules if m.projection == kind]
  for suffix in _suffixes(mine):
    if all(m.projection == kind for m in modules if matches(m.name, [suffix])):
      return suffix
  return None


def described(modules: list[Module]) -> str:
  """The projections' modules in words: 'q_proj (q), k_proj (k), ...'."""
  words = []
  for kind, mine in projections(modules).items():
    name = own_name(modules, kind) or _suffixes([m.name for m in mine])[-1]
    words.append(f'{name} ({kind})')
  return ', '.join(words)


def targeted(modules: list[Module], targets, family: str) -> list[str]:
  """The projections `targets` (target_modules of adapter_config.json)
  adapt, in jaxformer's order; raises ValueError naming a target that
  matches nothing, a module that is no projection, or a projection only
  some of whose modules are adapted."""
  if targets == 'all-linear':
    return list(projections(modules))
  if not isinstance(targets, (str, list)) or not targets:
    raise ValueError(f'target_modules={targets!r}: jaxformer reads a list of '
                     "module names, a regex or 'all-linear'")
  unmatched = [t for t in ([targets] if isinstance(targets, str) else targets)
               if not any(matches(m.name, [t] if isinstance(targets, list)
                                  else t) for m in modules)]
  if unmatched:
    raise ValueError(f'target_modules {unmatched} match no module of this '
                     f'{family} model; its projections are '
                     f'{described(modules)}')
  chosen = [m for m in modules if matches(m.name, targets)]
  others = [m.name for m in chosen if m.projection is None]
  if others:
    raise ValueError(f'target_modules {targets} adapt {others[0]}, which is '
                     'no projection jaxformer adapts; its projections are '
                     f'{described(modules)}')
  kinds = []
  for kind, mine in projections(modules).items():
    adapted = [m for m in mine if m in chosen]
    if adapted and len(adapted) < len(mine):
      left = next(m.name for m in mine if m not in chosen)
      raise ValueError(f'target_modules {targets} adapt some {kind} modules '
                       f'but not {left}; jaxformer adapts every {kind} of the '
                       'model or none')
    if adapted:
      kinds.append(kind)
  return kinds


def target_names(modules: list[Module], kinds) -> list[str]:
  """target_modules as PEFT writes them for the projections `kinds`: each
  one's own short name, or its modules' full names where no suffix is
  its alone."""
  names = []
  for kind, mine in projections(modules).items():
    if kind in kinds:
      short = own_name(modules, kind)
      names += [short] if short else [m.name for m in mine]
  return names
