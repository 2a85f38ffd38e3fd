"""Drafter weights in and out, in the EAGLE Hugging Face layout.

A drafter folder holds `config.json` (the DrafterConfig and the policy shape it was trained
for) and `model.safetensors` with EAGLE's tensor names: `fc.weight` / `fc.bias` ([E, in], as
torch.nn.Linear stores them), `layers.{i}.self_attn.q_proj.weight` and the rest of each
decoder layer under the same names as the policy's layers (a Qwen3 policy's `q_norm` /
`k_norm` included), and `norm.weight` / `fuse.weight` when the architecture has them. The embedding and LM head are the policy's and are not saved.

A drafter with a reduced draft vocabulary also holds its own head and the vocabulary maps as
EAGLE-3 stores them: `lm_head.weight` [r, E], `d2t` [r] int64 offsets (policy id = draft id +
d2t[draft id]) and `t2d` [V] bool (the policy ids in the draft vocabulary), with
`draft_vocab_size` at the top level of config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.draft_vocab import ids_from_offsets, in_draft_vocab, offsets_from_ids
from tlt_jax.models.drafter import (DRAFT_TO_POLICY, DrafterConfig, drafter_model_config,
                                    init_drafter_params)
from tlt_jax.models.hf import _tensor_table, save_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# The policy's shape that a drafter depends on; a mismatch on load is an error.
POLICY_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "model_type", "qkv_bias", "qk_norm")


def _tensors(cfg: ModelConfig, dcfg: DrafterConfig):
  """(hf name, our path, to_ours, to_hf) for every drafter tensor."""
  t = lambda w: w.T  # noqa: E731
  rows = [("fc.weight", ("fc", "kernel"), t, t), ("fc.bias", ("fc", "bias"), None, None)]
  if dcfg.feature_layers:
    rows.append(("fuse.weight", ("fuse", "kernel"), t, t))
  if dcfg.norm_output:
    rows.append(("norm.weight", ("norm", "weight"), None, None))
  if dcfg.draft_vocab_size:
    rows.append(("lm_head.weight", ("lm_head", "kernel"), t, t))
    rows.append(("d2t", (DRAFT_TO_POLICY,), ids_from_offsets, offsets_from_ids))
  layer_rows = [r for r in _tensor_table(drafter_model_config(cfg, dcfg)) if r.per_layer]
  for i in range(dcfg.num_layers):
    for r in layer_rows:
      if r.path[1] == "input_layernorm" and i == 0 and not dcfg.norm_input:
        continue  # EAGLE's first layer has no input norm
      rows.append((r.hf_name.format(i=i).removeprefix("model."), (f"layer_{i}",) + r.path[1:],
                   r.to_ours, r.to_hf))
  return rows


def _t2d_mask(d2t: np.ndarray, vocab_size: int) -> np.ndarray:
  return np.asarray(in_draft_vocab(jnp.asarray(d2t), vocab_size))


def save_drafter(path: str, params: dict, cfg: ModelConfig, dcfg: DrafterConfig,
                 metadata: dict | None = None) -> None:
  """Writes config.json and model.safetensors (tensors pulled to the host one at a time)."""
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for name, tree_path, _, to_hf in _tensors(cfg, dcfg):
    value = params
    for k in tree_path:
      value = value[k]
    arr = np.asarray(jax.device_get(value))
    tensors[name] = np.ascontiguousarray(to_hf(arr) if to_hf else arr)
  if dcfg.draft_vocab_size:
    d2t = np.asarray(jax.device_get(params[DRAFT_TO_POLICY]))
    tensors["t2d"] = _t2d_mask(d2t, cfg.vocab_size)
  save_safetensors(tensors, os.path.join(path, WEIGHTS_FILE))
  config = {"architectures": ["TltJaxEagleDrafter"], "drafter": dataclasses.asdict(dcfg),
            "policy": {f: getattr(cfg, f) for f in POLICY_FIELDS},
            "torch_dtype": str(cfg.param_dtype), **(metadata or {})}
  if dcfg.draft_vocab_size:
    config["draft_vocab_size"] = dcfg.draft_vocab_size
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def read_drafter_config(path: str) -> dict:
  """A drafter folder's config.json. Raises ValueError saying what a drafter export holds when
  it is not one (e.g. a policy folder), json.JSONDecodeError when it is not JSON."""
  with open(os.path.join(path, CONFIG_FILE)) as f:
    config = json.load(f)
  if not (isinstance(config, dict) and isinstance(config.get("drafter"), dict)
          and isinstance(config.get("policy"), dict)):
    kind = (f" (it describes a {config['model_type']!r} model: a policy folder?)"
            if isinstance(config, dict) and "model_type" in config else "")
    raise ValueError(f"not a drafter export{kind}; a drafter folder, as python "
                     f"-m tlt_jax.warmup_drafter exports it to WORKDIR/export, holds a "
                     f"{CONFIG_FILE} with 'drafter' and 'policy' sections and the drafter's "
                     f"{WEIGHTS_FILE} (fc, layers.*)")
  return config


def _saved_fields(saved: dict) -> dict:
  """A saved DrafterConfig's fields. Exports from before `feature_layers` counted the fused
  layers (`fused_features`) without naming them; a count of 0 reads as ()."""
  saved = dict(saved)
  count = saved.pop("fused_features", 0)
  if count:
    raise ValueError(f"its {CONFIG_FILE} counts fused_features={count} without naming the "
                     f"policy layers; replace it with \"feature_layers\": [...], the policy "
                     f"layers it was trained on (drafter.feature_layers of its run)")
  return saved


def load_drafter(path: str, cfg: ModelConfig) -> tuple[DrafterConfig, dict]:
  """(DrafterConfig, params as numpy arrays in cfg.param_dtype) from a drafter folder.

  Raises FileNotFoundError for a missing folder or file, and ValueError when the drafter was
  trained for a different policy shape or its tensors do not match its config.
  """
  for fn in (CONFIG_FILE, WEIGHTS_FILE):
    if not os.path.isfile(os.path.join(path, fn)):
      raise FileNotFoundError(f"drafter folder {path!r} has no {fn}; export one with "
                              f"python -m tlt_jax.warmup_drafter")
  config = read_drafter_config(path)
  dcfg = DrafterConfig(**_saved_fields(config["drafter"]))
  wrong = {k: (v, getattr(cfg, k)) for k, v in config["policy"].items()
           if k in POLICY_FIELDS and v != getattr(cfg, k)}
  if wrong:
    raise ValueError(f"drafter {path!r} was trained for another policy shape: "
                     + ", ".join(f"{k}={a!r} (policy has {b!r})" for k, (a, b) in wrong.items()))
  rows = _tensors(cfg, dcfg)
  params: dict = {}
  with safe_open(os.path.join(path, WEIGHTS_FILE), framework="np") as f:
    names = set(f.keys())
    expected = {r[0] for r in rows} | ({"t2d"} if dcfg.draft_vocab_size else set())
    if names != expected:
      raise ValueError(f"drafter {path!r}: missing tensors {sorted(expected - names)}, "
                       f"unexpected tensors {sorted(names - expected)}")
    shapes = jax.eval_shape(lambda: init_drafter_params(cfg, dcfg, jax.random.key(0)))
    for name, tree_path, to_ours, to_hf in rows:
      want = shapes
      for k in tree_path:
        want = want[k]
      want = to_hf(np.zeros(want.shape, np.int8)).shape if to_hf else want.shape
      arr = f.get_tensor(name)
      if arr.shape != want:
        raise ValueError(f"drafter {path!r}: tensor {name!r} has shape {arr.shape}, expected "
                         f"{want} for its config")
      arr = to_ours(arr) if to_ours else arr
      node = params
      for k in tree_path[:-1]:
        node = node.setdefault(k, {})
      node[tree_path[-1]] = arr if tree_path == (DRAFT_TO_POLICY,) else arr.astype(
          cfg.jnp_param_dtype)
    if dcfg.draft_vocab_size:
      d2t = params[DRAFT_TO_POLICY]
      if (np.any(d2t < 0) or np.any(d2t >= cfg.vocab_size) or np.any(np.diff(d2t) <= 0)
          or not np.array_equal(f.get_tensor("t2d"), _t2d_mask(d2t, cfg.vocab_size))):
        raise ValueError(f"drafter {path!r}: its d2t and t2d do not describe one draft "
                         f"vocabulary of increasing policy ids below {cfg.vocab_size}")
  return dcfg, params
