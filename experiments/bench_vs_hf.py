"""Benchmark: tlt_jax against Hugging Face transformers (PyTorch) on the same checkpoint.

One Qwen2-family checkpoint in HF layout (default: the shipped tiny policy) is loaded by both
libraries; the same held-out task prompts are answered with the same max_new_tokens, measured
side by side in one run:

  greedy generation, tokens/s at batch 1, 8 and 64: transformers `generate` (left padding)
                     against the tlt_jax rollout engine (plain decoding), and the share of
                     tlt_jax's wall time its compiled calls were in flight (`tlt_busy_share`;
                     the rest is host work between calls);
  speculative, batch 1: transformers assisted generation (`assistant_model`: the policy cut
                     to its first layers, saved in HF layout, a self-speculative draft model)
                     against tlt_jax SD with its EAGLE drafter (assets/tiny-drafter);
  exactness: greedy outputs compared token for token between the two libraries.

  python -m experiments.bench_vs_hf --out results/vs_hf.json [--quick]

JSON: tokens/s per library and batch size, the ratios tlt_jax / transformers, token-match
counts; a PNG bar chart next to it. Tokens counted are the generated ones up to and including
EOS (padding after EOS is not counted for either library).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys
import tempfile
import time


import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from configs.default import get_config
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import task_prompts
from tlt_jax.mesh import make_mesh
from tlt_jax.drafters import make_drafter
from tlt_jax.drafters.io import load_drafter
from tlt_jax.models.hf import (load_hf_config, load_hf_params, load_tokenizer,
                               save_hf_checkpoint)
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

from .common import usable_cpus, write_json

REPO = pathlib.Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(0.0)


def load_prompts(policy: str, count: int) -> tuple[list[list[int]], int, int]:
  """Held-out problems of the default config's task (the one the tiny policy learnt)."""
  tok = load_tokenizer(policy)
  _, prompts = task_prompts(get_config(), tok, count, eval_split=True)
  return prompts, tok.eos_token_id, tok.pad_token_id


def _trim(tokens, eos):
  """Generated ids up to and including the first EOS."""
  out = []
  for t in tokens:
    out.append(int(t))
    if t == eos:
      break
  return out


# ---------------------------------------------------------------- transformers


def hf_generate(model, prompts, batch, max_new, eos, pad, assistant=None):
  """Greedy generation in batches of `batch` (left padding); (outputs, seconds)."""
  import torch
  outs, seconds = [], 0.0
  for i in range(0, len(prompts), batch):
    group = prompts[i:i + batch]
    width = max(len(p) for p in group)
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for j, p in enumerate(group):
      ids[j, width - len(p):] = torch.tensor(p)
      mask[j, width - len(p):] = 1
    kw = dict(assistant_model=assistant) if assistant is not None else {}
    t = time.perf_counter()
    with torch.inference_mode():
      gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           do_sample=False, eos_token_id=eos, pad_token_id=pad, **kw)
    seconds += time.perf_counter() - t
    outs += [_trim(g[width:].tolist(), eos) for g in gen]
  return outs, seconds


def make_assistant(policy: str, layers: int, out_dir: str) -> str:
  """The policy cut to its first `layers` layers (same embedding, final norm and head), saved
  in HF layout: a draft model for transformers' assisted generation."""
  cfg = load_hf_config(policy)
  params = load_hf_params(policy, cfg)
  small = cfg.replace(num_layers=layers)
  params = dict(params, layers=jax.tree.map(lambda x: x[:layers], params["layers"]))
  save_hf_checkpoint(out_dir, params, small, load_tokenizer(policy))
  return out_dir


# ---------------------------------------------------------------- tlt_jax


def tlt_generate(engine, prompts, batch, key):
  """Greedy generation of the prompts in groups of `batch`; (outputs, seconds, seconds the
  compiled calls were in flight: the rest is host work between them)."""
  outs, seconds, call_s = [], 0.0, 0.0
  for i in range(0, len(prompts), batch):
    res = engine.generate(prompts[i:i + batch], 1, GREEDY, key)
    seconds += res.wall_s
    call_s += res.call_s
    outs += res.tokens
  return outs, seconds, call_s


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--policy", default=str(REPO / "assets" / "tiny-policy"))
  parser.add_argument("--drafter", default=str(REPO / "assets" / "tiny-drafter"))
  parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--batch1-prompts", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=128)
  parser.add_argument("--assistant-layers", type=int, default=2)
  parser.add_argument("--strategy", default="4,2,8")
  parser.add_argument("--quick", action="store_true", help="small run for smoke tests")
  args = parser.parse_args()
  enable_compilation_cache()
  if args.quick:
    args.batch_sizes, args.prompts, args.batch1_prompts, args.max_new_tokens = [1, 4], 4, 2, 24
  for path in (args.policy, args.drafter):
    if not os.path.isdir(path):
      sys.exit(f"{path!r} not found; see the README for how the shipped assets are made")
  if importlib.util.find_spec("torch") is None:
    sys.exit("bench_vs_hf compares with transformers' PyTorch models and needs torch, which "
             "`pip install -e .` does not install: pip install torch (or pip install -e "
             "'.[test]')")

  import torch
  from transformers import AutoModelForCausalLM
  torch.set_num_threads(usable_cpus())

  prompts, eos, pad = load_prompts(args.policy, args.prompts)
  hf_model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
  cfg = load_hf_config(args.policy, attention_impl="reference")
  params = load_hf_params(args.policy, cfg)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  longest = max(len(p) for p in prompts)
  key = jax.random.key(0)
  result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "torch_threads": torch.get_num_threads(), "policy": args.policy,
            "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "greedy": {}, "speculative": {}}

  # ---------------------------------------------------------------- greedy, per batch size
  for b in args.batch_sizes:
    group = prompts[:args.batch1_prompts] if b == 1 else prompts
    ec = EngineConfig(max_batch=b, max_prompt_len=longest, max_new_tokens=args.max_new_tokens,
                      sd_threshold=0, eos_id=eos, pad_id=pad)
    engine = RolloutEngine(cfg, params, mesh, ec)
    # Compiles every program the timed run needs (prompt widths differ): not timed.
    tlt_generate(engine, group, b, key)
    hf_generate(hf_model, group[:b], b, args.max_new_tokens, eos, pad)  # warm-up
    t_out, t_s, t_call = tlt_generate(engine, group, b, key)
    h_out, h_s = hf_generate(hf_model, group, b, args.max_new_tokens, eos, pad)
    tokens = lambda outs: sum(len(o) for o in outs)  # noqa: E731
    same = sum(a == h for a, h in zip(t_out, h_out))
    row = {"prompts": len(group), "tlt_tokens_per_s": tokens(t_out) / t_s,
           "hf_tokens_per_s": tokens(h_out) / h_s, "identical_outputs": same,
           "tlt_tokens": tokens(t_out), "hf_tokens": tokens(h_out),
           "tlt_busy_share": t_call / t_s}
    row["ratio"] = row["tlt_tokens_per_s"] / row["hf_tokens_per_s"]
    result["greedy"][str(b)] = row
    print(f"batch {b:3d}: tlt_jax {row['tlt_tokens_per_s']:8.1f} tok/s (calls in flight "
          f"{row['tlt_busy_share']:.0%} of the time), transformers "
          f"{row['hf_tokens_per_s']:8.1f} tok/s, ratio {row['ratio']:.2f}; identical outputs "
          f"{same}/{len(group)}")

  # ---------------------------------------------------------------- speculative, batch 1
  group = prompts[:args.batch1_prompts]
  with tempfile.TemporaryDirectory() as tmp:
    assistant = AutoModelForCausalLM.from_pretrained(
        make_assistant(args.policy, args.assistant_layers, tmp), dtype=torch.float32).eval()
  name, settings, dparams = load_drafter(args.drafter, cfg)
  ec = EngineConfig(max_batch=1, max_prompt_len=longest, max_new_tokens=args.max_new_tokens,
                    sd_threshold=1, eos_id=eos, pad_id=pad)
  engine = RolloutEngine(cfg, params, mesh, ec, drafters={name: make_drafter(name, settings,
                                                                             dparams)},
                         tuner=FixedTuner(args.strategy))
  tlt_generate(engine, group, 1, key)  # compiles; not timed
  hf_generate(hf_model, group[:1], 1, args.max_new_tokens, eos, pad, assistant=assistant)
  t_out, t_s, t_call = tlt_generate(engine, group, 1, key)
  h_out, h_s = hf_generate(hf_model, group, 1, args.max_new_tokens, eos, pad,
                           assistant=assistant)
  plain = result["greedy"].get("1")
  spec = {"prompts": len(group), "strategy": args.strategy,
          "assistant_layers": args.assistant_layers,
          "tlt_tokens_per_s": sum(map(len, t_out)) / t_s,
          "hf_tokens_per_s": sum(map(len, h_out)) / h_s,
          "identical_outputs": sum(a == h for a, h in zip(t_out, h_out)),
          "tlt_busy_share": t_call / t_s}
  spec["ratio"] = spec["tlt_tokens_per_s"] / spec["hf_tokens_per_s"]
  if plain:
    spec["tlt_sd_vs_tlt_plain"] = spec["tlt_tokens_per_s"] / plain["tlt_tokens_per_s"]
    spec["hf_assisted_vs_hf_plain"] = spec["hf_tokens_per_s"] / plain["hf_tokens_per_s"]
  result["speculative"]["1"] = spec
  print(f"speculative, batch 1: tlt_jax SD {spec['tlt_tokens_per_s']:.1f} tok/s, transformers "
        f"assisted {spec['hf_tokens_per_s']:.1f} tok/s, ratio {spec['ratio']:.2f}; identical "
        f"outputs {spec['identical_outputs']}/{len(group)}")

  args.out.parent.mkdir(parents=True, exist_ok=True)
  write_json(args.out, result)
  plot(result, args.out.with_suffix(".png"))
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


def plot(result, path):
  labels = [f"greedy b={b}" for b in result["greedy"]] + ["SD b=1"]
  rows = list(result["greedy"].values()) + [result["speculative"]["1"]]
  x = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.bar(x - 0.2, [r["hf_tokens_per_s"] for r in rows], 0.4, label="transformers (PyTorch)")
  ax.bar(x + 0.2, [r["tlt_tokens_per_s"] for r in rows], 0.4, label="tlt_jax")
  for xi, r in zip(x, rows):
    ax.text(xi + 0.2, r["tlt_tokens_per_s"], f"{r['ratio']:.1f}x", ha="center", va="bottom",
            fontsize=8)
  ax.set_xticks(x, labels)
  ax.set_ylabel("generated tokens/s")
  ax.set_yscale("log")
  ax.set_title(f"{result['backend']}: same checkpoint, same prompts")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


if __name__ == "__main__":
  main()
