"""Shared command-line plumbing: config flags whose errors read as one line, and device setup."""

from __future__ import annotations

import logging
import sys

import jax
from absl import flags

from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.config import ConfigError, validate_config
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
  app.run(wrapped, flags_parser=parse_flags)
