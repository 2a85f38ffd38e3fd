"""Benchmark: this tree's rollout engine (plain greedy decoding of an HF checkpoint) against
another implementation, --against:

  hf   transformers (PyTorch) on the same checkpoint (the shipped tiny policy) and
       held-out task prompts: `generate` (left padding) at each of --batch-sizes against the
       engine, tokens/s and the share of the engine's wall time its compiled calls were in
       flight (`tlt_busy_share`); at batch 1, assisted generation (`assistant_model`: the
       policy cut to its first 2 layers, saved in HF layout) against the engine's SD with
       its EAGLE drafter at (4, 2, 8); greedy outputs compared token for token. Tokens
       are the generated ones up to and including EOS. Needs torch.
  REV  the engine of git revision REV (its tlt_jax extracted with `git archive`; nothing in
       the working tree changes), in the default config's rollout shape (16 prompts x 8
       samples, 256 new tokens, batch up to 32 rows, two emulated slices, scanned layers).
       Each run is its own process, a warm rollout then a timed one; the two trees take
       turns, --repeats times each, so drift of the machine hits both alike; `speedup` is the
       revision's median wall time over this tree's, `outputs_identical` must hold.

  python -m experiments.bench_vs --against hf --out results/vs_hf.json [--quick]
  python -m experiments.bench_vs --against bfc68b1 --out results/vs_rev/vs_rev.json [--quick]

Writes the JSON and a PNG next to it. The engine is built from the package's oldest stable
calls (EngineConfig, RolloutEngine, the HF loaders), which an earlier revision also has.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

# Not experiments.common's: a revision's child process imports this module with the
# revision's tlt_jax first on the module path, and common imports the package.
REPO = pathlib.Path(__file__).resolve().parents[1]
POLICY = str(REPO / "assets" / "tiny-policy")
# Per comparison: the settings' defaults, and what --quick changes.
DEFAULTS = {"hf": dict(prompts=64, max_new_tokens=128, batch_sizes=[1, 8, 64], batch1_prompts=8,
                       repeats=1, samples=1),
            "rev": dict(prompts=16, max_new_tokens=256, batch_sizes=[32], samples=8, repeats=3)}
QUICK = {"hf": dict(prompts=4, max_new_tokens=24, batch_sizes=[1, 4], batch1_prompts=2),
         "rev": dict(prompts=4, max_new_tokens=32, batch_sizes=[8], samples=2, repeats=1)}


# ---------------------------------------------------------------- the engine, timed


def load(policy: str, slices: int = 1, scan: bool = False):
  """(model config, params, tokenizer, mesh of `slices` replicas) of an HF checkpoint."""
  import jax
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
  cfg = load_hf_config(policy, attention_impl="reference").replace(scan_layers=scan)
  mesh = make_mesh({"replica": slices, "fsdp": 1, "tensor": 1}, jax.devices()[:slices])
  return cfg, load_hf_params(policy, cfg), load_tokenizer(policy), mesh


def engine_for(cfg, params, tok, mesh, max_batch: int, prompts, max_new_tokens: int,
               sd_threshold: int = 0, **kw):
  """The rollout engine for `prompts` (kw: drafters, tuner)."""
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
  # Programs compile on first use (in the untimed pass), as in every revision: an engine
  # that has compile_ahead (on by default now) would otherwise also compile in the background.
  ahead = {"compile_ahead": False} if "compile_ahead" in EngineConfig.__dataclass_fields__ else {}
  ec = EngineConfig(max_batch=max_batch, max_prompt_len=max(map(len, prompts)),
                    max_new_tokens=max_new_tokens, sd_threshold=sd_threshold,
                    eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, **ahead)
  return RolloutEngine(cfg, params, mesh, ec, **kw)


def timed_generate(engine, prompts, samples: int, batch: int, warm: bool = True):
  """Greedy generation of `prompts` x `samples` in groups of `batch` prompts, after an untimed
  pass that compiles its programs: (token lists, seconds, seconds the compiled calls were in
  flight: the rest is host work between them)."""
  import jax
  from tlt_jax.speculative.sampling import SamplingParams
  outs, seconds, call_s = [], 0.0, 0.0
  for _ in range(2 if warm else 1):
    outs, seconds, call_s = [], 0.0, 0.0
    for i in range(0, len(prompts), batch):
      t0 = time.perf_counter()
      res = engine.generate(prompts[i:i + batch], samples, SamplingParams(0.0), jax.random.key(0))
      seconds += time.perf_counter() - t0
      call_s += getattr(res, "call_s", 0.0)
      outs += [list(map(int, t)) for t in res.tokens]
  return outs, seconds, call_s


def _row(prompts, mine, hf, **extra) -> dict:
  """tokens/s of each library, their ratio and the identical outputs."""
  (t_out, t_s, t_call), (h_out, h_s) = mine, hf
  row = {"prompts": len(prompts), "tlt_tokens_per_s": sum(map(len, t_out)) / t_s,
         "hf_tokens_per_s": sum(map(len, h_out)) / h_s,
         "identical_outputs": sum(a == h for a, h in zip(t_out, h_out)),
         "tlt_tokens": sum(map(len, t_out)), "hf_tokens": sum(map(len, h_out)),
         "tlt_busy_share": t_call / t_s, **extra}
  row["ratio"] = row["tlt_tokens_per_s"] / row["hf_tokens_per_s"]
  return row


# ---------------------------------------------------------------- against transformers


def hf_generate(model, prompts, batch, max_new, eos, pad, assistant=None):
  """Greedy generation in batches of `batch` (left padding), after an untimed warm-up batch;
  (outputs up to and including EOS, seconds)."""
  import torch

  def run(group):
    width = max(len(p) for p in group)
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for j, p in enumerate(group):
      ids[j, width - len(p):], mask[j, width - len(p):] = torch.tensor(p), 1
    kw = dict(assistant_model=assistant) if assistant is not None else {}
    t = time.perf_counter()
    with torch.inference_mode():
      gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                           do_sample=False, eos_token_id=eos, pad_token_id=pad, **kw)
    gen = [g[width:] for g in gen.tolist()]
    return [g[:g.index(eos) + 1] if eos in g else g for g in gen], time.perf_counter() - t

  run(prompts[:batch])
  runs = [run(prompts[i:i + batch]) for i in range(0, len(prompts), batch)]
  return [o for outs, _ in runs for o in outs], sum(s for _, s in runs)


def against_hf(args) -> dict:
  import torch
  import jax
  from transformers import AutoModelForCausalLM
  from configs.default import get_config
  from tlt_jax.components import task_prompts
  from tlt_jax.drafters import make_drafter
  from tlt_jax.drafters.io import load_drafter
  from tlt_jax.models.hf import save_hf_checkpoint
  from tlt_jax.speculative.tuner import FixedTuner
  from .common import usable_cpus
  torch.set_num_threads(usable_cpus())
  cfg, params, tok, mesh = load(args.policy)
  _, prompts = task_prompts(get_config(), tok, args.prompts, eval_split=True)
  eos, pad = tok.eos_token_id, tok.pad_token_id
  hf_model = AutoModelForCausalLM.from_pretrained(args.policy, dtype=torch.float32).eval()
  result = {"device": str(jax.devices()[0].device_kind), "backend": jax.default_backend(),
            "torch_threads": torch.get_num_threads(), "policy": args.policy,
            "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d"),
            "command": " ".join(sys.argv), "greedy": {}, "speculative": {}}
  for b in args.batch_sizes:
    group = prompts[:args.batch1_prompts] if b == 1 else prompts
    engine = engine_for(cfg, params, tok, mesh, b, group, args.max_new_tokens)
    row = result["greedy"][str(b)] = _row(
        group, timed_generate(engine, group, 1, b),
        hf_generate(hf_model, group, b, args.max_new_tokens, eos, pad))
    print(f"batch {b:3d}: tlt_jax {row['tlt_tokens_per_s']:8.1f} tok/s (calls in flight "
          f"{row['tlt_busy_share']:.0%} of the time), transformers "
          f"{row['hf_tokens_per_s']:8.1f} tok/s, ratio {row['ratio']:.2f}; identical outputs "
          f"{row['identical_outputs']}/{len(group)}")
  # Speculative, batch 1: the policy's first layers as transformers' draft model.
  group = prompts[:args.batch1_prompts]
  with tempfile.TemporaryDirectory() as tmp:
    small = cfg.replace(num_layers=args.assistant_layers)
    save_hf_checkpoint(tmp, dict(params, layers=jax.tree.map(
        lambda x: x[:args.assistant_layers], params["layers"])), small, tok)
    assistant = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
  name, settings, dparams = load_drafter(args.drafter, cfg)
  engine = engine_for(cfg, params, tok, mesh, 1, group, args.max_new_tokens, sd_threshold=1,
                      drafters={name: make_drafter(name, settings, dparams)},
                      tuner=FixedTuner(args.strategy))
  spec = result["speculative"]["1"] = _row(
      group, timed_generate(engine, group, 1, 1),
      hf_generate(hf_model, group, 1, args.max_new_tokens, eos, pad, assistant=assistant),
      strategy=args.strategy, assistant_layers=args.assistant_layers)
  if plain := result["greedy"].get("1"):
    spec["tlt_sd_vs_tlt_plain"] = spec["tlt_tokens_per_s"] / plain["tlt_tokens_per_s"]
    spec["hf_assisted_vs_hf_plain"] = spec["hf_tokens_per_s"] / plain["hf_tokens_per_s"]
  print(f"speculative, batch 1: tlt_jax SD {spec['tlt_tokens_per_s']:.1f} tok/s, transformers "
        f"assisted {spec['hf_tokens_per_s']:.1f} tok/s, ratio {spec['ratio']:.2f}; identical "
        f"outputs {spec['identical_outputs']}/{len(group)}")
  return result


def plot_hf(result, path, plt):
  import numpy as np
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
  return fig


# ---------------------------------------------------------------- against a revision


def child(tree: str, args) -> dict:
  """In a fresh process whose `tlt_jax` comes from `tree` (its working directory, first on
  the module path): the default config's rollout shape, timed after a warm rollout."""
  import jax
  jax.config.update("jax_num_cpu_devices", 2)
  import tlt_jax
  from tlt_jax.rl.tasks.arithmetic import ArithmeticTask
  from tlt_jax.rl.tokenizer import prompt_ids
  assert pathlib.Path(tlt_jax.__file__).is_relative_to(tree), tlt_jax.__file__
  cfg, params, tok, mesh = load(POLICY, slices=2, scan=True)
  prompts = [prompt_ids(tok, ex.prompt) for ex in ArithmeticTask(seed=1234).examples(args.prompts)]
  engine = engine_for(cfg, params, tok, mesh, args.batch_sizes[0], prompts, args.max_new_tokens)
  tokens, wall, _ = timed_generate(engine, prompts, args.samples, len(prompts))
  return dict(wall_s=wall, tokens=tokens)


def against_revision(args) -> dict:
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.against],
                          capture_output=True, text=True)
  if commit.returncode:
    sys.exit(f"--against {args.against!r} is not a revision of {REPO}: "
             f"{commit.stderr.strip()}")
  flags = ["--prompts", args.prompts, "--samples", args.samples, "--batch-sizes",
           args.batch_sizes[0], "--max-new-tokens", args.max_new_tokens, "--out", os.devnull]
  # `python -m` puts the working directory first on the module path: the tree's tlt_jax wins,
  # and this script's package comes from PYTHONPATH.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
  runs = {"revision": [], "current": []}
  with tempfile.TemporaryDirectory() as tmp:
    archive = pathlib.Path(tmp) / "rev.tar"
    with open(archive, "wb") as f:
      subprocess.run(["git", "-C", str(REPO), "archive", args.against, "tlt_jax"], stdout=f,
                     check=True)
    with tarfile.open(archive) as t:
      t.extractall(pathlib.Path(tmp) / "tree", filter="data")
    trees = {"revision": pathlib.Path(tmp) / "tree", "current": REPO}
    for i in range(args.repeats):
      for name, tree in trees.items():
        out = subprocess.run([sys.executable, "-m", "experiments.bench_vs", "--child", str(tree),
                              *map(str, flags)], cwd=tree, env=env, check=True,
                             capture_output=True, text=True).stdout
        runs[name].append(json.loads(out.strip().splitlines()[-1]))
        print(f"run {i + 1}/{args.repeats} {name:8s} wall {runs[name][-1]['wall_s']:6.2f}s",
              flush=True)
  import jax
  result = dict(rev=commit.stdout.strip(), device=jax.devices()[0].device_kind,
                backend=jax.default_backend(), repeats=args.repeats, num_prompts=args.prompts,
                num_samples=args.samples, max_batch=args.batch_sizes[0],
                max_new_tokens=args.max_new_tokens)
  for name, rs in runs.items():
    walls = [r["wall_s"] for r in rs]
    result[name] = dict(wall_s=walls, median_s=statistics.median(walls),
                        tokens=sum(len(t) for t in rs[0]["tokens"]))
  result["speedup"] = result["revision"]["median_s"] / result["current"]["median_s"]
  result["outputs_identical"] = all(r["tokens"] == runs["current"][0]["tokens"]
                                    for r in runs["revision"] + runs["current"])
  print(json.dumps({k: result[k] for k in ("rev", "speedup", "outputs_identical")}))
  return result


def plot_revision(result: dict, path, plt):
  fig, ax = plt.subplots(figsize=(5, 3.4))
  for i, name in enumerate(("revision", "current")):
    walls = result[name]["wall_s"]
    ax.plot([i] * len(walls), walls, "o", alpha=0.6)
    ax.hlines(result[name]["median_s"], i - 0.2, i + 0.2, color="k")
  ax.set_xticks([0, 1], [f"revision {result['rev']}", "this tree"])
  ax.set_xlim(-0.6, 1.6)
  ax.set_ylim(bottom=0)
  ax.set_ylabel("rollout wall time (s), after compiles")
  ax.set_title(f"plain greedy rollout: {result['speedup']:.2f}x", fontsize=9)
  return fig


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--against", default="hf", metavar="hf|REV",
                 help="transformers (hf), or a git revision's engine")
  p.add_argument("--out", required=True, type=pathlib.Path, help="JSON; the PNG goes next to it")
  p.add_argument("--prompts", type=int, help="held-out prompts (default: hf 64, REV 16)")
  p.add_argument("--max-new-tokens", type=int, help="default: hf 128, REV 256")
  p.add_argument("--batch-sizes", type=int, nargs="+",
                 help="hf: greedy batch sizes (default 1 8 64); REV: the batch (default 32)")
  p.add_argument("--samples", type=int, help="REV: responses per prompt (default 8)")
  p.add_argument("--repeats", type=int, help="REV: timed runs per tree (default 3)")
  p.add_argument("--batch1-prompts", type=int, help="hf: prompts at batch 1 (default 8)")
  p.add_argument("--quick", action="store_true", help="small run for smoke tests")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  # hf: the shipped tiny policy, its EAGLE drafter at (4, 2, 8); its first 2 layers draft for
  # transformers.
  args.policy, args.drafter = POLICY, str(REPO / "assets" / "tiny-drafter")
  args.assistant_layers, args.strategy = 2, "4,2,8"
  kind = "hf" if args.against == "hf" else "rev"
  for key, value in DEFAULTS[kind].items():
    setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
  for key, value in (QUICK[kind] if args.quick else {}).items():
    setattr(args, key, value)
  if args.child:
    print(json.dumps(child(args.child, args)))
    return
  if kind == "hf":
    import importlib.util
    for path in (args.policy, args.drafter):
      if not os.path.isdir(path):
        sys.exit(f"{path!r} not found; see the README for how the shipped assets are made")
    if importlib.util.find_spec("torch") is None:
      sys.exit("--against hf compares with transformers' PyTorch models and needs torch, which "
               "`pip install -e .` does not install: pip install torch (or pip install -e "
               "'.[test]')")
    from tlt_jax.compile_cache import enable_compilation_cache
    enable_compilation_cache()
  result = against_hf(args) if kind == "hf" else against_revision(args)
  from .common import pyplot, save_figure, write_json
  args.out.parent.mkdir(parents=True, exist_ok=True)
  write_json(args.out, result)
  save_figure((plot_hf if kind == "hf" else plot_revision)(result, args.out, pyplot()),
              args.out.with_suffix(".png"), dpi=120)
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
