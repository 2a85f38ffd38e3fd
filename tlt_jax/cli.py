"""Shared command-line plumbing: config files with overrides, config flags whose errors read
as one line, and device setup."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import traceback

import jax
import ml_collections
from absl import flags
from ml_collections.config_flags import tuple_parser

from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import drop_values_made_unread, first_line, validate_config
from tlt_jax.config import RENAMED_KEYS, ConfigError, RunStopped, current_key, renamed_hint
from tlt_jax.mesh import initialize_distributed
from tlt_jax.plugins import import_plugins, with_plugin_sections


def parse_flags(argv: list[str]) -> list[str]:
  """absl `flags_parser` with one-line exits for a config file that is missing, does not parse
  or raises, for bad overrides, and for words left over after the flags."""
  if "config" in flags.FLAGS:
    # Read here first: absl would defer a missing file's error to the config's first use and
    # let other errors of the file through as tracebacks. Plug-ins first: the config file's
    # base_config() then has their sections, which the overrides may set.
    try:
      import_plugins(_plugins_override(argv[1:]))
      read_config_file(_config_spec(argv))
    except ConfigError as e:
      sys.exit(f"config error: {e}")
  current = [_current_override(arg) for arg in argv]
  if argv == sys.argv:  # config_flags finds its override flags in sys.argv
    sys.argv[:] = current
  try:
    rest = flags.FLAGS(current)
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
    # ml_collections reports unknown override keys as AttributeError/KeyError with a hint.
    sys.exit(f"config error: {_one_line(e)}")
  if len(rest) > 1:  # no job takes positional arguments
    sys.exit(f"command line error: {_stray_arguments(current, rest[1:])}")
  return rest


def _current_override(arg: str) -> str:
  """--config.KEY=VALUE with a renamed KEY under its current name (see RENAMED_KEYS)."""
  m = re.match(r"^(--?config\.)([\w.]+)(=.*)?$", arg)
  if not m or m.group(2) not in RENAMED_KEYS:
    return arg
  return m.group(1) + current_key(m.group(2)) + (m.group(3) or "")


def _plugins_override(args) -> str:
  """The value of the last --config.plugins=VALUE (or 'plugins=VALUE' override) in `args`;
  '' without one."""
  values = [m.group(1) for a in args if (m := re.match(r"^(?:--?config\.)?plugins=(.*)$", a))]
  return values[-1] if values else ""


def _config_spec(argv: list[str]) -> str:
  """The --config value absl will read: the first on the command line (as ml_collections
  takes it), else the flag's default."""
  for i, arg in enumerate(argv[1:], 1):
    if arg == "--":
      break
    m = re.match(r"^--?config(=|$)", arg)
    if m:
      return arg[m.end():] if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else "")
  return flags.FLAGS["config"].default_as_str.strip("'")


def _stray_arguments(argv: list[str], stray: list[str]) -> str:
  """What to say about positional words absl left over: most often a value given after a
  space, which absl only takes for non-boolean flags (a boolean's next word is left over)."""
  word = stray[0]
  before = argv[argv.index(word, 1) - 1] if word in argv[1:] else ""  # not: from a flagfile
  words = ", ".join(repr(w) for w in stray)
  if before.startswith("-") and before != "--" and "=" not in before:
    return (f"unexpected argument {words} after {before}: write {before}={word}; every flag "
            f"takes its value after '=' (booleans too: --flag=false)")
  return (f"unexpected argument {words}: the jobs take only flags, each as --flag=value "
          f"(booleans too: --flag=false)")


def _one_line(e: Exception) -> str:
  text = str(e)
  if "Traceback" in text:  # config_flags embeds the config file's traceback: keep its last line
    text = [line for line in text.splitlines() if line.strip()][-1]
  if len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]  # KeyError/AttributeError repr-quote their message
  msg = text.replace("\\n", " ").replace("\\'", "'").replace("\n", " ")
  return f"unknown config key {msg}" if isinstance(e, (AttributeError, KeyError)) else msg


def load_config(flag):
  """The value of a config_flags flag; errors raised by the config file exit in one line. A
  value the config file set for a part of the run that the command line switched off is
  dropped (`components.drop_values_made_unread`)."""
  try:
    config = flag.value
  except (AttributeError, KeyError, ValueError, TypeError) as e:
    sys.exit(f"config error: {_one_line(e)}")
  parsed = flags.FLAGS[flag.name]
  try:
    file_config = read_config_file(parsed.config_filename)
    with_plugin_sections(config)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  return drop_values_made_unread(config, file_config, parsed.override_values)


def setup_devices(config, compilation_cache: bool = True, writes_metrics: bool = True) -> int:
  """Applies mesh.num_cpu_devices and mesh.distributed (before JAX starts a backend), turns
  on the persistent compilation cache (unless compilation_cache=False: benchmarks that time
  compiles), and validates the config against the (global) device count (writes_metrics=False:
  for a job that writes no metrics, see validate_config). Exits with a one-line message on a
  config error."""
  # JAX logs each accelerator plugin it probes and does not find; that is not news here.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  try:
    validate_config(config, writes_metrics=writes_metrics)
    if config.mesh.num_cpu_devices:
      jax.config.update("jax_num_cpu_devices", config.mesh.num_cpu_devices)
    try:
      initialize_distributed(config.mesh.distributed)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    num_devices = jax.device_count()
    validate_config(config, num_devices, writes_metrics)
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


def read_config_file(spec: str) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file given as 'path[:arg]' (as --config takes it).

  Raises ConfigError naming the file (and the current directory, when the path is relative)
  when it is missing, does not parse, has no get_config, or raises (with the line).
  """
  path, _, arg = spec.partition(":")
  where = repr(path) if os.path.isabs(path) else f"{path!r} (in {os.getcwd()})"
  if not os.path.isfile(path):
    fix = ("" if os.path.isabs(path) else "; relative paths are read from the current "
           "directory (the README's configs/... from the repository root): run from there or "
           "give an absolute path")
    raise ConfigError(f"config file {where} does not exist{fix}")
  try:
    module_spec = importlib.util.spec_from_file_location("tlt_jax_config_file", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
      raise ConfigError(f"config file {where} has no get_config(arg) function")
    return module.get_config(arg or None)
  except ConfigError:
    raise
  except SyntaxError as e:
    raise ConfigError(f"config file {where} does not parse: {e.msg} (line {e.lineno})") from None
  except Exception as e:
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__)
             if os.path.abspath(f.filename) == os.path.abspath(path)]
    at = f" at line {lines[-1]}" if lines else ""
    # A ValueError is how config files refuse an argument (an unknown variant): its message is
    # meant for the user. Anything else is a bug in the file, named by its type.
    what = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
    raise ConfigError(f"config file {where} failed{at}: {what}{first_line(e)}"
                      f"{renamed_hint(str(e))}") from None


def config_from_file(spec: str, overrides=()) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file given as 'path[:arg]' (as --config takes it), unlocked,
  with 'key=value' overrides (dotted keys; values parsed to the existing value's type), as
  the command line sets them (`load_config`); the plug-ins an override 'plugins=...' names are
  imported first (`tlt_jax.plugins`)."""
  import_plugins(_plugins_override(overrides))
  config = read_config_file(spec)
  file_config = config.copy_and_resolve_references()
  config.unlock()
  given = []
  for item in overrides:
    key, sep, value = item.partition("=")
    if not sep:
      raise ConfigError(f"override {item!r}: expected key=value, e.g. rl.steps=8")
    given.append(set_config_value(config, key, value))
  return drop_values_made_unread(with_plugin_sections(config), file_config, given)


def set_config_value(config: ml_collections.ConfigDict, dotted: str, value) -> str:
  """config[dotted] = value; a string value is parsed to the type of the value it replaces,
  as the command line parses --config.KEY=VALUE (a tuple: a Python literal, e.g. "(1, 2)" or
  "'4,2,8', '6,2,12'", else one string: "6,2,12,eagle+suffix" is one strategy). Returns the
  key's current name (see RENAMED_KEYS). Raises ConfigError naming the allowed keys when the
  key does not exist."""
  dotted = current_key(dotted)
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
    elif isinstance(old, tuple):
      try:
        value = tuple(tuple_parser.TupleParser().parse(value))
      except ValueError as e:
        raise ConfigError(f"{dotted}={value!r}: {first_line(e)}") from None
    else:
      try:
        value = type(old)(value)
      except (TypeError, ValueError):
        raise ConfigError(f"{dotted}={value!r}: expected a {type(old).__name__}") from None
  node[leaf] = value
  return dotted
