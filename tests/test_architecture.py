"""The layers of ARCHITECTURE.md: every import of a jaxformer module (those
inside functions too) goes to its own layer or one below."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / 'jaxformer'

# Module (or package prefix) -> layer, as in ARCHITECTURE.md.
LAYERS = {
    'paths': 0, 'parallel': 0, 'config_ranges': 0, 'hlo': 0, 'token_ids': 0,
    'host_memory': 0, 'row_share': 0, 'compilation_cache': 0,
    'model': 1, 'data': 1,
    'train': 2, 'tasks': 2, 'checkpoint': 2, 'exports': 2, 'decode': 2,
    'hosts': 2,
    'trained': 3, 'evaluate': 3, 'predict': 3, 'plots': 3, 'host_plan': 3,
    'train.loop': 4, 'interop': 4,
    'config': 5, 'aot': 5, 'aot_cache': 5, 'exiting': 5, 'cli': 5,
}


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
      if node.module == 'jaxformer':
        found |= {f'jaxformer.{a.name}' for a in node.names}
      else:
        found.add(node.module)
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


def test_checkpoint_code_knows_only_orbax_and_paths():
  assert imports(PACKAGE / 'checkpoint.py') == {'jaxformer.paths'}
  assert imports(PACKAGE / 'exports.py') == {'jaxformer.paths',
                                             'jaxformer.checkpoint'}


def test_the_data_layer_does_not_import_tasks_or_the_model():
  for name, path in modules().items():
    if name.startswith('jaxformer.data.'):
      assert not {t for t in imports(path)
                  if not t.startswith(('jaxformer.data', 'jaxformer.paths',
                                       'jaxformer.token_ids',
                                       'jaxformer.row_share'))
                  }, name


FOREIGN = ('transformers', 'torch', 'ctranslate2', 'safetensors')


def test_only_commands_import_interop():
  users = sorted(name for name, path in modules().items()
                 if not name.startswith('jaxformer.interop')
                 and any(t.startswith('jaxformer.interop')
                         for t in imports(path)))
  assert users == ['jaxformer.cli'], users


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
