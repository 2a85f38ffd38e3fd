"""Benchmark: this tree's rollout engine against git revision REV's (its tlt_jax extracted with
`git archive`; the working tree is untouched): plain greedy decoding of the shipped tiny policy
in the default config's rollout shape (SHAPE, two emulated slices, scanned layers).

Each run is its own process, a warm rollout then a timed one; the trees take turns, --repeats
times each, so drift of the machine hits both alike. The engine is built from calls an earlier
revision also has (EngineConfig, RolloutEngine, the HF loaders). Writes the JSON and a PNG next
to it. (The transformers peer is `experiments.profile_decode --peer`.)

  python -m experiments.bench_vs --against bfc68b1 --out results/vs_rev/vs_rev.json [--quick]
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
SHAPE = dict(num_prompts=16, num_samples=8, max_batch=32, max_new_tokens=256)
QUICK_SHAPE = dict(num_prompts=4, num_samples=2, max_batch=8, max_new_tokens=32)


def child(tree: str, shape: dict) -> dict:
  """In a fresh process whose `tlt_jax` comes from `tree` (its working directory, first on
  the module path): the rollout's wall time after a warm rollout that compiles, and its tokens."""
  import jax
  jax.config.update("jax_num_cpu_devices", 2)
  import tlt_jax
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
  from tlt_jax.rl.tasks.arithmetic import ArithmeticTask
  from tlt_jax.rl.tokenizer import prompt_ids
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
  from tlt_jax.speculative.sampling import SamplingParams
  assert pathlib.Path(tlt_jax.__file__).is_relative_to(tree), tlt_jax.__file__
  cfg = load_hf_config(POLICY, attention_impl="reference").replace(scan_layers=True)
  mesh = make_mesh({"replica": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
  tok = load_tokenizer(POLICY)
  prompts = [prompt_ids(tok, ex.prompt)
             for ex in ArithmeticTask(seed=1234).examples(shape["num_prompts"])]
  # Programs compile on first use (in the untimed pass), as in every revision: an engine
  # that has compile_ahead (on by default now) would otherwise also compile in the background.
  ahead = {"compile_ahead": False} if "compile_ahead" in EngineConfig.__dataclass_fields__ else {}
  engine = RolloutEngine(cfg, load_hf_params(POLICY, cfg), mesh, EngineConfig(
      max_batch=shape["max_batch"], max_prompt_len=max(map(len, prompts)),
      max_new_tokens=shape["max_new_tokens"], sd_threshold=0, eos_id=tok.eos_token_id,
      pad_id=tok.pad_token_id, **ahead))
  for _ in range(2):
    t0 = time.perf_counter()
    res = engine.generate(prompts, shape["num_samples"], SamplingParams(0.0), jax.random.key(0))
    wall = time.perf_counter() - t0
  return dict(wall_s=wall, tokens=[list(map(int, t)) for t in res.tokens])


def against_revision(args, shape: dict) -> dict:
  commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.against],
                          capture_output=True, text=True)
  if commit.returncode:
    sys.exit(f"--against {args.against!r} is not a revision of {REPO}: "
             f"{commit.stderr.strip()}")
  # `python -m` puts the working directory first on the module path: the tree's tlt_jax wins,
  # and this script's package comes from PYTHONPATH.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
  argv = [sys.executable, "-m", "experiments.bench_vs", "--against", args.against,
          "--out", os.devnull, *(["--quick"] if args.quick else []), "--child"]
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
        out = subprocess.run([*argv, str(tree)], cwd=tree, env=env, check=True,
                             capture_output=True, text=True).stdout
        runs[name].append(json.loads(out.strip().splitlines()[-1]))
        print(f"run {i + 1}/{args.repeats} {name:8s} wall {runs[name][-1]['wall_s']:6.2f}s",
              flush=True)
  import jax
  result = dict(rev=commit.stdout.strip(), device=jax.devices()[0].device_kind,
                backend=jax.default_backend(), repeats=args.repeats, **shape)
  for name, rs in runs.items():
    walls = [r["wall_s"] for r in rs]
    result[name] = dict(wall_s=walls, median_s=statistics.median(walls),
                        tokens=sum(len(t) for t in rs[0]["tokens"]))
  result["speedup"] = result["revision"]["median_s"] / result["current"]["median_s"]
  result["outputs_identical"] = all(r["tokens"] == runs["current"][0]["tokens"]
                                    for r in runs["revision"] + runs["current"])
  print(json.dumps({k: result[k] for k in ("rev", "speedup", "outputs_identical")}))
  return result


def plot(result: dict, plt):
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
  p.add_argument("--against", required=True, metavar="REV", help="a git revision")
  p.add_argument("--out", required=True, type=pathlib.Path, help="JSON; the PNG goes next to it")
  p.add_argument("--repeats", type=int, help="timed runs per tree (default 3; --quick 1)")
  p.add_argument("--quick", action="store_true", help="small run for smoke tests")
  p.add_argument("--child", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.against == "hf":
    sys.exit("the transformers peer is now `python -m experiments.profile_decode --peer`")
  shape = QUICK_SHAPE if args.quick else SHAPE
  if args.child:
    print(json.dumps(child(args.child, shape)))
    return
  args.repeats = args.repeats or (1 if args.quick else 3)
  result = against_revision(args, shape)
  from .common import pyplot, save_figure, write_json
  args.out.parent.mkdir(parents=True, exist_ok=True)
  write_json(args.out, result)
  save_figure(plot(result, pyplot()), args.out.with_suffix(".png"), dpi=120)
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
