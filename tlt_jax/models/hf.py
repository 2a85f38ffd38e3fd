"""Hugging Face interop: config.json, safetensors weights (single or sharded) and tokenizers.

transformers 5 has no Flax models, so weights are mapped here. Loading reads one tensor at a
time (safetensors memory-maps the file) and places it directly with its target sharding, so a
large model never sits whole in host memory.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from safetensors import safe_open
from safetensors.numpy import save_file

from tlt_jax.mesh import DEFAULT_RULES, logical_to_mesh_spec
from tlt_jax.models.config import (ARCHITECTURE_FLAGS, MODEL_TYPES, ROPE_TYPES, ModelConfig,
                                   RopeConfig)
from tlt_jax.models.decoder import param_logical_axes
from tlt_jax.run_log import write_json

SAFETENSORS_FILE = "model.safetensors"
# The transformers class of each model type, as config.json's `architectures` names it.
CAUSAL_LM_CLASSES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}
# transformers' default of max_window_layers (Qwen2, Qwen3), for configs that omit it.
_DEFAULT_MAX_WINDOW_LAYERS = 28
SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some exporters write that carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def transformers_lib():
  """The transformers module, imported without its advice that PyTorch is missing: this
  package reads configs, tokenizers and generation settings through it, never its models, so
  the line would greet every run of a torch-less install with a warning that does not apply."""
  if "transformers" not in sys.modules:
    previous = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
      import transformers  # noqa: F401  (sys.modules holds it)
    finally:
      if previous is None:
        del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
      else:
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = previous
  return sys.modules["transformers"]


# ---------------------------------------------------------------- config


def _require_config(path: str) -> None:
  if not os.path.isdir(path):
    raise FileNotFoundError(f"model folder {path!r} does not exist")
  if not os.path.isfile(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path!r} has no config.json; expected a Hugging Face model folder "
                            f"(config.json + {SAFETENSORS_FILE} or {SAFETENSORS_INDEX})")


def _read_config_json(path: str) -> dict:
  """`path/config.json` as a dict; FileNotFoundError or ValueError in one line when the folder
  or the file is missing, the file is not JSON, or it names no model_type."""
  _require_config(path)
  config_path = os.path.join(path, "config.json")
  try:
    with open(config_path) as f:
      data = json.load(f)
  except json.JSONDecodeError as e:
    raise ValueError(f"{config_path} is not valid JSON ({e.msg} at line {e.lineno}, column "
                     f"{e.colno}); re-export the model") from None
  model_type = data.get("model_type") if isinstance(data, dict) else None
  if not model_type:
    raise ValueError(f"{config_path} has no model_type; a Hugging Face config of one of "
                     f"{MODEL_TYPES} is needed")
  return data


def check_model_folder(path: str) -> None:
  """Reads what loading `path` will need, cheaply (config.json, the safetensors headers), and
  raises FileNotFoundError or ValueError with one line naming the file and the problem: no
  folder or config.json, config.json that is not JSON or has no supported model_type, no
  weights, an index naming missing shards, a truncated or corrupt safetensors file."""
  config_path = os.path.join(path, "config.json")
  problem = architecture_problem(_read_config_json(path))
  if problem:
    raise ValueError(f"{config_path}: {problem}")
  for fn in sorted(set(_weight_files(path).values())):
    check_safetensors(fn)


def check_safetensors(path: str) -> None:
  """Reads a safetensors file's header and checks that every tensor lies inside the file;
  ValueError with one line when it is truncated or not safetensors."""
  size = os.path.getsize(path)
  problem = None
  with open(path, "rb") as f:
    head = f.read(8)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 0 or 8 + n > size:
      problem = f"its header is cut off ({size} bytes in all)"
    else:
      try:
        meta = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"),
                  default=0)
      except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError,
              IndexError):
        problem = "its header is not a safetensors header"
      else:
        if 8 + n + end > size:
          problem = f"its tensors need {8 + n + end} bytes but the file has {size}"
  if problem:
    raise ValueError(f"{path} is truncated or corrupt: {problem}; copy or export it again")


def _rope_parameters(c: Mapping) -> tuple[dict, str]:
  """(the RoPE parameters, the rope type) of a config dict. transformers 5 keeps them in
  rope_parameters (theta included); older configs have rope_theta and rope_scaling, and a
  rope_scaling beside rope_parameters wins, as transformers reads it."""
  scaling = dict(c.get("rope_scaling") or {})
  if "type" in scaling:  # the older name of rope_type
    scaling.setdefault("rope_type", scaling.pop("type"))
  rp = {**(c.get("rope_parameters") or {}), **scaling}
  return rp, rp.get("rope_type", "default")


def _sliding_window_layers(c: Mapping) -> tuple[list[int], int]:
  """(the layers of a config dict that attend through a sliding window, the number of
  layers), from its layer_types; for configs without them (before transformers 5), by the
  rule transformers derives them with (use_sliding_window and a window: the layers from
  max_window_layers on)."""
  types = c.get("layer_types")
  if types is None:
    n = c.get("num_hidden_layers") or 0
    windowed = c.get("use_sliding_window") and c.get("sliding_window") is not None
    first = c.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS) if windowed else n
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
  return [i for i, t in enumerate(types) if t == "sliding_attention"], len(types)


def architecture_problem(c: Mapping) -> str | None:
  """What in a Hugging Face config this decoder cannot run, in one line (None: it can run
  it). `c` is config.json's dict or a transformers config's `to_dict()`: a model type other
  than the dense ones of MODEL_TYPES (mixtures of experts among them), an activation other
  than SiLU, biases the architecture does not have here, RoPE scaling other than ROPE_TYPES,
  sliding-window attention on any layer."""
  mt = c.get("model_type")
  if mt not in MODEL_TYPES:
    moe = ("moe" in str(mt) or any(c.get(k) for k in ("num_experts", "num_local_experts"))
           or c.get("architectures") and "Moe" in str(c["architectures"]))
    kind = " (a mixture of experts: only dense models run here)" if moe else ""
    return f"unsupported model_type {mt!r}{kind}; supported: {MODEL_TYPES}"
  act = c.get("hidden_act", "silu")
  if act != "silu":
    return f"unsupported hidden_act {act!r}; only 'silu' is supported"
  if mt == "llama" and (c.get("attention_bias") or c.get("mlp_bias")):
    return "Llama attention_bias/mlp_bias=True is not supported"
  if mt == "qwen3" and c.get("attention_bias"):
    return "Qwen3 attention_bias=True (biases on q/k/v/o_proj) is not supported"
  _, rope_type = _rope_parameters(c)
  if rope_type not in ROPE_TYPES:
    return f"unsupported rope_type {rope_type!r} (RoPE scaling); supported: {ROPE_TYPES}"
  sliding, layers = _sliding_window_layers(c)
  if sliding:
    return (f"sliding-window attention (sliding_window={c.get('sliding_window')} on "
            f"{len(sliding)} of {layers} layers, from layer {sliding[0]}) is not supported; "
            f"only full attention runs here")
  return None


# transformers' defaults (LlamaConfig, Qwen2Config, Qwen3Config) of the keys read below, for a
# config.json that omits them. None: derived (head_dim: hidden / heads; Llama's KV heads: its
# heads), as transformers derives them.
_HF_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=None,
                  head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=2048),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  head_dim=None, rms_norm_eps=1e-6, max_position_embeddings=32768),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                  head_dim=128, rms_norm_eps=1e-6, max_position_embeddings=32768),
}


def model_config_from_dict(c: Mapping, **overrides) -> ModelConfig:
  """Maps a Llama/Qwen2/Qwen3 config dict (config.json's, or a transformers config's
  `to_dict()`) to a ModelConfig, with transformers' defaults for the keys it omits; overrides
  win. ValueError (one line, `architecture_problem`) for a config this decoder cannot run."""
  problem = architecture_problem(c)
  if problem:
    raise ValueError(problem)
  mt = c["model_type"]

  def get(key):
    return c[key] if c.get(key) is not None else _HF_DEFAULTS[mt][key]
  rp, rope_type = _rope_parameters(c)
  theta = rp.get("rope_theta") or c.get("rope_theta") or 10000.0
  rope_kw = {k: rp[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                "original_max_position_embeddings") if k in rp}
  heads, hidden = get("num_attention_heads"), get("hidden_size")
  kw = dict(
      vocab_size=get("vocab_size"), hidden_size=hidden,
      intermediate_size=get("intermediate_size"), num_layers=get("num_hidden_layers"),
      num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
      head_dim=get("head_dim") or hidden // heads,
      rope=RopeConfig(theta=float(theta), rope_type=rope_type, **rope_kw),
      rms_norm_eps=get("rms_norm_eps"), **ARCHITECTURE_FLAGS[mt],
      tie_embeddings=bool(c.get("tie_word_embeddings", False)),
      max_position_embeddings=get("max_position_embeddings"), model_type=mt)
  kw.update(overrides)
  return ModelConfig(**kw)


def defaulted_keys_hint(path: str) -> str:
  """'; config.json has no K1, K2: ...' for the shape keys that `path`/config.json omits and
  transformers' defaults filled in ('' when it has them all, or cannot be read): a config
  written without a key it needs reads as a model of the default's size."""
  try:
    c = _read_config_json(path)
  except (OSError, ValueError):
    return ""
  omitted = {k: v for k, v in _HF_DEFAULTS.get(c["model_type"], {}).items()
             if v is not None and c.get(k) is None and k not in ("rms_norm_eps",
                                                                 "max_position_embeddings")}
  if not omitted:
    return ""
  return (f"; {path}/config.json has no {', '.join(omitted)}, so transformers' "
          f"{'default' if len(omitted) == 1 else 'defaults'} "
          f"({', '.join(f'{k}={v}' for k, v in omitted.items())}) stood in: add the model's "
          f"own values")


def model_config_from_hf(hf_config, **overrides) -> ModelConfig:
  """`model_config_from_dict` of a transformers config object."""
  return model_config_from_dict(hf_config.to_dict(), **overrides)


def load_hf_config(path: str, **overrides) -> ModelConfig:
  """Reads `path/config.json` (json alone: transformers' config classes import PyTorch, seconds
  at every job's start) into a ModelConfig; transformers' defaults fill what it omits."""
  return model_config_from_dict(_read_config_json(path), **overrides)


# The tokenizer's ids an export's config.json and generation_config.json carry.
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def hf_config_dict(cfg: ModelConfig, tokenizer=None) -> dict:
  """config.json's dict describing `cfg` as transformers' LlamaConfig, Qwen2Config or
  Qwen3Config would write it (the keys it reads; its own defaults fill the rest), with the
  tokenizer's BOS, EOS and padding ids (None without one). Built without transformers' config
  classes, which import PyTorch. ValueError when cfg's architecture flags are not its model
  type's."""
  if cfg.model_type not in MODEL_TYPES:
    raise ValueError(f"unsupported model_type {cfg.model_type!r}; supported: {MODEL_TYPES}")
  flags = ARCHITECTURE_FLAGS[cfg.model_type]
  wrong = [f"{k}={getattr(cfg, k)}" for k, v in flags.items() if getattr(cfg, k) != v]
  if wrong:
    owner = [mt for mt, f in ARCHITECTURE_FLAGS.items()
             if all(getattr(cfg, k) == v for k, v in f.items())]
    hint = f"; use model_type={owner[0]!r}" if owner else ""
    raise ValueError(f"a {cfg.model_type} export needs "
                     f"{', '.join(f'{k}={v}' for k, v in flags.items())}, not "
                     f"{', '.join(wrong)}{hint}")
  rope = {"rope_type": cfg.rope.rope_type, "rope_theta": cfg.rope.theta}
  if cfg.rope.rope_type == "llama3":
    rope.update(factor=cfg.rope.factor, low_freq_factor=cfg.rope.low_freq_factor,
                high_freq_factor=cfg.rope.high_freq_factor,
                original_max_position_embeddings=cfg.rope.original_max_position_embeddings)
  return dict(
      architectures=[CAUSAL_LM_CLASSES[cfg.model_type]], model_type=cfg.model_type,
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.rms_norm_eps,
      tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_position_embeddings, rope_parameters=rope,
      layer_types=["full_attention"] * cfg.num_layers, dtype=cfg.param_dtype,
      **{key: getattr(tokenizer, key, None) for key in _SPECIAL_IDS},
      transformers_version=transformers_lib().__version__)


# ---------------------------------------------------------------- weight name mapping


@dataclasses.dataclass(frozen=True)
class _Tensor:
  hf_name: str                      # with {i} for per-layer tensors
  path: tuple[str, ...]             # our param path
  to_ours: Callable[[np.ndarray], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]
  hf_shape: tuple[int, ...]
  per_layer: bool = True


def _tensor_table(cfg: ModelConfig) -> list[_Tensor]:
  e, h, kv, d, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                       cfg.intermediate_size, cfg.vocab_size)
  same = lambda w: w  # noqa: E731
  t = lambda w: w.T  # noqa: E731

  def proj_in(heads):  # HF [heads*D, E] <-> ours [E, heads, D]
    return (lambda w: w.T.reshape(e, heads, d), lambda k: k.reshape(e, heads * d).T)

  def bias(heads):  # HF [heads*D] <-> ours [heads, D]
    return (lambda b: b.reshape(heads, d), lambda b: b.reshape(heads * d))

  pre = "model.layers.{i}."
  rows = [
      _Tensor("model.embed_tokens.weight", ("embed", "embedding"), same, same, (v, e), False),
      _Tensor("model.norm.weight", ("norm", "weight"), same, same, (e,), False),
      _Tensor(pre + "input_layernorm.weight", ("layers", "input_layernorm", "weight"),
              same, same, (e,)),
      _Tensor(pre + "post_attention_layernorm.weight",
              ("layers", "post_attention_layernorm", "weight"), same, same, (e,)),
      _Tensor(pre + "self_attn.q_proj.weight", ("layers", "self_attn", "q_proj", "kernel"),
              *proj_in(h), (h * d, e)),
      _Tensor(pre + "self_attn.k_proj.weight", ("layers", "self_attn", "k_proj", "kernel"),
              *proj_in(kv), (kv * d, e)),
      _Tensor(pre + "self_attn.v_proj.weight", ("layers", "self_attn", "v_proj", "kernel"),
              *proj_in(kv), (kv * d, e)),
      _Tensor(pre + "self_attn.o_proj.weight", ("layers", "self_attn", "o_proj", "kernel"),
              lambda w: w.T.reshape(h, d, e), lambda k: k.reshape(h * d, e).T, (e, h * d)),
      _Tensor(pre + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj", "kernel"), t, t,
              (f, e)),
      _Tensor(pre + "mlp.up_proj.weight", ("layers", "mlp", "up_proj", "kernel"), t, t, (f, e)),
      _Tensor(pre + "mlp.down_proj.weight", ("layers", "mlp", "down_proj", "kernel"), t, t,
              (e, f)),
  ]
  if cfg.qk_norm:
    for name in ("q_norm", "k_norm"):
      rows.append(_Tensor(pre + f"self_attn.{name}.weight",
                          ("layers", "self_attn", name, "weight"), same, same, (d,)))
  if cfg.qkv_bias:
    for name, heads in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
      rows.append(_Tensor(pre + f"self_attn.{name}.bias", ("layers", "self_attn", name, "bias"),
                          *bias(heads), (heads * d,)))
  if not cfg.tie_embeddings:
    rows.append(_Tensor("lm_head.weight", ("lm_head", "kernel"), t, t, (v, e), False))
  return rows


def _expected_names(cfg: ModelConfig) -> dict[str, tuple[_Tensor, int | None]]:
  out = {}
  for row in _tensor_table(cfg):
    if row.per_layer:
      for i in range(cfg.num_layers):
        out[row.hf_name.format(i=i)] = (row, i)
    else:
      out[row.hf_name] = (row, None)
  return out


# ---------------------------------------------------------------- loading


def _weight_files(path: str) -> dict[str, str]:
  """Maps each tensor name to the safetensors file that holds it."""
  index = os.path.join(path, SAFETENSORS_INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError):
      raise ValueError(f"{index} is not a safetensors index (valid JSON with a weight_map); "
                       f"re-export the model") from None
    files = {os.path.join(path, fn) for fn in weight_map.values()}
    missing = sorted(fn for fn in files if not os.path.isfile(fn))
    if missing:
      raise FileNotFoundError(f"{SAFETENSORS_INDEX} in {path!r} names shard files that do not "
                              f"exist: {missing}")
    return {name: os.path.join(path, fn) for name, fn in weight_map.items()}
  single = os.path.join(path, SAFETENSORS_FILE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{path!r} has no weights: neither {SAFETENSORS_FILE} nor "
                            f"{SAFETENSORS_INDEX}")
  check_safetensors(single)
  with safe_open(single, framework="np") as f:
    return {name: single for name in f.keys()}


def _listing(names, limit=20) -> str:
  names = sorted(names)
  more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
  return ", ".join(names[:limit]) + more


def load_hf_params(path: str, cfg: ModelConfig, mesh: Mesh | None = None,
                   rules=DEFAULT_RULES) -> dict:
  """Loads HF safetensors weights into our parameter pytree.

  Each tensor is read, converted to cfg.param_dtype and placed with the sharding that its
  logical axes ask for on `mesh` (default: the default device), one tensor at a time. Per-layer
  tensors are stacked on device along the leading `layers` axis.

  Raises:
    FileNotFoundError: no weights in the folder.
    ValueError: missing tensors, unexpected tensors, or a tensor of the wrong shape (each
      message names the tensors).
  """
  files = _weight_files(path)
  expected = _expected_names(cfg)
  present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
  if cfg.tie_embeddings:
    present.discard("lm_head.weight")  # some exporters also write the tied head
  missing = set(expected) - present
  if missing:
    raise ValueError(f"checkpoint {path!r} is missing {len(missing)} tensors: {_listing(missing)}"
                     f"{defaulted_keys_hint(path)}")
  unexpected = present - set(expected)
  if unexpected:
    raise ValueError(f"checkpoint {path!r} has {len(unexpected)} unexpected tensors (does the "
                     f"config match the weights?): {_listing(unexpected)}"
                     f"{defaulted_keys_hint(path)}")

  logical = param_logical_axes(cfg)
  dtype = cfg.jnp_param_dtype
  handles: dict[str, object] = {}

  def read(name: str, row: _Tensor) -> np.ndarray:
    fn = files[name]
    if fn not in handles:
      handles[fn] = safe_open(fn, framework="np").__enter__()
    shape = tuple(handles[fn].get_slice(name).get_shape())
    if shape != row.hf_shape:
      raise ValueError(f"tensor {name!r} has shape {shape}, expected {row.hf_shape} "
                       f"for this config{defaulted_keys_hint(path)}")
    return row.to_ours(handles[fn].get_tensor(name)).astype(dtype)

  def sharding_for(spec: PartitionSpec, shape) -> jax.sharding.Sharding:
    if mesh is None:
      return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(mesh, logical_to_mesh_spec(spec, shape, mesh, rules))

  params: dict = {}
  try:
    for row in _tensor_table(cfg):
      spec = _get(logical, row.path)
      if row.per_layer:
        per_layer_spec = PartitionSpec(*spec[1:])
        layers = []
        for i in range(cfg.num_layers):
          w = read(row.hf_name.format(i=i), row)
          layers.append(jax.device_put(w, sharding_for(per_layer_spec, w.shape)))
        full_shape = (cfg.num_layers, *layers[0].shape)
        value = jax.jit(lambda *xs: jnp.stack(xs),
                        out_shardings=sharding_for(spec, full_shape))(*layers)
        del layers
      else:
        w = read(row.hf_name, row)
        value = jax.device_put(w, sharding_for(spec, w.shape))
      _set(params, row.path, value)
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  return params


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


# ---------------------------------------------------------------- export


def save_safetensors(tensors: dict[str, np.ndarray], path: str) -> None:
  """tensors as a safetensors file, with the permissions of every other file the jobs write
  (safetensors creates its files 0600; here the umask decides, as for open())."""
  save_file(tensors, path, metadata={"format": "pt"})
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(path, 0o666 & ~umask)


def save_hf_checkpoint(path: str, params: dict, cfg: ModelConfig, tokenizer=None,
                       max_shard_bytes: int = 4 << 30) -> None:
  """Writes config.json, generation_config.json, the tokenizer (if given) and safetensors
  weights (sharded with an index past max_shard_bytes).

  The BOS, EOS and padding ids in the configs are the tokenizer's (none without one), not the
  config class's defaults (LlamaConfig's say BOS 1, EOS 2), so that a Hugging Face model
  loaded from `path` stops where this package's rollouts do. Tensors are pulled to the host
  one at a time and written shard by shard.
  """
  config = hf_config_dict(cfg, tokenizer)
  os.makedirs(path, exist_ok=True)
  write_json(os.path.join(path, "config.json"), config)
  # What GenerationConfig.from_model_config makes of it: the special ids.
  generation = transformers_lib().GenerationConfig(**{key: config[key] for key in _SPECIAL_IDS})
  generation._from_model_config = True
  generation.save_pretrained(path)
  if tokenizer is not None:
    tokenizer.save_pretrained(path)

  names = _expected_names(cfg)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  weight_map: dict[str, str] = {}
  written: list[str] = []

  def flush():
    nonlocal size
    if not shards[-1]:
      return
    fn = f"model-{len(written) + 1:05d}.safetensors"
    save_safetensors(shards[-1], os.path.join(path, fn))
    written.append(fn)
    weight_map.update({n: fn for n in shards[-1]})
    shards[-1] = {}
    size = 0

  for name, (row, layer) in names.items():
    value = _get(params, row.path)
    value = value[layer] if layer is not None else value
    arr = np.ascontiguousarray(row.to_hf(np.asarray(jax.device_get(value))))
    if size and size + arr.nbytes > max_shard_bytes:
      flush()
    shards[-1][name] = arr
    size += arr.nbytes
  flush()

  for stale in (SAFETENSORS_FILE, SAFETENSORS_INDEX):
    if os.path.exists(os.path.join(path, stale)):
      os.remove(os.path.join(path, stale))
  if len(written) == 1:
    os.replace(os.path.join(path, written[0]), os.path.join(path, SAFETENSORS_FILE))
  else:
    total = sum(int(np.prod(_get(params, r.path).shape)) * _get(params, r.path).dtype.itemsize
                for r in _tensor_table(cfg))
    n = len(written)
    renamed = {fn: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, fn in enumerate(written)}
    for old, new in renamed.items():
      os.replace(os.path.join(path, old), os.path.join(path, new))
    with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total},
                 "weight_map": {k: renamed[v] for k, v in weight_map.items()}}, f, indent=2)


# ---------------------------------------------------------------- tokenizer


# tokenizer_config.json classes that declare the tokenizer.json is the whole tokenizer (as the
# ones this package trains and saves do).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str):
  """A transformers tokenizer from a local folder (tokenizer.json / tokenizer_config.json).

  A folder whose tokenizer_config.json names a generic class loads as exactly its
  tokenizer.json: AutoTokenizer would pick the class of config.json's model type (Qwen2's for
  this package's policies) and put that family's pre-tokenizer in place of the saved one (and
  import torch, where installed, to read config.json). Other folders go through AutoTokenizer.
  """
  if not any(os.path.isfile(os.path.join(path, f))
             for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
    raise FileNotFoundError(f"{path!r} has no tokenizer files (tokenizer.json or "
                            f"tokenizer_config.json)")
  declared = None
  if os.path.isfile(os.path.join(path, "tokenizer.json")):
    try:
      with open(os.path.join(path, "tokenizer_config.json")) as f:
        declared = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
      pass  # AutoTokenizer reads (and reports) what it can
  if declared in GENERIC_TOKENIZER_CLASSES:
    return transformers_lib().PreTrainedTokenizerFast.from_pretrained(path,
                                                                      local_files_only=True)
  # AutoTokenizer imports the model configs (and torch where it is installed)
  return transformers_lib().AutoTokenizer.from_pretrained(path, local_files_only=True)
