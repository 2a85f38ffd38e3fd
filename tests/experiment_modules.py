"""Imports an experiment (experiments/<name>.py) or a tool (tools/<name>.py) as the module the
command line runs, for unit tests of its pure functions."""

import importlib


def load_experiment(name: str):
  """experiments.<name>, or tools.<name> for a name 'tools.<name>' (the repository root is on
  the module path in tests)."""
  return importlib.import_module(name if "." in name else f"experiments.{name}")
