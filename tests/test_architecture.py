"""The layers of ARCHITECTURE.md: every import of a jaxformer module (those
inside functions too) goes to its own layer or one below."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'jaxformer'

# Module (or package prefix) -> layer, as in ARCHITECTURE.md.
LAYERS = {
    'storage': 0, 'runtime': 0,
    'parallel': 1,
    'model': 2, 'data': 2,
    'train': 3,
    'checkpoints': 4, 'inference': 4,
    'config': 5,
    'run': 6,
    'aot': 7, 'interop': 7,
    'cli': 8, '__main__': 8,
}
# Folders of one layer that must not import each other.
APART = [('model', 'data'), ('checkpoints', 'inference'), ('aot', 'interop')]


def layer(module: str) -> int:
  name = module.removeprefix('jaxformer.')
  while name and name not in LAYERS:
    name = name.rpartition('.')[0]
  assert name, f'{module} has no layer: add it to LAYERS and ARCHITECTURE.md'
  return LAYERS[name]


def imports(path: pathlib.Path) -> set[str]:
  """The jaxformer modules that the file at `path` imports."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name.startswith('jaxformer.')}
    elif isinstance(node, ast.ImportFrom) and node.module and (
        node.module == 'jaxformer' or node.module.startswith('jaxformer.')):
      for a in node.names:  # `from jaxformer.pkg import module` -> the module
        dotted = f'{node.module}.{a.name}'
        is_module = (PACKAGE.parent / (dotted.replace('.', '/') + '.py')
                     ).exists()
        found.add(dotted if is_module else node.module)
  return found


def modules() -> dict[str, pathlib.Path]:
  return {'jaxformer.' + '.'.join(p.relative_to(PACKAGE).with_suffix('').parts
                                  ).removesuffix('.__init__'): p
          for p in PACKAGE.rglob('*.py') if p.name != '__init__.py'}


def test_no_module_imports_a_higher_layer():
  upward = [f'{name} (layer {layer(name)}) imports {target} (layer '
            f'{layer(target)})'
            for name, path in sorted(modules().items())
            for target in sorted(imports(path)) if layer(target) > layer(name)]
  assert not upward, upward


def folder(module: str) -> str:
  return module.removeprefix('jaxformer.').partition('.')[0]


def test_folders_of_one_layer_stay_apart():
  crossing = [f'{name} imports {target}'
              for name, path in sorted(modules().items())
              for target in sorted(imports(path))
              if (folder(name), folder(target)) in APART
              or (folder(target), folder(name)) in APART]
  assert not crossing, crossing


def test_no_module_sits_at_the_top_but_the_package_face():
  loose = sorted(p.name for p in PACKAGE.glob('*.py'))
  assert loose == ['__init__.py', '__main__.py'], loose


def test_no_two_modules_share_a_name():
  names = [p.stem for p in PACKAGE.rglob('*.py') if p.stem != '__init__']
  assert sorted(set(n for n in names if names.count(n) > 1)) == []


def test_no_file_is_over_400_lines():
  long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob('*.py')
          if (n := len(p.read_text().splitlines())) > 400}
  assert not long, long


def test_checkpoint_code_knows_only_orbax_and_paths():
  assert imports(PACKAGE / 'checkpoints/manager.py') == {
      'jaxformer.storage.paths'}
  assert imports(PACKAGE / 'checkpoints/exports.py') == {
      'jaxformer.storage.paths', 'jaxformer.checkpoints.manager'}


def test_the_data_layer_does_not_import_tasks_or_the_model():
  for name, path in modules().items():
    if name.startswith('jaxformer.data.'):
      assert not {t for t in imports(path)
                  if not t.startswith(('jaxformer.data', 'jaxformer.storage.paths',
                                       'jaxformer.parallel.row_share'))
                  }, name


FOREIGN = ('transformers', 'torch', 'ctranslate2', 'safetensors')


def test_only_commands_import_interop():
  users = sorted(name for name, path in modules().items()
                 if not name.startswith('jaxformer.interop')
                 and any(t.startswith('jaxformer.interop')
                         for t in imports(path)))
  assert users and all(name.startswith('jaxformer.cli.') for name in users), users


def test_foreign_frameworks_are_imported_only_inside_interop_functions():
  """transformers, torch, ctranslate2 and safetensors: only in
  jaxformer/interop, and only inside functions (when a command needs
  them)."""
  wrong = []
  for name, path in sorted(modules().items()):
    tree = ast.parse(path.read_text())
    top_level = set(tree.body)
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ''] if isinstance(node, ast.ImportFrom)
               else [])
      if any(n.split('.')[0] in FOREIGN for n in names) and (
          not name.startswith('jaxformer.interop') or node in top_level):
        wrong.append(f'{name}: {names}')
  assert not wrong, wrong
