"""Benchmark: the rollout engine with plain decoding against SD, per strategy and tuner, in
GRPO-shaped rollouts of one config's policy, drafters and task (--config FILE[:variant],
--set KEY=VALUE).

A rollout is what an RL step samples: --prompts held-out prompts x --samples responses at
--temperature (defaults: the config's), on the config's mesh, SD once rollout.sd_threshold
rows or fewer run on a slice. Modes, side by side: plain; sd(S) per --strategies S (default
the config's arms; EAGLE, the suffix drafter, their hybrid 'eagle+suffix'); sd-beg_mab and
sd-table (a fixed table: the largest tree for the fewest rows), per --tuners. Every mode
decodes the same requests with the same key (--seed), so its tokens are plain decoding's at
any temperature, which is checked. Each mode runs untimed first, to compile its programs
(BEG-MAB, which explores, until a rollout compiles nothing new), then once timed.

  python -m experiments.bench_rollout --out results/rollout/rollout.json      # configs/default.py
  python -m experiments.bench_rollout --quick --out /tmp/rollout.json

JSON (docs/reproducing.md lists it): per mode (`modes`) wall and tail seconds (the tail:
calls that start with at most sd_threshold rows running), tokens/s, accept length, calls,
host overhead (`busy_share`), compiles, tokens/s by running rows (`by_active`),
`identical_to_plain`, `speedup_wall` and `speedup_tail`; `best_sd_mode`; `tuner_comparison`;
`hybrid_vs_eagle`; with --sweep-iterations-per-call N ..., `iterations_per_call_sweep` (plain
decoding at each N decode steps per compiled call, the median of three rollouts). PNGs: OUT.png
(running rows and tokens/s per call over time), OUT_by_batch.png (tokens/s by running rows,
tail seconds per mode), OUT_iterations_per_call.png (the sweep).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pathlib
import sys

import jax

from .common import (add_config_flags, config_or_exit, pyplot, run_metadata, save_figure,
                     strategy_label, write_json)
from tlt_jax.cli import setup_devices
from tlt_jax.components import (load_drafters_for, load_policy, load_tokenizer_for,
                                make_engine, make_tuner_from_config, sampling_params,
                                task_prompts)
from tlt_jax.config import ConfigError
from tlt_jax.drafters import drafters_named
from tlt_jax.mesh import make_mesh
from tlt_jax.rollout.engine import accept_length
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import BegMabTuner, FixedTuner

TUNERS = ("beg_mab", "table")
plt = pyplot()


def mode_name(strategy: Strategy) -> str:
  return f"sd({strategy_label(strategy)})"


def summarize(result, threshold: int, timed_compiles: int = 0) -> dict:
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
              executables=result.pool["executables"], compile_s=result.pool["compile_s"],
              strategies_used=sorted({r.strategy for r in sd if r.strategy}),
              tail_plain_calls=sum(r.mode == "plain" for r in tail),
              timed_compiles=timed_compiles)


def timed_rollout(engine, prompts, samples, sp, key, settle: bool, warmups: int = 8):
  """Untimed rollouts that compile the mode's programs (one; with `settle`, for a tuner that
  explores and so may need a program in a later rollout, until two in a row compile nothing
  new), then the timed one. Returns (its result, programs it still compiled: in its wall
  time)."""
  compiles = engine.generate(prompts, samples, sp, key).pool["compiles"]
  quiet = 0
  for _ in range(warmups - 1 if settle else 0):
    before, compiles = compiles, engine.generate(prompts, samples, sp, key).pool["compiles"]
    quiet = quiet + 1 if compiles == before else 0
    if quiet == 2:
      break
  result = engine.generate(prompts, samples, sp, key)
  return result, result.pool["compiles"] - compiles


def fixed_table(strategies: list[Strategy], thresholds) -> list[Strategy]:
  """One strategy per bucket: the largest verify budget for the fewest running rows."""
  ordered = sorted(strategies, key=lambda s: -s.verify_tokens)
  return [ordered[min(i, len(ordered) - 1)] for i in range(len(thresholds))]


def tuner(config, kind: str, strategies: list[Strategy]):
  """The config's tuner of `kind` choosing among `strategies` (the table: `fixed_table`)."""
  c = copy.deepcopy(config)
  sd = c.rollout.speculative
  sd.tuner = kind
  chosen = strategies if kind != "table" else fixed_table(strategies, sd.bucket_thresholds)
  sd.arms = tuple(strategy_label(s) for s in chosen)
  return make_tuner_from_config(c)


def tuner_comparison(rows: dict) -> dict:
  """The tuners against the best and worst fixed strategy, by time in the tail phase.

  Strategies differ only there: before the tail every mode decodes plainly, the same work, so
  differences in whole-rollout wall time between SD modes are that phase's noise. Ratios are
  tail seconds of the other mode over BEG-MAB's (> 1: BEG-MAB is faster)."""
  fixed = {n: r for n, r in rows.items() if n.startswith("sd(")}
  best = min(fixed, key=lambda n: rows[n]["tail_s"])
  worst = max(fixed, key=lambda n: rows[n]["tail_s"])
  others = [("best_fixed", best), ("worst_fixed", worst)]
  if "sd-table" in rows:
    others.append(("table", "sd-table"))
  out = {"best_fixed": best, "worst_fixed": worst}
  for name in ("sd-beg_mab", *[n for _, n in others], "plain"):
    out[name] = {"wall_s": rows[name]["wall_s"], "tail_s": rows[name]["tail_s"],
                 "accept_len": rows[name]["accept_len"]}
  base = rows["sd-beg_mab"]["tail_s"]
  # No tail (every row finished before SD would start): nothing to compare.
  for key, other in others:
    out[f"beg_mab_vs_{key}"] = rows[other]["tail_s"] / base if base else None
  return out


def hybrid_vs_eagle(rows: dict, strategies: list[Strategy]) -> dict:
  """Per strategy that drafts with EAGLE and others, whose EAGLE-alone strategy (same depth,
  topk and verify tokens) also ran: its accept length and tail seconds over EAGLE's."""
  out = {}
  for s in strategies:
    eagle = mode_name(Strategy(s.depth, s.topk, s.verify_tokens))
    if "eagle" not in s.drafts or len(s.drafts) < 2 or eagle not in rows:
      continue
    mine, theirs = rows[mode_name(s)], rows[eagle]
    out[strategy_label(s)] = dict(
        accept_len=(mine["accept_len"] or 1) / (theirs["accept_len"] or 1),
        tail_s=mine["tail_s"] / theirs["tail_s"] if theirs["tail_s"] else None)
  return out


def iterations_per_call_sweep(make, prompts, samples, sp, key, values, plain_tokens,
                              repeats: int = 3) -> dict:
  """Plain decoding with at most N steps per compiled call, for each N in values (make(N):
  the engine): one warm rollout, then the median of `repeats` timed ones (a small model's
  rollout takes about a second, so one alone is noisy)."""
  out = {}
  for n in values:
    engine = make(n)
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
          f"calls {out[str(n)]['decode_calls']:5d}  busy {out[str(n)]['busy_share']:.0%}",
          flush=True)
  first = out[str(values[0])]["wall_s"]
  for row in out.values():
    row["speedup_vs_first"] = first / row["wall_s"]
  return out


# ---------------------------------------------------------------- figures


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
  save_figure(fig, path, dpi=110)


def plot_by_batch(rows: dict, path) -> None:
  """Tokens/s by running rows per mode (left); each mode's tail seconds, its accept length
  on the bar (right; blue: EAGLE alone, orange: suffix alone, green: a hybrid, gray: plain
  and the tuners)."""
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 3.8))
  for name, row in rows.items():
    buckets = sorted(row["by_active"], key=int)
    a.plot([int(k) for k in buckets], [row["by_active"][k]["tokens_per_s"] for k in buckets],
           "o-", label=name, ms=3)
  a.set_xscale("log", base=2)
  a.set_yscale("log")
  a.set_xlabel("running sequences on the slice (bucket)")
  a.set_ylabel("tokens/s")
  a.legend(fontsize=7)
  names = list(rows)
  colors = ["#888888" if not n.startswith("sd(") else "#3b6ea5" if "suffix" not in n else
            "#c2703d" if "eagle" not in n else "#5a9e52" for n in names]
  b.bar(range(len(names)), [rows[n]["tail_s"] for n in names], color=colors)
  for i, n in enumerate(names):
    if rows[n]["accept_len"]:
      b.text(i, rows[n]["tail_s"], f"{rows[n]['accept_len']:.2f}", ha="center", va="bottom",
             fontsize=7)
  b.set_xticks(range(len(names)), names, fontsize=7, rotation=25, ha="right")
  b.set_ylabel("seconds in the tail (accept length on the bars)")
  save_figure(fig, path, dpi=110)


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
  save_figure(fig, path, dpi=120)


# ---------------------------------------------------------------- main


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, type=pathlib.Path,
                 help="JSON path; the PNGs go next to it")
  add_config_flags(p)
  p.add_argument("--strategies", nargs="+", default=None,
                 help="'depth,topk,verify[,drafts]' each (default: the config's arms)")
  p.add_argument("--tuners", nargs="*", choices=TUNERS, default=list(TUNERS),
                 help="tuners choosing among the strategies (none: fixed strategies only)")
  p.add_argument("--prompts", type=int, default=0,
                 help="held-out prompts per rollout (0: the config's rl.prompts_per_step)")
  p.add_argument("--samples", type=int, default=0,
                 help="responses per prompt (0: the config's rl.num_samples)")
  p.add_argument("--temperature", type=float, default=None,
                 help="sampling temperature (default: the config's rollout.temperature; "
                      "0: greedy)")
  p.add_argument("--seed", type=int, default=None,
                 help="the rollouts' key (default: the config's seed)")
  p.add_argument("--sweep-iterations-per-call", type=int, nargs="*", default=[], metavar="N",
                 help="also time plain decoding at each of these rollout.iterations_per_call")
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 2 prompts, 48 new tokens, the config's first arm unless "
                      "--strategies")
  args = p.parse_args(argv)
  for s in args.strategies or []:
    try:
      Strategy.parse(s)
    except ValueError as e:
      p.error(f"--strategies {s!r}: {e}")
  if args.prompts < 0 or args.samples < 0 or any(n < 1 for n in args.sweep_iterations_per_call):
    p.error("--prompts and --samples must be >= 0, --sweep-iterations-per-call values >= 1")
  return args


def main(argv=None):
  args = parse_args(argv)
  config = config_or_exit(args.config, args.set)
  if args.quick:
    config.rollout.max_new_tokens = min(config.rollout.max_new_tokens, 48)
    args.prompts = args.prompts or 2
    # Two batch sizes, the full batch and the SD threshold's: the fewest programs that still
    # decode plainly and then with SD (any ladder gives the same tokens).
    config.rollout.batch_sizes = (max(1, min(config.rollout.sd_threshold,
                                             config.rollout.max_batch)),)
  setup_devices(config)
  arms = [Strategy.parse(s) for s in args.strategies or config.rollout.speculative.arms]
  strategies = arms[:1] if args.quick and not args.strategies else arms
  try:
    mesh = make_mesh(dict(config.mesh.axes))
    tok = load_tokenizer_for(config)
    cfg, params = load_policy(config, mesh)
    drafters = load_drafters_for(config, cfg, names=drafters_named(strategies))
    _, prompts = task_prompts(config, tok, args.prompts or config.rl.prompts_per_step,
                              eval_split=True)
    tuners = {f"sd-{kind}": tuner(config, kind, strategies) for kind in args.tuners}
  except (ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")
  samples, sp = args.samples or config.rl.num_samples, sampling_params(config)
  if args.temperature is not None:
    sp = dataclasses.replace(sp, temperature=args.temperature)
  threshold = config.rollout.sd_threshold
  key = jax.random.key(config.seed if args.seed is None else args.seed)
  eos, pad = tok.eos_token_id, tok.pad_token_id or 0

  def engine(mode_tuner=None, **overrides):
    # compile_ahead off: every tail call runs SD with the mode's strategies, as measured.
    return make_engine(config, cfg, params, mesh, eos, pad,
                       drafters=drafters if mode_tuner else None,
                       speculative=mode_tuner is not None, tuner=mode_tuner,
                       compile_ahead=False, **overrides)

  modes = {"plain": None, **{mode_name(s): FixedTuner(s) for s in strategies}, **tuners}
  rows, runs = {}, {}
  for name, t in modes.items():
    result, compiles = timed_rollout(engine(t), prompts, samples, sp, key,
                                     settle=isinstance(t, BegMabTuner))
    rows[name], runs[name] = summarize(result, threshold, compiles), result
    row = rows[name]
    row["identical_to_plain"] = result.tokens == runs["plain"].tokens
    row["speedup_wall"] = rows["plain"]["wall_s"] / row["wall_s"]
    row["speedup_tail"] = rows["plain"]["tail_s"] / row["tail_s"] if row["tail_s"] else None
    print(f"{name:26s} wall {row['wall_s']:6.2f} s  tail {row['tail_s']:6.2f} s  accept "
          f"{row['accept_len'] or 0:.2f}  busy {row['busy_share']:.0%}  identical "
          f"{row['identical_to_plain']}", flush=True)

  # The best SD mode is the fastest in the tail, where the modes differ (see tuner_comparison),
  # among those that ran SD there: a tuner that learnt to decode the tail plainly is plain.
  sd_names = [n for n in rows if n != "plain" and rows[n]["sd_calls"]] or \
      [n for n in rows if n != "plain"]
  best = min(sd_names, key=lambda n: rows[n]["tail_s"]) if sd_names else None
  result = {**run_metadata(), "config": args.config, "sets": args.set,
            "policy": str(config.model.path), "drafter": str(config.drafter.eagle.path),
            "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "prompts": len(prompts), "samples": samples, "seed": int(config.seed if args.seed
                                                                    is None else args.seed),
            "temperature": sp.temperature, "max_new_tokens": config.rollout.max_new_tokens,
            "max_batch": config.rollout.max_batch, "sd_threshold": threshold,
            "iterations_per_call": config.rollout.iterations_per_call,
            "slices": int(mesh.shape["replica"]),
            "response_lengths": [len(t) for t in runs["plain"].tokens],
            "modes": rows, "identical_to_plain": all(r["identical_to_plain"]
                                                     for r in rows.values()),
            "best_sd_mode": best,
            "speedup_wall": rows[best]["speedup_wall"] if best else None,
            "speedup_tail": rows[best]["speedup_tail"] if best else None,
            "hybrid_vs_eagle": hybrid_vs_eagle(rows, strategies)}
  if "sd-beg_mab" in rows and strategies:
    result["tuner_comparison"] = tuner_comparison(rows)
  if args.sweep_iterations_per_call:
    result["iterations_per_call_sweep"] = iterations_per_call_sweep(
        lambda n: engine(iterations_per_call=n), prompts, samples, sp, key,
        args.sweep_iterations_per_call, runs["plain"].tokens)
  out = args.out
  out.parent.mkdir(parents=True, exist_ok=True)
  write_json(out, result)
  plot({n: runs[n] for n in ("plain", best) if n}, out.with_suffix(".png"), threshold)
  plot_by_batch(rows, out.with_name(out.stem + "_by_batch.png"))
  if args.sweep_iterations_per_call:
    plot_sweep(result["iterations_per_call_sweep"],
               out.with_name(out.stem + "_iterations_per_call.png"))
  for name, r in result["hybrid_vs_eagle"].items():
    print(f"{name} over EAGLE alone: accept length {r['accept_len']:.2f}x, tail time "
          f"{r['tail_s'] or 0:.2f}x")
  print(f"best SD mode {best}: {result['speedup_wall'] or 0:.2f}x the plain rollout, "
        f"{result['speedup_tail'] or 0:.2f}x its tail; wrote {out} and its PNGs")


if __name__ == "__main__":
  main()
