"""The configuration schema shared by every `configs/*.py` file, and its validation.

Config files start from `base_config()`, change values, and return it locked, so a typo in a
key fails where it is written ("Did you mean ...?"). `validate_config` then checks values
before anything is compiled, and `model_config(config)` turns `config.model` into a ModelConfig.
"""

from __future__ import annotations

import difflib
import os

import ml_collections

from tlt_jax.kernels import ATTENTION_IMPLS
from tlt_jax.mesh import DEFAULT_RULES, resolve_axis_sizes
from tlt_jax.models.config import DTYPES, ROPE_TYPES, ModelConfig, RopeConfig

MODEL_TYPES = ("qwen2", "llama")


class ConfigError(ValueError):
  """A configuration value or key is wrong; the message names the key and the fix."""


def base_config() -> ml_collections.ConfigDict:
  """Every knob with its default. Sections grow as subsystems land."""
  c = ml_collections.ConfigDict()
  c.seed = 0

  c.mesh = ml_collections.ConfigDict()
  # Axis order matters: replica slices are the outermost groups of devices.
  c.mesh.axes = ml_collections.ConfigDict({"replica": 1, "fsdp": -1, "tensor": 1})
  # On CPU, emulate this many devices (0 = leave JAX's default). Ignored on GPU.
  c.mesh.num_cpu_devices = 0
  c.mesh.rules = DEFAULT_RULES

  c.model = ml_collections.ConfigDict()
  # A local Hugging Face folder; empty = randomly initialised weights of the shape below.
  c.model.path = ""
  c.model.model_type = "qwen2"
  c.model.vocab_size = 512
  c.model.hidden_size = 64
  c.model.intermediate_size = 128
  c.model.num_layers = 4
  c.model.num_heads = 4
  c.model.num_kv_heads = 2
  c.model.head_dim = 16
  c.model.rope_theta = 10000.0
  c.model.rms_norm_eps = 1e-6
  c.model.tie_embeddings = False
  c.model.max_position_embeddings = 4096
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.attention_impl = "auto"

  c.generate = ml_collections.ConfigDict()
  c.generate.num_prompts = 16
  c.generate.prompt_len = 16
  c.generate.max_new_tokens = 64
  c.generate.temperature = 0.0
  return c


def _check_keys(config, schema, prefix: str = "") -> None:
  for key in config.keys():
    name = f"{prefix}{key}"
    if key not in schema:
      close = difflib.get_close_matches(key, list(schema.keys()), n=1)
      hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
      raise ConfigError(f"unknown config key {name!r}.{hint} Allowed under "
                        f"{prefix.rstrip('.') or 'the top level'}: {sorted(schema.keys())}")
    if isinstance(schema[key], ml_collections.ConfigDict) and key != "axes":
      if not isinstance(config[key], ml_collections.ConfigDict):
        raise ConfigError(f"config key {name!r} must be a section, got {config[key]!r}")
      _check_keys(config[key], schema[key], name + ".")


def _one_of(value, allowed, key: str) -> None:
  if value not in allowed:
    raise ConfigError(f"{key}={value!r} is not allowed; allowed values: {tuple(allowed)}")


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
  """Checks keys and values; raises ConfigError naming the key and the allowed values.

  Args:
    num_devices: when given, the mesh shape must fit this many devices.
  """
  _check_keys(config, base_config())
  m = config.model
  _one_of(m.dtype, DTYPES, "model.dtype")
  _one_of(m.param_dtype, DTYPES, "model.param_dtype")
  _one_of(m.attention_impl, ATTENTION_IMPLS, "model.attention_impl")
  _one_of(m.model_type, MODEL_TYPES, "model.model_type")
  if m.path:
    if not os.path.isdir(m.path):
      raise ConfigError(f"model.path={m.path!r} does not exist; give a local Hugging Face "
                        f"folder, or '' for random weights")
    if not os.path.isfile(os.path.join(m.path, "config.json")):
      raise ConfigError(f"model.path={m.path!r} has no config.json")
  axes = dict(config.mesh.axes)
  if not axes:
    raise ConfigError("mesh.axes must name at least one axis, e.g. {'replica': 1, 'fsdp': -1}")
  if config.mesh.num_cpu_devices < 0:
    raise ConfigError(f"mesh.num_cpu_devices={config.mesh.num_cpu_devices} must be >= 0")
  if num_devices is not None:
    try:
      resolve_axis_sizes(axes, num_devices)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  g = config.generate
  for key in ("num_prompts", "prompt_len", "max_new_tokens"):
    if g[key] <= 0:
      raise ConfigError(f"generate.{key}={g[key]} must be positive")
  if g.temperature < 0:
    raise ConfigError(f"generate.temperature={g.temperature} must be >= 0")


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig described by `config.model` (read from model.path when it is set)."""
  m = config.model
  runtime = dict(dtype=m.dtype, param_dtype=m.param_dtype, attention_impl=m.attention_impl)
  if m.path:
    from tlt_jax.models.hf import load_hf_config
    return load_hf_config(m.path, **runtime)
  try:
    return ModelConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        rope=RopeConfig(theta=m.rope_theta, rope_type=ROPE_TYPES[0]),
        rms_norm_eps=m.rms_norm_eps, qkv_bias=(m.model_type == "qwen2"),
        tie_embeddings=m.tie_embeddings, max_position_embeddings=m.max_position_embeddings,
        model_type=m.model_type, **runtime)
  except ValueError as e:
    raise ConfigError(str(e)) from None
