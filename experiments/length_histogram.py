"""Response-length distribution of a policy's own samples on held-out problems.

Samples one completion per held-out problem of the built-in task at temperature 1.0 (what an RL
rollout does) and records its length in tokens. The point is the long tail: most responses end
early and a few run several times longer, which is what makes rollout wait on stragglers.

  python -m experiments.length_histogram --policy assets/tiny-policy --out results/lengths
  python -m experiments.length_histogram --policy assets/tiny-policy --out /tmp/lh --quick

Writes OUT/lengths.json (lengths, step counts, correctness, summary statistics; what
`experiments.simulate_cluster --lengths` reads) and OUT/length_histogram.png (log-scale
counts). The task's parameters are read from the policy's sft_summary.json when it has one
(the task it was trained on), else the config defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import jax
import numpy as np

from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import load_policy, load_tokenizer_for, make_engine, task_examples
from tlt_jax.config import base_config, with_current_keys
from tlt_jax.mesh import make_mesh
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.speculative.sampling import SamplingParams

from .common import pyplot, save_figure, write_json
from .rollout_model import length_summary

# The sampling: as an RL rollout samples (temperature 1.0, one sample per problem), 64 rows at
# a time, on 1024 held-out problems (--quick: 64).
SAMPLING = dict(temperature=1.0, max_new_tokens=256, seed=0)
BATCH, PROMPTS, QUICK_PROMPTS = 64, 1024, 64


def policy_config(policy: str):
  """A config for sampling from `policy` on the task it was trained on (its
  sft_summary.json's task section when it has one, else the defaults), without SD."""
  config = base_config()
  config.model.path, config.model.attention_impl = policy, "reference"
  config.rollout.speculative.enable = False
  config.rollout.max_batch, config.rollout.max_new_tokens = BATCH, SAMPLING["max_new_tokens"]
  summary = pathlib.Path(policy) / "sft_summary.json"
  if summary.is_file():
    task = json.loads(summary.read_text())["config"]["task"]
    config.task.update(with_current_keys("task", task))
  return config


def plot(lengths, stats: dict, path: pathlib.Path, title: str) -> None:
  fig, ax = pyplot().subplots(figsize=(6, 3.4), dpi=100)
  ax.hist(lengths, bins=np.arange(0, max(lengths) + 9, 8), color="#3b6ea5", edgecolor="white",
          linewidth=0.4)
  for name, style in (("median", "--"), ("p90", ":")):
    ax.axvline(stats[name], color="#c0392b", linestyle=style, linewidth=1,
               label=f"{name} {stats[name]:.0f}")
  ax.set(yscale="log", xlabel="response length (tokens)", ylabel="responses (log scale)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  save_figure(fig, path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--policy", required=True, help="Hugging Face folder of the policy")
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  parser.add_argument("--quick", action="store_true", help="64 prompts, for a smoke run")
  args = parser.parse_args()
  enable_compilation_cache()
  args.out.mkdir(parents=True, exist_ok=True)
  config = policy_config(args.policy)
  mesh = make_mesh({"fsdp": -1}, jax.devices()[:1])
  cfg, params = load_policy(config, mesh)
  tokenizer = load_tokenizer_for(config)
  engine = make_engine(config, cfg, params, mesh, tokenizer.eos_token_id,
                       tokenizer.pad_token_id or 0)
  examples = task_examples(config, QUICK_PROMPTS if args.quick else PROMPTS, eval_split=True)
  t0 = time.perf_counter()
  result = evaluate(engine, tokenizer, examples, SamplingParams(SAMPLING["temperature"]),
                    key=jax.random.key(SAMPLING["seed"]))
  seconds = time.perf_counter() - t0
  lengths, stats = result["lengths"], length_summary(result["lengths"])
  write_json(args.out / "lengths.json", {
      "policy": args.policy, **SAMPLING, "summary": stats, "accuracy": result["accuracy"],
      "finished_fraction": float(np.mean(result["finished"])),
      "sampling_s_incl_compile": seconds, "lengths": lengths,
      "num_ops": [e.metadata["num_ops"] for e in examples], "correct": result["correct"]})
  title = (f"{os.path.basename(os.path.normpath(args.policy))}: {stats['count']} samples at "
           f"T={SAMPLING['temperature']:g}; mean {stats['mean']:.0f}, max {stats['max']} tokens")
  plot(lengths, stats, args.out / "length_histogram.png", title)
  print(json.dumps({**stats, "accuracy": result["accuracy"], "seconds": round(seconds, 1)}))


if __name__ == "__main__":
  main()
