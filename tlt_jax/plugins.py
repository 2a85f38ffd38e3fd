"""Plug-ins from the user's own modules: the config's top-level `plugins` names them (a
comma-separated list of importable module names or .py file paths), and they are imported
before the config file is read (`--config.plugins=` on the command line, `plugins=` in
`cli.config_from_file`'s overrides) and again before the config is validated, so that a
drafter, algorithm or task they register (`register_drafter`, `register_algorithm`,
`register_task`, all over `tlt_jax.registry.register`) is a name the run can use, with its
config section (docs/extending.md, "Plug-ins from your own module")."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import ml_collections

from tlt_jax.config import ConfigError, base_config

# Resolved .py path -> its module, so that naming a file twice imports (registers) it once.
_FILES: dict[str, types.ModuleType] = {}


def plugin_names(spec) -> tuple[str, ...]:
  """The entries of a `plugins` value: a comma-separated string or a sequence of strings."""
  parts = spec.split(",") if isinstance(spec, str) else list(spec)
  return tuple(p.strip() for p in parts if p.strip())


def import_plugins(spec) -> tuple[types.ModuleType, ...]:
  """Imports each plug-in of `spec` (see `plugin_names`), once: a name ending in .py is a file
  (relative to the current directory), anything else a module on sys.path. ConfigError (one
  line, naming `plugins`) for one that is missing or raises on import."""
  return tuple(_import_one(name) for name in plugin_names(spec))


def import_file(path: str) -> types.ModuleType:
  """The module in the .py file at `path` (relative to the current directory), imported once
  per resolved path: a plug-in named twice registers once, and a config file imports the
  settings file beside it (configs/presets.py) however often it is read. FileNotFoundError
  for a missing file; the module's own error if it raises."""
  path = os.path.abspath(path)
  if path in _FILES:
    return _FILES[path]
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no such file: {path}")
  module_name = f"tlt_jax_file_{os.path.splitext(os.path.basename(path))[0]}"
  spec = importlib.util.spec_from_file_location(module_name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[module_name] = module  # dataclasses look their module up while importing
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[module_name]
    raise
  _FILES[path] = module
  return module


def _import_one(name: str) -> types.ModuleType:
  key = f"plugins={name!r}"
  try:
    if not name.endswith(".py"):
      return importlib.import_module(name)
    if not os.path.isfile(name):
      raise ConfigError(f"{key}: no such file (in {os.getcwd()}); give a .py path or an "
                        f"importable module name")
    return import_file(name)
  except ConfigError:
    raise
  except ModuleNotFoundError as e:
    if e.name != name:  # the plug-in imports a module that is missing
      raise ConfigError(f"{key} failed to import: {e}") from None
    raise ConfigError(f"{key}: {e} (a module name must be importable: on sys.path or "
                      f"PYTHONPATH; or give the .py file's path)") from None
  except Exception as e:  # noqa: BLE001 - the plug-in's own error, in one line
    first = str(e).splitlines()[0] if str(e) else ""
    raise ConfigError(f"{key} failed to import: {type(e).__name__}: {first}") from None


def with_plugin_sections(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Imports config.plugins and adds to `config` (in place; returned) every key of the schema
  it lacks: the sections of what they registered (a config file that names its plug-ins
  itself ran `base_config()` before they were imported)."""
  import_plugins(config.get("plugins", ""))
  with config.unlocked():
    _add_missing(config, base_config())
  return config


def _add_missing(config: ml_collections.ConfigDict, schema: ml_collections.ConfigDict) -> None:
  for key, value in schema.items():
    if key not in config:
      config[key] = value
    elif isinstance(value, ml_collections.ConfigDict) and isinstance(
        config[key], ml_collections.ConfigDict) and key != "axes":
      _add_missing(config[key], value)
