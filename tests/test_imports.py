"""The package's import graph: every module imports the project's modules at the top, so no
function-level import hides a cycle, and the package imports without one."""

import ast
import importlib
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tlt_jax"
MODULES = sorted(p for p in PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_no_project_import_inside_a_function(path):
  tree = ast.parse(path.read_text())
  late = []
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner in ast.walk(node):
        if isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("tlt_jax"):
          late.append(f"line {inner.lineno}: from {inner.module} import ...")
        if isinstance(inner, ast.Import) and any(a.name.startswith("tlt_jax")
                                                 for a in inner.names):
          late.append(f"line {inner.lineno}: import {inner.names[0].name}")
  assert not late, late


# The jobs define absl flags when imported; one process imports at most one of them.
JOBS = {"train.py", "sft.py", "generate.py", "warmup_drafter.py"}


def test_every_library_module_imports():
  for path in MODULES:
    if path.parent == PACKAGE and path.name in JOBS:
      continue
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    importlib.import_module(name.removesuffix(".__init__"))


# What pytest imports (a script a test runs as a subprocess, like multihost_worker, is not).
TESTS = sorted(p for p in pathlib.Path(__file__).resolve().parent.rglob("*.py")
               if p.name.startswith("test_") or p.name == "conftest.py")


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.name)
def test_no_test_imports_a_job_module(path):
  """pytest-xdist runs many test files in one worker, and two jobs' absl flags in one process
  clash (DuplicateFlagError), so a test runs a job as a subprocess and imports library code."""
  jobs = {f"tlt_jax.{name.removesuffix('.py')}" for name in JOBS}
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom):
      names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
    elif isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    else:
      continue
    found += [f"line {node.lineno}: {n}" for n in names if n in jobs]
  assert not found, found


def _unit(module: str) -> str:
  """The top-level part of the package a module belongs to: 'models' for
  tlt_jax.models.decoder, 'config' for tlt_jax.config, 'tlt_jax' for the package itself."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "tlt_jax"


def _runtime_imports(path: pathlib.Path) -> list[str]:
  """The project modules `path` imports when it runs (imports for type checkers only, under
  `if TYPE_CHECKING:`, left out)."""
  tree = ast.parse(path.read_text())
  typing_only = {id(node) for block in ast.walk(tree)
                 if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                 for node in ast.walk(block)}
  found = []
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tlt_jax"):
      found.append(node.module)
    elif isinstance(node, ast.Import):
      found += [a.name for a in node.names if a.name.startswith("tlt_jax")]
  return found


def _package_graph() -> dict[str, set[tuple[str, str, str]]]:
  """unit -> {(imported unit, importing module, imported module)} across units."""
  graph = {}
  for path in MODULES:
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for imported in _runtime_imports(path):
      if _unit(imported) != _unit(module):
        graph.setdefault(_unit(module), set()).add((_unit(imported), module, imported))
  return graph


def _cycles(graph: dict[str, set]) -> list[list[str]]:
  """The strongly connected groups of two or more units (Tarjan)."""
  index, low, stack, found = {}, {}, [], []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    for w in {edge[0] for edge in graph.get(v, ())}:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      group = stack[stack.index(v):]
      del stack[stack.index(v):]
      if len(group) > 1:
        found.append(sorted(group))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_packages_import_one_another_without_a_circle():
  """The package's parts (subpackages and top-level modules) form layers: no part imports one
  that imports it back, directly or around a circle, so each can be read, tested and replaced
  from the bottom up (kernels < models < drafters < speculative < rollout < drafter_training <
  rl < config < components < the jobs)."""
  graph = _package_graph()
  circles = [(group, sorted(f"{m} -> {i}" for u in group for w, m, i in graph[u] if w in group))
             for group in _cycles(graph)]
  assert not circles, circles


def test_the_circle_check_sees_a_circle():
  graph = {"a": {("b", "tlt_jax.a", "tlt_jax.b")}, "b": {("c", "tlt_jax.b", "tlt_jax.c")},
           "c": {("a", "tlt_jax.c", "tlt_jax.a")}, "d": {("a", "tlt_jax.d", "tlt_jax.a")}}
  assert _cycles(graph) == [["a", "b", "c"]]
  assert _cycles({k: v for k, v in graph.items() if k != "c"}) == []


def test_a_drafter_family_lives_in_the_drafters_package():
  """A family's network, vocabulary and loss sit with it: nothing under tlt_jax/drafters
  imports the trainer, the rollout or the RL code (they import the families)."""
  above = {"drafter_training", "rollout", "rl", "config", "components", "budget"}
  found = [f"{m} -> {i}" for u, edges in _package_graph().items() if u == "drafters"
           for w, m, i in edges if w in above]
  assert not found, found
