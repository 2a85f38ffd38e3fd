"""Benchmark: this tree's rollout engine against the engine of an earlier git revision.

Both engines decode the same prompts with the same policy in the default config's rollout
shape (16 prompts x 8 samples, 256 new tokens, batch buckets up to 32 rows, two emulated
slices, scanned layers, plain greedy decoding, so the outputs must be identical). Each run is
its own process: a warm rollout (compiles), then a timed one. The two trees take turns,
--repeats times each, so drift of the machine hits both alike; the median wall time of each is
compared.

  python -m experiments.bench_vs_revision --rev bfc68b1 --out results/vs_rev/vs_rev.json

The earlier tree is extracted with `git archive` into a temporary folder (nothing in the
working tree changes). JSON: per tree the timed wall times, their median and the rollout's
tokens; `speedup` (the revision's median over this tree's) and `outputs_identical`. A PNG
shows the wall times of every run.
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

# Not experiments.common's: the child process imports this module with the revision's
# tlt_jax first on the module path, and common imports the package.
REPO = pathlib.Path(__file__).resolve().parents[1]
POLICY = REPO / "assets" / "tiny-policy"


def time_rollout(tree: str, args) -> dict:
  """In a fresh process whose `tlt_jax` comes from `tree` (its working directory, first on the
  module path; `run_child` starts it there): one warm and one timed rollout."""
  import jax
  jax.config.update("jax_num_cpu_devices", 2)
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
  from tlt_jax.rl.tasks.arithmetic import ArithmeticTask
  from tlt_jax.rl.tokenizer import prompt_ids
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
  from tlt_jax.speculative.sampling import SamplingParams
  import tlt_jax
  assert pathlib.Path(tlt_jax.__file__).is_relative_to(tree), tlt_jax.__file__

  cfg = load_hf_config(str(POLICY), attention_impl="reference").replace(scan_layers=True)
  params = load_hf_params(str(POLICY), cfg)
  tok = load_tokenizer(str(POLICY))
  task = ArithmeticTask(seed=1234)
  prompts = [prompt_ids(tok, ex.prompt) for ex in task.examples(args.num_prompts)]
  mesh = make_mesh({"replica": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
  ec = EngineConfig(max_batch=args.max_batch, max_prompt_len=max(map(len, prompts)),
                    max_new_tokens=args.max_new_tokens, sd_threshold=0,
                    eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
  engine = RolloutEngine(cfg, params, mesh, ec)
  key, greedy = jax.random.key(0), SamplingParams(0.0)
  engine.generate(prompts, args.num_samples, greedy, key)
  t0 = time.perf_counter()
  result = engine.generate(prompts, args.num_samples, greedy, key)
  wall = time.perf_counter() - t0
  return dict(wall_s=wall, tokens=[list(map(int, t)) for t in result.tokens])


def extract(rev: str, into: pathlib.Path) -> pathlib.Path:
  """The `tlt_jax` package of git revision `rev`, extracted under `into`."""
  archive = into / "rev.tar"
  with open(archive, "wb") as f:
    subprocess.run(["git", "-C", str(REPO), "archive", rev, "tlt_jax"], stdout=f, check=True)
  with tarfile.open(archive) as t:
    t.extractall(into / "tree", filter="data")
  return into / "tree"


def run_child(tree: pathlib.Path, args) -> dict:
  cmd = [sys.executable, "-m", "experiments.bench_vs_revision", "--child", str(tree),
         "--num-prompts", str(args.num_prompts), "--num-samples", str(args.num_samples),
         "--max-batch", str(args.max_batch), "--max-new-tokens", str(args.max_new_tokens),
         "--out", os.devnull]
  # `python -m` puts the working directory first on the module path: the tree's tlt_jax wins,
  # and this script's package comes from PYTHONPATH.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
  out = subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True,
                       text=True).stdout
  return json.loads(out.strip().splitlines()[-1])


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
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
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rev", default="HEAD", help="git revision to compare against")
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--num-prompts", type=int, default=16)
  parser.add_argument("--num-samples", type=int, default=8)
  parser.add_argument("--max-batch", type=int, default=32)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--quick", action="store_true", help="small run for smoke tests")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(time_rollout(args.child, args)))
    return
  if args.quick:
    args.repeats, args.num_prompts, args.num_samples, args.max_batch = 1, 4, 2, 8
    args.max_new_tokens = 32
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.rev],
                          capture_output=True, text=True)
  if commit.returncode:
    sys.exit(f"--rev {args.rev!r} is not a revision of {REPO}: {commit.stderr.strip()}")
  runs = {"revision": [], "current": []}
  with tempfile.TemporaryDirectory() as tmp:
    trees = {"revision": extract(args.rev, pathlib.Path(tmp)), "current": REPO}
    for i in range(args.repeats):
      for name, tree in trees.items():
        runs[name].append(run_child(tree, args))
        print(f"run {i + 1}/{args.repeats} {name:8s} wall {runs[name][-1]['wall_s']:6.2f}s",
              flush=True)
  import jax
  result = dict(rev=commit.stdout.strip(), device=jax.devices()[0].device_kind,
                backend=jax.default_backend(), repeats=args.repeats,
                num_prompts=args.num_prompts, num_samples=args.num_samples,
                max_batch=args.max_batch, max_new_tokens=args.max_new_tokens)
  for name, rs in runs.items():
    walls = [r["wall_s"] for r in rs]
    result[name] = dict(wall_s=walls, median_s=statistics.median(walls),
                        tokens=sum(len(t) for t in rs[0]["tokens"]))
  result["speedup"] = result["revision"]["median_s"] / result["current"]["median_s"]
  result["outputs_identical"] = all(r["tokens"] == runs["current"][0]["tokens"]
                                    for r in runs["revision"] + runs["current"])
  from .common import write_json
  args.out.parent.mkdir(parents=True, exist_ok=True)
  write_json(args.out, result)
  plot(result, args.out.with_suffix(".png"))
  print(json.dumps({k: result[k] for k in ("rev", "speedup", "outputs_identical")}))


if __name__ == "__main__":
  main()
