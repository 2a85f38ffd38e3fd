"""Benchmark: the rollout engine with plain decoding against SD, per strategy and tuner, in
GRPO-shaped rollouts of one config's policy, drafters and task.

  python -m experiments.bench_rollout --out results/rollout/rollout.json      # configs/default.py
  python -m experiments.bench_rollout --quick --out /tmp/rollout.json

Modes (docs/reproducing.md): plain, sd(S) per --strategies S, sd-beg_mab and sd-table per
--tuners; each decodes the same requests with the same key, so its tokens are plain decoding's
at any temperature, which is checked. The tail: calls that start with at most
rollout.sd_threshold rows running.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import pathlib
import sys

import jax

from .common import (add_config_flags, config_or_exit, pyplot, run_metadata, save_figure,
                     strategies_or_exit, strategy_label, write_json)
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
              sd_iterations=int(sum(r.iterations for r in sd)), decode_calls=len(steps),
              call_s=result.call_s, host_s=result.host_s,
              # Host overhead: the share of the wall time the devices had work in flight.
              busy_share=result.call_s / result.wall_s,
              executables=result.pool["executables"], compile_s=result.pool["compile_s"],
              strategies_used=sorted({r.strategy for r in sd if r.strategy}),
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


def tuner(config, kind: str, strategies: list[Strategy]):
  """The config's tuner of `kind` choosing among `strategies`; the table holds one per bucket,
  the largest verify budget for the fewest running rows."""
  c = copy.deepcopy(config)
  sd = c.rollout.speculative
  sd.tuner = kind
  if kind == "table":
    ordered = sorted(strategies, key=lambda s: -s.verify_tokens)
    strategies = [ordered[min(i, len(ordered) - 1)] for i in range(len(sd.bucket_thresholds))]
  sd.arms = tuple(strategy_label(s) for s in strategies)
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
    out[name] = {k: rows[name][k] for k in ("wall_s", "tail_s", "accept_len")}
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
  a.set(xlabel="running sequences on the slice (bucket)", ylabel="tokens/s")
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
  p.add_argument("--quick", action="store_true",
                 help="smoke run: 2 prompts, 48 new tokens, the config's first arm unless "
                      "--strategies")
  args = p.parse_args(argv)
  if args.prompts < 0 or args.samples < 0:
    p.error("--prompts and --samples must be >= 0")
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
  strategies = strategies_or_exit(args.strategies, config)
  strategies = strategies[:1] if args.quick and not args.strategies else strategies
  seed = config.seed if args.seed is None else args.seed
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
  key = jax.random.key(seed)

  modes = {"plain": None, **{mode_name(s): FixedTuner(s) for s in strategies}, **tuners}
  rows, plain = {}, None
  for name, t in modes.items():
    # compile_ahead off: every tail call runs SD with the mode's strategies, as measured.
    engine = make_engine(config, cfg, params, mesh, tok.eos_token_id, tok.pad_token_id or 0,
                         drafters=drafters if t else None, speculative=t is not None, tuner=t,
                         compile_ahead=False)
    result, compiles = timed_rollout(engine, prompts, samples, sp, key,
                                     settle=isinstance(t, BegMabTuner))
    row = rows[name] = summarize(result, threshold, compiles)
    plain = plain or result.tokens  # plain decoding's: it runs first
    row["identical_to_plain"] = result.tokens == plain
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
            "layers": cfg.num_layers, "hidden": cfg.hidden_size, "prompts": len(prompts),
            "samples": samples, "seed": int(seed), "temperature": sp.temperature,
            "max_new_tokens": config.rollout.max_new_tokens,
            "max_batch": config.rollout.max_batch, "sd_threshold": threshold,
            "iterations_per_call": config.rollout.iterations_per_call,
            "slices": int(mesh.shape["replica"]),
            "response_lengths": [len(t) for t in plain], "modes": rows,
            "identical_to_plain": all(r["identical_to_plain"] for r in rows.values()),
            "best_sd_mode": best,
            "speedup_wall": rows[best]["speedup_wall"] if best else None,
            "speedup_tail": rows[best]["speedup_tail"] if best else None,
            "hybrid_vs_eagle": hybrid_vs_eagle(rows, strategies)}
  if "sd-beg_mab" in rows and strategies:
    result["tuner_comparison"] = tuner_comparison(rows)
  out = args.out
  out.parent.mkdir(parents=True, exist_ok=True)
  write_json(out, result)
  fig = out.with_name(out.stem + "_by_batch.png")
  plot_by_batch(rows, fig)
  for name, r in result["hybrid_vs_eagle"].items():
    print(f"{name} over EAGLE alone: accept length {r['accept_len']:.2f}x, tail time "
          f"{r['tail_s'] or 0:.2f}x")
  print(f"best SD mode {best}: {result['speedup_wall'] or 0:.2f}x the plain rollout, "
        f"{result['speedup_tail'] or 0:.2f}x its tail; wrote {out} and {fig}")


if __name__ == "__main__":
  main()
