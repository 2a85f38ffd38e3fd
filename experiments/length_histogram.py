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
import time

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import (load_policy, load_tokenizer_for, make_engine,
                                task_examples)
from tlt_jax.config import base_config, with_current_keys
from tlt_jax.mesh import make_mesh
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.speculative.sampling import SamplingParams

from .common import write_json
from .rollout_model import length_summary


def policy_config(policy: str, batch_size: int, max_new_tokens: int):
  """A config for sampling from `policy` on the task it was trained on (its
  sft_summary.json's task section when it has one, else the defaults), without SD."""
  config = base_config()
  config.model.path, config.model.attention_impl = policy, "reference"
  config.rollout.speculative.enable = False
  config.rollout.max_batch, config.rollout.max_new_tokens = batch_size, max_new_tokens
  summary = os.path.join(policy, "sft_summary.json")
  if os.path.isfile(summary):
    with open(summary) as f:
      config.task.update(with_current_keys("task", json.load(f)["config"]["task"]))
  return config


def plot(lengths, stats: dict, path: str, title: str) -> None:
  fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
  ax.hist(lengths, bins=np.arange(0, max(lengths) + 9, 8), color="#3b6ea5", edgecolor="white",
          linewidth=0.4)
  for name, style in (("median", "--"), ("p90", ":")):
    ax.axvline(stats[name], color="#c0392b", linestyle=style, linewidth=1,
               label=f"{name} {stats[name]:.0f}")
  ax.set(yscale="log", xlabel="response length (tokens)", ylabel="responses (log scale)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--policy", required=True, help="Hugging Face folder of the policy")
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--quick", action="store_true", help="64 prompts, for a smoke run")
  parser.add_argument("--num-prompts", type=int, default=1024)
  parser.add_argument("--temperature", type=float, default=1.0)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  enable_compilation_cache()
  os.makedirs(args.out, exist_ok=True)
  config = policy_config(args.policy, args.batch_size, args.max_new_tokens)
  mesh = make_mesh({"fsdp": -1}, jax.devices()[:1])
  cfg, params = load_policy(config, mesh)
  tokenizer = load_tokenizer_for(config)
  engine = make_engine(config, cfg, params, mesh, tokenizer.eos_token_id,
                       tokenizer.pad_token_id or 0)
  examples = task_examples(config, 64 if args.quick else args.num_prompts, eval_split=True)
  t0 = time.perf_counter()
  result = evaluate(engine, tokenizer, examples, SamplingParams(args.temperature),
                    key=jax.random.key(args.seed))
  seconds = time.perf_counter() - t0
  lengths, stats = result["lengths"], length_summary(result["lengths"])
  write_json(os.path.join(args.out, "lengths.json"), {
      "policy": args.policy, "temperature": args.temperature,
      "max_new_tokens": args.max_new_tokens, "seed": args.seed, "summary": stats,
      "accuracy": result["accuracy"], "finished_fraction": float(np.mean(result["finished"])),
      "sampling_s_incl_compile": seconds, "lengths": lengths,
      "num_ops": [e.metadata["num_ops"] for e in examples], "correct": result["correct"]})
  title = (f"{os.path.basename(os.path.normpath(args.policy))}: {stats['count']} samples at "
           f"T={args.temperature:g}; mean {stats['mean']:.0f}, max {stats['max']} tokens")
  plot(lengths, stats, os.path.join(args.out, "length_histogram.png"), title)
  print(json.dumps({**stats, "accuracy": result["accuracy"], "seconds": round(seconds, 1)}))


if __name__ == "__main__":
  main()
