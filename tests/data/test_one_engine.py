"""Every task goes through one engine (data/task_batches.py `ENGINES`), and
nothing in data/ branches on a task's name."""
import ast
import pathlib

import ml_collections
import pytest

import jaxformer.data
from jaxformer.data import task_batches
from jaxformer.train.tasks import TASKS

DATA = pathlib.Path(jaxformer.data.__file__).parent


def _names_a_task(node) -> bool:
  return any(isinstance(n, ast.Attribute) and n.attr == 'task' or
             isinstance(n, ast.Name) and n.id == 'task'
             for n in ast.walk(node))


def test_no_module_of_data_branches_on_a_task_name():
  branches = []
  for path in sorted(DATA.glob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      tests = ([node.test] if isinstance(node, (ast.If, ast.IfExp, ast.While))
               else [node] if isinstance(node, ast.Compare) else [])
      branches += [f'{path.name}:{test.lineno}' for test in tests
                   if _names_a_task(test)]
  assert not branches, branches


def test_every_task_has_an_engine_and_the_row_tasks_share_one():
  engines = {}
  for name in TASKS:
    config = ml_collections.ConfigDict(dict(task=name))
    engines[name] = task_batches.engine_of(config)
  assert {id(engine) for engine in engines.values()} == {
      id(task_batches.TRANSLATION), id(task_batches.ROWS)}
  with pytest.raises(ValueError, match="task='poetry' has no batches"):
    task_batches.engine_of(ml_collections.ConfigDict(dict(task='poetry')))
