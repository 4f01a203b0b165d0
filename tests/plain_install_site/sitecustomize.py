"""Hides the modules named in JAXFORMER_HIDDEN_MODULES ('top' or
'namespace.package') from this process (tests/plain_install.py: the
packages a plain install lacks): the path finder does not find them, so
importing one fails, and `importlib.util.find_spec` answers None, as if
they were not installed."""
import importlib.abc
import importlib.machinery
import os
import sys


class _PathFinderWithout(importlib.abc.MetaPathFinder):

  def __init__(self, names):
    self.names = frozenset(names)

  def find_spec(self, fullname, path=None, target=None):
    parts = fullname.split('.')
    if parts[0] in self.names or '.'.join(parts[:2]) in self.names:
      return None
    return importlib.machinery.PathFinder.find_spec(fullname, path, target)

  def invalidate_caches(self):
    importlib.machinery.PathFinder.invalidate_caches()


_names = [n for n in os.environ.get('JAXFORMER_HIDDEN_MODULES', '').split(',')
          if n]
if _names:
  sys.meta_path[:] = [_PathFinderWithout(_names)
                      if finder is importlib.machinery.PathFinder else finder
                      for finder in sys.meta_path]
