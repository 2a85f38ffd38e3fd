"""Shared command-line plumbing: config files with overrides, config flags whose errors read
as one line, and device setup."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import jax
import ml_collections
from absl import flags

from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import validate_config
from tlt_jax.config import ConfigError, RunStopped
from tlt_jax.mesh import initialize_distributed


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` that turns config-file and override errors into a one-line exit."""
  try:
    return flags.FLAGS(argv)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
    # ml_collections reports unknown override keys as AttributeError/KeyError with a hint.
    sys.exit(f"config error: {_one_line(e)}")


def _one_line(e: Exception) -> str:
  text = str(e)
  if "Traceback" in text:  # config_flags embeds the config file's traceback: keep its last line
    text = [line for line in text.splitlines() if line.strip()][-1]
  if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]  # KeyError/AttributeError repr-quote their message
  msg = text.replace("\\n", " ").replace("\\'", "'").replace("\n", " ")
  if isinstance(e, (AttributeError, KeyError)):
    msg = f"unknown config key {msg}"
  return msg


def load_config(flag):
  """The value of a config_flags flag; errors raised by the config file exit in one line."""
  try:
    return flag.value
  except (AttributeError, KeyError, ValueError, TypeError) as e:
    sys.exit(f"config error: {_one_line(e)}")


def setup_devices(config, compilation_cache: bool = True) -> int:
  """Applies mesh.num_cpu_devices and mesh.distributed (before JAX starts a backend), turns
  on the persistent compilation cache (unless compilation_cache=False: benchmarks that time
  compiles), and validates the config against the (global) device count. Exits with a
  one-line message on a config error."""
  # JAX logs each accelerator plugin it probes and does not find; that is not news here.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  try:
    validate_config(config)
    if config.mesh.num_cpu_devices:
      jax.config.update("jax_num_cpu_devices", config.mesh.num_cpu_devices)
    try:
      initialize_distributed(config.mesh.distributed)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    num_devices = jax.device_count()
    validate_config(config, num_devices)
    if compilation_cache:
      enable_compilation_cache()
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  return num_devices


def run_main(main) -> None:
  """absl app.run with one-line exits for config errors raised anywhere in `main` (for
  example a prompt longer than rollout.max_prompt_len, found while loading data)."""
  from absl import app

  def wrapped(argv):
    try:
      return main(argv)
    except ConfigError as e:
      sys.exit(f"config error: {e}")
    except RunStopped as e:
      sys.exit(f"stopped: {e}")
  app.run(wrapped, flags_parser=parse_flags)


def config_from_file(spec: str, overrides=()) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file given as 'path[:arg]' (as --config takes it), unlocked,
  with 'key=value' overrides (dotted keys; values parsed to the existing value's type)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} not found")
  module_spec = importlib.util.spec_from_file_location("tlt_jax_config_file", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  config.unlock()
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:
      raise ConfigError(f"override {item!r}: expected key=value, e.g. rl.steps=8")
    set_config_value(config, key, value)
  return config


def set_config_value(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  """config[dotted] = value; a string value is parsed to the type of the value it replaces.
  Raises ConfigError naming the allowed keys when the key does not exist."""
  *parents, leaf = dotted.split(".")
  node = config
  for i, name in enumerate(parents):
    if name not in node:
      raise ConfigError(f"unknown config key {dotted!r}: no section "
                        f"{'.'.join(parents[:i + 1])!r}")
    node = node[name]
  if leaf not in node:
    raise ConfigError(f"unknown config key {dotted!r}; allowed under "
                      f"{'.'.join(parents) or 'the top level'}: {sorted(node.keys())}")
  old = node[leaf]
  if isinstance(value, str) and old is not None and not isinstance(old, str):
    if isinstance(old, bool):
      if value.lower() not in ("true", "false"):
        raise ConfigError(f"{dotted}={value!r}: expected true or false")
      value = value.lower() == "true"
    else:
      try:
        value = type(old)(value)
      except (TypeError, ValueError):
        raise ConfigError(f"{dotted}={value!r}: expected a {type(old).__name__}") from None
  node[leaf] = value
