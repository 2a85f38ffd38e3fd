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
