"""Imports an experiment (experiments/<name>.py) or a tool (tools/<name>.py) as the module the
command line runs, for unit tests of its pure functions; and checks that a command line of one
parses, without running it."""

import argparse
import contextlib
import importlib
import sys


def load_experiment(name: str):
  """experiments.<name>, or tools.<name> for a name 'tools.<name>' (the repository root is on
  the module path in tests)."""
  return importlib.import_module(name if "." in name else f"experiments.{name}")


class _Parsed(Exception):
  pass


@contextlib.contextmanager
def _parse_only():
  """argparse parses as usual (errors exit 2), then stops the script before it runs."""
  original = argparse.ArgumentParser.parse_args

  def parse_args(self, args=None, namespace=None):
    original(self, args, namespace)
    raise _Parsed

  argparse.ArgumentParser.parse_args = parse_args
  try:
    yield
  finally:
    argparse.ArgumentParser.parse_args = original


def parse_error(module: str, argv: list[str], monkeypatch) -> str | None:
  """None when `python -m module *argv`'s argument parser accepts argv (the script stops
  before it runs), else what went wrong in one line."""
  mod = load_experiment(module)
  monkeypatch.setattr(sys, "argv", [module, *argv])
  try:
    with _parse_only():
      mod.main(argv) if "argv" in mod.main.__code__.co_varnames[:1] else mod.main()
    return "main() returned without parsing its arguments"
  except _Parsed:
    return None
  except SystemExit as e:
    return f"exit {e.code}"
