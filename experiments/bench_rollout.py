"""Benchmark: the rollout engine with plain decoding vs SD (fixed strategies, a fixed table,
the BEG-MAB tuner).

Same policy, same prompts, same drafter, measured side by side in one run. The drafter is
warmed on the policy's own generations (on prompts disjoint from the benchmark's), unless
--drafter-steps 0. Decoding is greedy by default so that every mode does exactly the same work
(identical outputs); --temperature samples instead.

  python -m experiments.bench_rollout --out results/rollout.json
  python -m experiments.bench_rollout --policy assets/tiny-policy --out results/rollout.json

JSON per mode: wall time, tokens/s, tail-phase tokens/s (running rows <= sd_threshold), mean
accept length, calls and iterations, host overhead (`busy_share`: the summed wall time of the
compiled calls over the rollout's wall time; the rest is host work between calls), executables
compiled and compile seconds, and tokens/s by active batch size
(`by_active`: calls grouped by running rows, power-of-two buckets); plus speedup_wall and
speedup_tail of the best SD mode (fastest tail) vs plain, and `tuner_comparison`: BEG-MAB
against the best and the worst fixed strategy and a fixed table (bigger trees for fewer rows),
by tail time. Every mode decodes plainly until the tail, so speedup_wall is bounded by the
tail's share of the plain rollout and carries that phase's run-to-run noise. The PNG shows
running rows and tokens/s over time; OUT_by_batch.png shows tokens/s by active batch size per
mode and the tuner comparison.

`iterations_per_call`: plain decoding again with each --sweep-iterations-per-call value N (at most N
decode steps per compiled call; N = 1 is one host round trip per token): the median wall time
of three timed rollouts, calls, device-busy share and whether the outputs are the plain mode's;
OUT_iterations_per_call.png plots the wall time against N. The engine's default N comes from this
sweep.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time


import jax
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tlt_jax.drafter_training.train_step import DrafterOptConfig
from tlt_jax.drafter_training.warmup import collect_samples, train_drafter
from tlt_jax.drafters import EagleDrafter
from tlt_jax.mesh import make_mesh
from tlt_jax.models.drafter import DrafterConfig, init_drafter_params
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
from tlt_jax.rl.tasks.arithmetic import ArithmeticTask
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, accept_length
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import BegMabTuner, FixedTuner, TableTuner

DEFAULT_POLICY = "assets/tiny-policy"


def load_problem(policy: str, num_prompts: int, offset: int):
  """(cfg, params, prompt id lists, eos id) for the policy folder and its built-in task."""
  cfg = load_hf_config(policy, attention_impl="reference")
  params = load_hf_params(policy, cfg)
  tok = load_tokenizer(policy)
  task = ArithmeticTask(seed=1234)  # held out from any training seed
  prompts = [prompt_ids(tok, ex.prompt) for ex in task.examples(num_prompts, start=offset)]
  return cfg, params, prompts, tok.eos_token_id


def summarize(result, threshold: int, compile_s: float, executables: int) -> dict:
  """One mode's numbers from its timed rollout (calls classified by their running rows at
  the start: the tail is <= threshold)."""
  steps = [r for r in result.timeline if r.mode != "prefill"]
  tail = [r for r in steps if r.active <= threshold]
  sd = [r for r in steps if r.mode == "sd"]
  tokens = int(sum(len(t) for t in result.tokens))
  tail_tokens = sum(r.emitted for r in tail)
  tail_s = sum(r.wall_s for r in tail)
  sd_iters, sd_s = int(sum(r.iterations for r in sd)), sum(r.wall_s for r in sd)
  by_active = {}
  for r in steps:
    b = 1 << max(0, (r.active - 1).bit_length())
    e, w = by_active.get(b, (0, 0.0))
    by_active[b] = (e + r.emitted, w + r.wall_s)
  return dict(wall_s=result.wall_s, tokens=tokens, tokens_per_s=tokens / result.wall_s,
              by_active={str(b): dict(tokens=e, seconds=w, tokens_per_s=e / w if w else None)
                         for b, (e, w) in sorted(by_active.items())},
              tail_tokens=tail_tokens, tail_s=tail_s, tail_calls=len(tail),
              tail_s_per_call=tail_s / len(tail) if tail else None,
              tail_tokens_per_s=tail_tokens / tail_s if tail_s else None,
              accept_len=accept_length(result), sd_calls=len(sd),
              sd_iterations=sd_iters, sd_iteration_s=sd_s / sd_iters if sd_iters else None,
              decode_calls=len(steps),
              decode_iterations=int(sum(r.iterations for r in steps)),
              call_s=result.call_s, host_s=result.host_s,
              # Host overhead: the share of the wall time the devices had work in flight.
              busy_share=result.call_s / result.wall_s,
              executables=executables, compile_s=compile_s,
              strategies_used=sorted({r.strategy for r in sd if r.strategy}),
              tail_plain_calls=sum(r.mode == "plain" for r in tail),
              timed_compiles=getattr(result, "timed_compiles", 0))


def run_mode(cfg, params, mesh, ec, drafters, tuner, prompts, samples, sp, key,
             warmups: int = 8):
  """Rollouts until two in a row compile nothing new (a tuner that explores may need a new
  program in a later rollout), then the timed one. Returns (timed result, compile seconds,
  executables); programs the timed rollout still compiled are in its wall time and counted
  as `timed_compiles` by summarize."""
  engine = RolloutEngine(cfg, params, mesh, ec, drafters=drafters, tuner=tuner)
  compiles, quiet = -1, 0
  for _ in range(warmups):
    first = engine.generate(prompts, samples, sp, key)
    quiet = quiet + 1 if first.pool["compiles"] == compiles else 0
    compiles = first.pool["compiles"]
    if quiet == 2:
      break
  result = engine.generate(prompts, samples, sp, key)
  result.timed_compiles = result.pool["compiles"] - first.pool["compiles"]
  return result, result.pool["compile_s"], result.pool["executables"]


def iterations_per_call_sweep(cfg, params, mesh, ec, prompts, samples, sp, key, values,
                         plain_tokens, repeats: int = 3) -> dict:
  """Plain decoding with at most N steps per compiled call, for each N in values: one warm
  rollout, then the median of `repeats` timed ones (a rollout here is about a second, so one
  alone is noisy)."""
  out = {}
  for n in values:
    engine = RolloutEngine(cfg, params, mesh, dataclasses.replace(ec, iterations_per_call=n))
    engine.generate(prompts, samples, sp, key)
    runs = sorted((engine.generate(prompts, samples, sp, key) for _ in range(repeats)),
                  key=lambda r: r.wall_s)
    res = runs[len(runs) // 2]
    out[str(n)] = dict(wall_s=res.wall_s, wall_s_runs=[r.wall_s for r in runs],
                       tokens_per_s=sum(map(len, res.tokens)) / res.wall_s,
                       decode_calls=sum(r.mode != "prefill" for r in res.timeline),
                       busy_share=res.call_s / res.wall_s,
                       outputs_identical_to_plain=all(r.tokens == plain_tokens for r in runs))
    print(f"plain, iterations_per_call {n:4d}: median wall {res.wall_s:6.2f}s  "
          f"calls {out[str(n)]['decode_calls']:5d}  busy {out[str(n)]['busy_share']:.0%}")
  first = out[str(values[0])]["wall_s"]
  for row in out.values():
    row["speedup_vs_first"] = first / row["wall_s"]
  return out


def plot_sweep(sweep: dict, path) -> None:
  n = [int(k) for k in sweep]
  fig, ax = plt.subplots(figsize=(5, 3.4))
  ax.plot(n, [sweep[str(k)]["wall_s"] for k in n], "o-")  # the medians
  for k in n:
    ax.plot([k] * len(sweep[str(k)]["wall_s_runs"]), sweep[str(k)]["wall_s_runs"], ".",
            color="gray", ms=4)
  ax.set_xscale("log", base=2)
  ax.set_xlabel("decode steps per compiled call, at most")
  ax.set_ylabel("plain rollout wall time (s)")
  ax.set_ylim(bottom=0)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def fixed_table(strategies: list[str], thresholds) -> list[Strategy]:
  """One strategy per bucket: the largest verify budget for the fewest running rows."""
  ordered = sorted((Strategy.parse(s) for s in strategies), key=lambda s: -s.verify_tokens)
  return [ordered[min(i, len(ordered) - 1)] for i in range(len(thresholds))]


def tuner_comparison(rows: dict) -> dict:
  """The tuners against the best and worst fixed strategy, by time in the tail phase.

  Strategies differ only there: before the tail every mode decodes plainly, the same work, so
  differences in whole-rollout wall time between SD modes are that phase's noise. Ratios are
  tail seconds of the other mode over BEG-MAB's (> 1: BEG-MAB is faster)."""
  fixed = {n: r for n, r in rows.items() if n.startswith("sd(")}
  best = min(fixed, key=lambda n: rows[n]["tail_s"])
  worst = max(fixed, key=lambda n: rows[n]["tail_s"])
  out = {"best_fixed": best, "worst_fixed": worst}
  for name in ("sd-beg_mab", "sd-table", best, worst, "plain"):
    out[name] = {"wall_s": rows[name]["wall_s"], "tail_s": rows[name]["tail_s"],
                 "accept_len": rows[name]["accept_len"]}
  base = rows["sd-beg_mab"]["tail_s"]
  # No tail (every row finished before SD would start): nothing to compare.
  for key, other in (("best_fixed", best), ("worst_fixed", worst), ("table", "sd-table")):
    out[f"beg_mab_vs_{key}"] = rows[other]["tail_s"] / base if base else None
  return out


def plot_by_batch(rows: dict, comparison: dict, path) -> None:
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
  for name, row in rows.items():
    buckets = sorted(row["by_active"], key=int)
    a.plot([int(k) for k in buckets], [row["by_active"][k]["tokens_per_s"] for k in buckets],
           "o-", label=name, ms=3)
  a.set_xscale("log", base=2)
  a.set_yscale("log")
  a.set_xlabel("running sequences on the slice (bucket)")
  a.set_ylabel("tokens/s")
  a.legend(fontsize=7)
  names = ["sd-beg_mab", "sd-table", comparison["best_fixed"], comparison["worst_fixed"],
           "plain"]
  labels = ["BEG-MAB", "table", f"best {comparison['best_fixed']}",
            f"worst {comparison['worst_fixed']}", "plain"]
  b.bar(range(len(names)), [comparison[n]["tail_s"] for n in names], color="#3b6ea5")
  b.set_xticks(range(len(names)), labels, fontsize=7, rotation=15)
  b.set_ylabel("seconds in the tail (running rows <= threshold)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot(runs: dict, path, threshold):
  fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
  for name, res in runs.items():
    steps = [r for r in res.timeline if r.mode != "prefill"]
    t = [r.t_end_s for r in steps]
    ax1.step(t, [r.active for r in steps], where="post", label=name)
    ax2.plot(t, [r.emitted / r.wall_s for r in steps], ".", ms=3, label=name)
  ax1.axhline(threshold, color="k", lw=0.6, ls="--")
  ax1.set_ylabel("running sequences")
  ax2.set_ylabel("tokens/s per call")
  ax2.set_yscale("log")
  ax2.set_xlabel("seconds since rollout start")
  ax1.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--policy", default=DEFAULT_POLICY)
  parser.add_argument("--num-prompts", type=int, default=96)
  parser.add_argument("--num-samples", type=int, default=1)
  parser.add_argument("--max-new-tokens", type=int, default=256)
  parser.add_argument("--max-batch", type=int, default=64)
  parser.add_argument("--sd-threshold", type=int, default=4)
  parser.add_argument("--iterations-per-call", "--steps-per-call", type=int,
                      default=EngineConfig.iterations_per_call)
  parser.add_argument("--sweep-iterations-per-call", "--sweep-steps-per-call", type=int,
                      nargs="+",
                      default=[1, 4, 16, 32, 128])
  parser.add_argument("--strategies", nargs="+", default=["4,2,8", "3,2,6", "6,2,12"])
  parser.add_argument("--temperature", type=float, default=0.0)
  parser.add_argument("--drafter-steps", type=int, default=400)
  parser.add_argument("--drafter-prompts", type=int, default=256)
  parser.add_argument("--quick", action="store_true", help="small run for smoke tests")
  args = parser.parse_args()
  if args.quick:
    args.num_prompts, args.num_samples, args.max_new_tokens = 4, 2, 48
    args.max_batch, args.strategies, args.drafter_steps, args.drafter_prompts = 8, ["3,2,6"], 20, 8
    args.sweep_iterations_per_call = [1, 32]
  if not os.path.isdir(args.policy):
    sys.exit(f"policy folder {args.policy!r} not found; make it with the SFT command in the "
             f"README or pass --policy DIR")

  cfg, params, prompts, eos = load_problem(args.policy, args.num_prompts, offset=0)
  _, _, train_prompts, _ = load_problem(args.policy, args.drafter_prompts, offset=10_000)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  longest = max(len(p) for p in prompts + train_prompts)
  ec = EngineConfig(max_batch=args.max_batch, max_prompt_len=longest,
                    max_new_tokens=args.max_new_tokens, sd_threshold=args.sd_threshold,
                    iterations_per_call=args.iterations_per_call, eos_id=eos)
  sp = SamplingParams(args.temperature)
  key = jax.random.key(0)

  # ---------------------------------------------------------------- drafter warm-up
  dcfg = DrafterConfig()
  dparams = init_drafter_params(cfg, dcfg, jax.random.key(1))
  warm = {}
  if args.drafter_steps:
    plain_engine = RolloutEngine(cfg, params, mesh, ec)
    gen = plain_engine.generate(train_prompts, 1, SamplingParams(1.0), jax.random.key(2))
    samples = collect_samples(params, cfg, train_prompts, gen.tokens)
    t0 = time.perf_counter()
    trained, hist = train_drafter({"eagle": dparams}, params, samples, cfg, {"eagle": dcfg},
                                  DrafterOptConfig(learning_rate=1e-3, lr_warmup_steps=20),
                                  args.drafter_steps, window=256, batch_rows=8)
    dparams = trained["eagle"]
    warm = dict(steps=args.drafter_steps, seconds=time.perf_counter() - t0,
                loss_first=hist[0]["loss"], loss_last=hist[-1]["loss"],
                top1_last=float(np.mean([h["top1"] for h in hist[-20:]])),
                tokens=int(sum(len(s.tokens) for s in samples)))

  # ---------------------------------------------------------------- modes, side by side
  drafter = {"eagle": EagleDrafter(dparams, dcfg)}
  modes = {"plain": (None, None)}
  for s in args.strategies:
    modes[f"sd{Strategy.parse(s).as_tuple()}"] = (drafter, FixedTuner(Strategy.parse(s)))
  thresholds = (1, 2, 5)
  modes["sd-beg_mab"] = (drafter, BegMabTuner(
      thresholds=thresholds, arms=[[Strategy.parse(s) for s in args.strategies]] * 3, seed=0,
      plain_arm=True))
  modes["sd-table"] = (drafter, TableTuner(thresholds, fixed_table(args.strategies, thresholds)))
  rows, runs = {}, {}
  for name, (d, tuner) in modes.items():
    res, compile_s, exes = run_mode(cfg, params, mesh, ec, d, tuner, prompts,
                                    args.num_samples, sp, key)
    rows[name] = summarize(res, args.sd_threshold, compile_s, exes)
    runs[name] = res
    print(f"{name:14s} wall {res.wall_s:6.2f}s  tail tok/s "
          f"{rows[name]['tail_tokens_per_s'] or 0:8.1f}  accept {rows[name]['accept_len']}  "
          f"device busy {rows[name]['busy_share']:.0%} of the wall time")
  plain_tokens = runs["plain"].tokens
  sweep = iterations_per_call_sweep(cfg, params, mesh, ec, prompts, args.num_samples, sp, key,
                               args.sweep_iterations_per_call, plain_tokens)
  lossless = {n: r.tokens == plain_tokens for n, r in runs.items()}
  plain = rows["plain"]
  # The best SD mode is the fastest in the tail, where the modes differ (see tuner_comparison),
  # among those that ran SD there: a tuner that learnt to decode the tail plainly is plain.
  sd_names = [n for n in rows if n != "plain" and rows[n]["sd_calls"]] or \
      [n for n in rows if n != "plain"]
  best = min(sd_names, key=lambda n: rows[n]["tail_s"])
  result = dict(
      device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
      policy=args.policy, layers=cfg.num_layers, hidden=cfg.hidden_size,
      prompts=args.num_prompts, samples=args.num_samples, max_new_tokens=args.max_new_tokens,
      sd_threshold=args.sd_threshold, iterations_per_call=args.iterations_per_call,
      temperature=args.temperature, drafter_warmup=warm,
      response_len=dict(mean=float(np.mean(runs["plain"].lengths)),
                        max=int(np.max(runs["plain"].lengths))),
      modes=rows, outputs_identical_to_plain=lossless, best_sd_mode=best,
      speedup_wall=plain["wall_s"] / rows[best]["wall_s"],
      speedup_tail=(rows[best]["tail_tokens_per_s"] / plain["tail_tokens_per_s"]
                    if plain["tail_tokens_per_s"] and rows[best]["tail_tokens_per_s"] else None),
      tuner_comparison=tuner_comparison(rows), iterations_per_call_sweep=sweep)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2))
  plot({"plain": runs["plain"], best: runs[best]}, args.out.with_suffix(".png"),
       args.sd_threshold)
  plot_by_batch(rows, result["tuner_comparison"],
                args.out.with_name(args.out.stem + "_by_batch.png"))
  plot_sweep(sweep, args.out.with_name(args.out.stem + "_iterations_per_call.png"))
  print(json.dumps({k: result[k] for k in ("best_sd_mode", "speedup_wall", "speedup_tail")}))


if __name__ == "__main__":
  main()
