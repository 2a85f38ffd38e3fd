"""Imports an experiment script (experiments/ is not a package) as a module, for unit tests of
its pure functions."""

import importlib.util
import os
import sys

from tests.conftest import REPO


def load_experiment(name: str):
  """experiments/<name>.py as the module `name`."""
  spec = importlib.util.spec_from_file_location(
      name, os.path.join(REPO, "experiments", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
  spec.loader.exec_module(module)
  return module
