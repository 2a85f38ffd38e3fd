"""Trained drafters in and out, in a Hugging Face-style folder, for every trained family.

A drafter folder holds `config.json` and `model.safetensors`. config.json names the family
(`family`, a name of `tlt_jax.drafters.DRAFTERS`), its settings (`drafter`, the family's
Settings) and the policy shape it was trained for (`policy`); the tensors are named as the
family's `hf_tensors` says (EAGLE's: EAGLE's own layout, see `tlt_jax.drafters.eagle.drafter`; the
others': their params paths joined by '.'). The policy's embedding and LM head are never
saved. Folders exported before families had names hold an EAGLE drafter, and read as one.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from safetensors import safe_open

from tlt_jax.drafters import drafter_class, trained_drafters
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf import save_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# The family of an export that names none (written before families had names).
DEFAULT_FAMILY = "eagle"
# The policy's shape that a drafter depends on; a mismatch on load is an error.
POLICY_FIELDS = ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim",
                 "intermediate_size", "model_type", "qkv_bias", "qk_norm")


def _at(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def save_drafter(path: str, name: str, settings, params: dict, cfg: ModelConfig,
                 metadata: dict | None = None) -> None:
  """Writes config.json and model.safetensors of trained drafter `name` (its Settings and
  weights; tensors pulled to the host one at a time)."""
  cls = drafter_class(name, "save_drafter")
  os.makedirs(path, exist_ok=True)
  tensors = {}
  for hf_name, tree_path, _, to_hf in cls.hf_tensors(settings, cfg):
    arr = np.asarray(jax.device_get(_at(params, tree_path)))
    tensors[hf_name] = np.ascontiguousarray(to_hf(arr) if to_hf else arr)
  tensors.update(cls.extra_tensors(settings, params, cfg))
  save_safetensors(tensors, os.path.join(path, WEIGHTS_FILE))
  config = {"architectures": [cls.hf_architecture or f"TltJax{cls.__name__}"], "family": name,
            "drafter": dataclasses.asdict(settings),
            "policy": {f: getattr(cfg, f) for f in POLICY_FIELDS},
            "torch_dtype": str(cfg.param_dtype), **cls.export_config(settings),
            **(metadata or {})}
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
                     f"-m tlt_jax.warmup_drafter exports it to WORKDIR/export/<drafter>, holds "
                     f"a {CONFIG_FILE} with 'family', 'drafter' and 'policy' sections and the "
                     f"drafter's {WEIGHTS_FILE}")
  return config


def exported_family(config: dict) -> str:
  """The drafter family a folder's config.json names (older EAGLE exports name none);
  ValueError for a name that is not registered."""
  family = config.get("family", DEFAULT_FAMILY)
  trained = list(trained_drafters())
  if family not in trained:
    raise ValueError(f"it holds a drafter of family {family!r}, which is not a registered "
                     f"trained drafter ({trained})")
  return family


def check_family(path: str, config: dict, expect: str) -> None:
  """ValueError (one line) when the folder holds another family than `expect`."""
  family = exported_family(config)
  if family != expect:
    raise ValueError(f"drafter folder {path!r} holds a {family!r} drafter, not {expect!r}; "
                     f"give drafter.{expect}.path a folder exported for {expect!r} (or name it "
                     f"drafter.{family}.path)")


def load_drafter(path: str, cfg: ModelConfig, expect: str | None = None):
  """(family name, Settings, params as numpy arrays in cfg.param_dtype) from a drafter
  folder; expect: the family it must hold.

  Raises FileNotFoundError for a missing folder or file, and ValueError (one line) when it
  holds another family, was trained for a different policy shape, or its tensors do not
  match its config.
  """
  for fn in (CONFIG_FILE, WEIGHTS_FILE):
    if not os.path.isfile(os.path.join(path, fn)):
      raise FileNotFoundError(f"drafter folder {path!r} has no {fn}; export one with "
                              f"python -m tlt_jax.warmup_drafter")
  config = read_drafter_config(path)
  name = exported_family(config)
  if expect is not None:
    check_family(path, config, expect)
  cls = drafter_class(name)
  settings = cls.settings_from_saved(config["drafter"])
  wrong = {k: (v, getattr(cfg, k)) for k, v in config["policy"].items()
           if k in POLICY_FIELDS and v != getattr(cfg, k)}
  if wrong:
    raise ValueError(f"drafter {path!r} was trained for another policy shape: "
                     + ", ".join(f"{k}={a!r} (policy has {b!r})" for k, (a, b) in wrong.items()))
  rows = cls.hf_tensors(settings, cfg)
  params: dict = {}
  with safe_open(os.path.join(path, WEIGHTS_FILE), framework="np") as f:
    names = set(f.keys())
    extra = cls.extra_tensor_names(settings)
    expected = {r[0] for r in rows} | extra
    if names != expected:
      raise ValueError(f"drafter {path!r}: missing tensors {sorted(expected - names)}, "
                       f"unexpected tensors {sorted(names - expected)}")
    shapes = jax.eval_shape(lambda: cls.init_params(settings, cfg, jax.random.key(0)))
    for hf_name, tree_path, to_ours, to_hf in rows:
      want = _at(shapes, tree_path)
      fixed = np.issubdtype(want.dtype, np.integer)
      want = to_hf(np.zeros(want.shape, np.int8)).shape if to_hf else want.shape
      arr = f.get_tensor(hf_name)
      if arr.shape != want:
        raise ValueError(f"drafter {path!r}: tensor {hf_name!r} has shape {arr.shape}, "
                         f"expected {want} for its config")
      arr = to_ours(arr) if to_ours else arr
      node = params
      for k in tree_path[:-1]:
        node = node.setdefault(k, {})
      node[tree_path[-1]] = arr if fixed else arr.astype(cfg.jnp_param_dtype)
    try:
      cls.check_loaded(settings, params, {n: f.get_tensor(n) for n in extra}, cfg)
    except ValueError as e:
      raise ValueError(f"drafter {path!r}: {e}") from None
  return name, settings, params
