"""What SD accepts in the long tail, measured on the policy's own held-out responses at the
run's temperature, without decoding them again (`tlt_jax.speculative.teacher_forced`).

  python -m experiments.tail_accept --config configs/smollm2.py:headline_cpu --out results/tail
  python -m experiments.tail_accept --quick --out /tmp/tail          # the tiny default (CI)

The policy answers held-out problems once (cached in OUT/responses.jsonl, or a GPU lease's
with --responses), grouped into RL steps; each response is walked from where its step's
running rows fall to rollout.sd_threshold, every SD iteration credited to the running-row
bucket it starts in (docs/results/tail_accept/README.md). Per drafter and strategy: the accept
length per bucket and over the tail, in OUT/tail_accept.{json,png}.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time
import types

import numpy as np

from .common import (REPO, add_config_flags, config_or_exit, pyplot, run_stamp, save_figure,
                     strategies_or_exit, strategy_label, write_json)
from tlt_jax.speculative.tuner import bucket_of, describe_bucket

BUCKETS = (1, 2, 9, 33)  # running-row buckets: 1, 2-8, 9-32, 33 and more


def running_rows(lengths: np.ndarray) -> np.ndarray:
  """[max length] rows still decoding at each response position of one step (plain
  decoding's schedule): running[j] = responses longer than j + 1 tokens (a response of L
  tokens decodes positions 0 .. L-2 after the prefill's first token)."""
  return np.asarray([(lengths > j + 1).sum() for j in range(int(lengths.max()))], np.int64)


def tail_starts(lengths: np.ndarray, threshold: int) -> np.ndarray:
  """Per response of one step, the position from which it decodes with SD: the first where
  `threshold` rows or fewer run (its length, i.e. never, when it ends before)."""
  low = np.nonzero(running_rows(lengths) <= threshold)[0]
  return np.minimum(int(low[0]) if low.size else int(lengths.max()), lengths)


def credit(walk, running: np.ndarray, thresholds) -> dict[int, list[int]]:
  """The walk's accepted counts by the running-row bucket each iteration starts in."""
  out: dict[int, list[int]] = {}
  for j, a in walk:
    rows = int(running[min(j, len(running) - 1)])
    out.setdefault(bucket_of(thresholds, max(rows, 1)), []).append(a)
  return out


def summarise(by_bucket: dict[int, list[int]], thresholds) -> dict:
  """Accept length per bucket and over all of them (the tail), with iteration counts."""
  every = [a for v in by_bucket.values() for a in v]
  return {"tail": float(np.mean(every)) if every else None, "iterations": len(every),
          "buckets": {describe_bucket(thresholds, b): {"accept": float(np.mean(v)),
                                                   "iterations": len(v)}
                      for b, v in sorted(by_bucket.items())}}


def _responses(config, out: pathlib.Path, prompts: int, given: pathlib.Path | None):
  """(prompt ids, response ids, rewards or None) of every held-out request, in request order
  (prompt-major): read from `given`, or generated once and cached in OUT/responses.jsonl."""
  from tlt_jax.drafter_training.warmup import cached_responses, read_responses
  rewards = None
  if given is None:
    from tlt_jax.components import (load_policy, load_tokenizer_for, make_engine,
                                    reward_from_config, task_prompts)
    from tlt_jax.mesh import make_mesh
    samples, tokenizer = config.rl.num_samples, load_tokenizer_for(config)
    mesh = make_mesh(dict(config.mesh.axes))
    examples, ids = task_prompts(config, tokenizer, prompts, eval_split=True)
    engine = make_engine(config, *load_policy(config, mesh), mesh, tokenizer.eos_token_id,
                         tokenizer.pad_token_id or 0, speculative=False)
    job = types.SimpleNamespace(say=lambda m: print(m, flush=True), writer=True)
    made_by = {"model.path": config.model.path, "model.dtype": config.model.dtype,
               "max_new_tokens": config.rollout.max_new_tokens, "task": config.task.to_dict()}
    completions = cached_responses(engine, ids, samples, config.rollout.temperature,
                                   config.seed, str(out / "responses.jsonl"), job, made_by)
    engine.close()
    repeated = [ex for ex in examples for _ in range(samples)]
    rewards = list(reward_from_config(config)(
        [ex.prompt for ex in repeated],
        [tokenizer.decode(c, skip_special_tokens=True) for c in completions],
        answer=[ex.answer for ex in repeated], metadata=[ex.metadata for ex in repeated]))
  try:
    return (*read_responses(str(given or out / "responses.jsonl")), rewards)
  except ValueError as e:
    sys.exit(f"--responses: {e}")


def _variants(config, cfg, labelled: list[str]) -> dict[str, dict]:
  """label -> name -> drafter: the config's drafters, with EAGLE from each --drafter
  LABEL=PATH (the config's drafter.eagle.path when none is given)."""
  from tlt_jax.components import drafter_settings
  from tlt_jax.drafters import DRAFTERS, make_drafter
  from tlt_jax.drafters.io import load_drafter
  weightless = {name: make_drafter(name, drafter_settings(config, name))
                for name, cls in DRAFTERS.items() if not cls.trained}
  out = {}
  for label, path in [item.split("=", 1) for item in labelled] or [
      ["config", config.drafter.eagle.path]]:
    if not path:
      sys.exit(f"--drafter {label}=: give the path of an EAGLE export")
    try:
      _, settings, params = load_drafter(path, cfg, expect="eagle")
    except (OSError, ValueError) as e:
      sys.exit(f"--drafter {label}={path}: {e}")
    out[label] = {**weightless, "eagle": make_drafter("eagle", settings, params)}
  return out


def tail_work(lengths: np.ndarray, per_step: int, threshold: int, bulk_rows: int,
              bulk_every: int) -> list[tuple[int, int, np.ndarray]]:
  """(response, position its SD starts at, its step's running rows) of each response that
  reaches the tail, RL step by step; of those that end while `bulk_rows` or more rows run
  (they decode only where many rows do: their iterations are many and alike), every
  `bulk_every`-th."""
  work = []
  for s in range(0, len(lengths), per_step):
    step = np.arange(s, min(s + per_step, len(lengths)))
    running = running_rows(lengths[step])
    for n, (i, first) in enumerate(zip(step, tail_starts(lengths[step], threshold))):
      in_bulk_only = running[min(max(lengths[i] - 2, 0), len(running) - 1)] >= bulk_rows
      if first < lengths[i] - 1 and not (in_bulk_only and n % bulk_every):
        work.append((int(i), int(first), running))
  return work


def measure(config, out: pathlib.Path, prompts: int, strategies: list, labelled: list[str],
            given: pathlib.Path | None = None, thresholds=BUCKETS, bulk_every: int = 1) -> dict:
  """Runs the measurement (see the module docstring); returns what tail_accept.json holds."""
  import jax
  from tqdm import tqdm
  from tlt_jax.components import load_policy
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models.policy import Policy
  from tlt_jax.speculative.teacher_forced import response_depths
  t0 = time.perf_counter()
  out.mkdir(parents=True, exist_ok=True)
  prompt_ids, responses, rewards = _responses(config, out, prompts, given)
  lengths = np.asarray([len(r) for r in responses])
  samples, threshold = config.rl.num_samples, config.rollout.sd_threshold
  per_step = config.rl.prompts_per_step * samples
  mesh = make_mesh(dict(config.mesh.axes))
  cfg, params = load_policy(config, mesh)
  policy = Policy(jax.device_put(params, mesh.devices.flat[0]), cfg)
  width = -(-(config.rollout.max_prompt_len + config.rollout.max_new_tokens) // 64) * 64
  work = tail_work(lengths, per_step, threshold, thresholds[-1], bulk_every)
  total = sum(int(lengths[i]) - first for i, first, _ in work)
  results = {}
  for label, drafters in _variants(config, cfg, labelled).items():
    results[label] = {}
    for strategy in strategies:
      by_bucket: dict[int, list[int]] = {}
      bar = tqdm(total=total, desc=f"{label} {strategy_label(strategy)}", unit="position")
      t = time.perf_counter()
      for i, first, running in work:
        group = [responses[g] for g in range(i - i % samples, i - i % samples + samples)
                 if g != i]  # the other responses to its prompt
        depths = response_depths(policy, drafters, strategy, prompt_ids[i], responses[i],
                                 group, width=width, first=first)
        for b, v in credit(depths.walk(first), running, thresholds).items():
          by_bucket.setdefault(b, []).extend(v)
        bar.update(int(lengths[i]) - first)
      bar.close()
      results[label][strategy_label(strategy)] = {**summarise(by_bucket, thresholds),
                                                  "seconds": time.perf_counter() - t}
  return {
      "what": "SD accept length in the tail on held-out responses, teacher-forced "
              "(experiments/tail_accept.py)",
      **run_stamp(), "config": config.to_dict().get("task"),
      "model": config.model.path, "dtype": config.model.dtype,
      "temperature": config.rollout.temperature, "sd_threshold": threshold,
      "step_responses": per_step, "bulk_every": bulk_every,
      "buckets": [describe_bucket(thresholds, b) for b in range(len(thresholds))],
      "responses": {"count": len(responses), "mean": float(lengths.mean()),
                    "median": float(np.median(lengths)),
                    "p90": float(np.percentile(lengths, 90)), "max": int(lengths.max()),
                    "at_limit": int((lengths >= config.rollout.max_new_tokens).sum()),
                    "reward_mean": float(np.mean(rewards)) if rewards else None,
                    "in_tail": len(work)},
      "variants": results, "seconds": time.perf_counter() - t0}


def plot(result: dict, path: pathlib.Path) -> None:
  """Accept length per running-row bucket, one group of bars per strategy and variant."""
  plt = pyplot()
  rows = [(label, s, r) for label, v in result["variants"].items() for s, r in v.items()]
  buckets = result["buckets"]
  fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(rows)), 3.8), dpi=100)
  width = 0.8 / (len(buckets) + 1)
  for k, name in enumerate(buckets + ["tail"]):
    values = [(r["tail"] if name == "tail" else r["buckets"].get(name, {}).get("accept")) or 0
              for _, _, r in rows]
    ax.bar(np.arange(len(rows)) + k * width, values, width, label=f"{name} rows"
           if name != "tail" else f"tail (<= {result['sd_threshold']} rows)")
  ax.set_xticks(np.arange(len(rows)) + width * len(buckets) / 2,
                [f"{label}\n{s}" for label, s, _ in rows], fontsize=7)
  ax.set_ylabel("tokens per SD iteration")
  ax.set_title(f"accept length by running rows, T={result['temperature']}, "
               f"{result['responses']['in_tail']} responses in the tail", fontsize=9)
  ax.legend(fontsize=7)
  save_figure(fig, path)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_config_flags(parser, str(REPO / "configs" / "smollm2.py") + ":headline_cpu")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--prompts", type=int, default=32, help="held-out problems")
  parser.add_argument("--responses", type=pathlib.Path,
                      help="responses to read instead of generating: a responses.jsonl, or a "
                           "GPU lease's responses.jsonl.xz")
  parser.add_argument("--drafter", action="append", default=[], metavar="LABEL=PATH",
                      help="an EAGLE export to measure (repeatable)")
  parser.add_argument("--strategies", nargs="+", help="default: the config's arms")
  parser.add_argument("--bulk-every", type=int, default=1, metavar="K",
                      help="of the responses that end while 33 or more rows run, measure "
                           "every K-th")
  parser.add_argument("--quick", action="store_true",
                      help="configs/default.py's tiny policy, 8 problems (CI)")
  args = parser.parse_args(argv)
  if args.out.exists() and not args.out.is_dir():
    sys.exit(f"--out {args.out} is a file; give a folder")
  # Quick: the tiny default, 8 problems x 4 samples of 48 tokens, SD for the last 8 rows.
  quick = ["rollout.max_new_tokens=48", "rl.prompts_per_step=4", "rl.num_samples=4",
           "rollout.sd_threshold=8"] if args.quick else []
  config = config_or_exit(str(REPO / "configs" / "default.py") if args.quick else args.config,
                          ["mesh.num_cpu_devices=1", "mesh.axes.replica=1", *quick, *args.set])
  from tlt_jax.cli import setup_devices
  setup_devices(config)
  result = measure(config, args.out, 8 if args.quick else args.prompts,
                   strategies_or_exit(args.strategies, config), args.drafter, args.responses,
                   bulk_every=args.bulk_every)
  write_json(args.out / "tail_accept.json", result)
  plot(result, args.out / "tail_accept.png")
  r = result["responses"]
  print(f"{r['count']} responses (mean {r['mean']:.0f} tokens, {r['at_limit']} at the limit, "
        f"reward {r['reward_mean']}); {r['in_tail']} reach the tail (<= "
        f"{result['sd_threshold']} rows)")
  for label, v in result["variants"].items():
    for s, r in v.items():
      cells = " ".join(f"{k}:{b['accept']:.2f}" for k, b in r["buckets"].items())
      print(f"{label:>12} {s:>24}  tail {r['tail'] or 0:.2f}  {cells}")
  print(f"wrote {args.out / 'tail_accept.json'}")


if __name__ == "__main__":
  main()
