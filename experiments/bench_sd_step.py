"""Benchmark: one speculative-decoding iteration against one plain decode step.

For each batch size, greedy generation of the same prompts with plain decoding and with SD for
every (drafter, strategy), measured side by side in one run. Reports per configuration: mean
accept length (tokens per SD iteration), the cost of an SD iteration relative to a plain
step, and the resulting decode speedup (tokens/s ratio). Writes JSON and a PNG.

  python -m experiments.bench_sd_step --out results/sd_step.json
  python -m experiments.bench_sd_step --policy assets/tiny-policy --out results/sd_step.json

With --shared-shape S,K,T each strategy of top-k K also runs inside the program shaped for
(S, K, T) (`rollout.speculative.shared_max_batch`: one program per batch bucket serves every
arm), side by side with its own program: `padding_cost` is what sharing costs per iteration,
timed as the engine runs them (many iterations in one `decode_loop` call, the two programs
alternating).

Drafters: `oracle` (an exact copy of the policy: the accept-length upper bound, at the
policy's cost) and `random` (an untrained 1-layer EAGLE drafter: the lower bound).
Without --policy the model is the random tiny default of configs/default.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time


import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from configs.default import get_config
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.components import model_config
from tlt_jax.drafters import EagleDrafter
from tlt_jax.models import ModelConfig, Policy, init_cache, init_params
from tlt_jax.models.drafter import (DrafterConfig, drafter_from_policy,
                                    init_drafter_params)
from tlt_jax.models.hf import load_hf_config, load_hf_params
from tlt_jax.speculative.decoding import decode_loop, plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

GREEDY = SamplingParams(temperature=0.0)


def load_policy(path: str | None) -> tuple[ModelConfig, dict]:
  """The HF policy at `path`, or the random model of configs/default.py."""
  if path:
    cfg = load_hf_config(path, attention_impl="reference")
    return cfg, load_hf_params(path, cfg)
  cfg = model_config(get_config()).replace(attention_impl="reference")
  return cfg, init_params(cfg, jax.random.key(0))


def _timed_loop(step, state, max_iters):
  """Runs `step(state) -> (state, stats)` until all rows are done; per-iteration wall times
  (after blocking) and accepted counts of the rows active in that iteration."""
  times, accepted = [], []
  for _ in range(max_iters):
    if bool(state.done.all()):
      break
    active = ~np.asarray(state.done)
    t0 = time.perf_counter()
    state, stats = step(state)
    jax.block_until_ready(state.num_out)
    times.append(time.perf_counter() - t0)
    accepted.append(float(np.asarray(stats.accepted)[active].mean()))
  return state, times, accepted


def bench(cfg, params, drafters, strategies, batch, prompt_len, new_tokens, seed=0,
          shared: Strategy | None = None):
  rng = np.random.default_rng(seed)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  cap = prompt_len + new_tokens + max(s.depth for s in [*strategies, shared] if s) + 2
  rows = []

  policy = Policy(params, cfg)

  def begin(drafters=None):
    states = {n: d.init_state(cfg, batch, cap) for n, d in (drafters or {}).items()}
    return jax.jit(functools.partial(start, sp=GREEDY, max_new_tokens=new_tokens, eos_id=-1))(
        policy, prompts, lengths, init_cache(cfg, batch, cap), jax.random.key(seed),
        drafters=drafters, draft_states={n: st for n, st in states.items() if st is not None})

  plain = jax.jit(functools.partial(plain_step, sp=GREEDY, eos_id=-1))
  plain_state, plain_times, _ = _timed_loop(lambda s: plain(policy, s, jax.random.key(1)),
                                            begin(), new_tokens)
  plain_step_s = statistics.median(plain_times[1:])  # the first call compiles
  reference = np.asarray(plain_state.out)
  for name, (dcfg, dparams) in drafters.items():
    both = {"eagle": EagleDrafter(dparams, dcfg)}
    for strategy in strategies:
      shapes = [strategy]
      if shared is not None and shared.topk == strategy.topk:
        shapes.append(shared)
      own = None
      for shape in shapes:
        limits = (None if shape == strategy else
                  jnp.asarray([strategy.depth, strategy.verify_tokens], jnp.int32))
        sd = jax.jit(functools.partial(sd_step, sp=GREEDY, eos_id=-1, strategy=shape))
        state, times, accepted = _timed_loop(
            lambda s: sd(policy, both, s, jax.random.key(1), limits=limits),
            begin(both), new_tokens)
        sd_iter_s = statistics.median(times[1:]) if len(times) > 1 else times[0]
        accept_len = float(np.mean(accepted))
        row = dict(
            batch=batch, drafter=name, strategy=strategy.as_tuple(),
            program=shape.as_tuple(), accept_len=accept_len,
            iterations=len(times), plain_step_s=plain_step_s, sd_iter_s=sd_iter_s,
            iter_cost_ratio=sd_iter_s / plain_step_s,
            decode_speedup=accept_len * plain_step_s / sd_iter_s,
            outputs_match_plain=bool(np.array_equal(np.asarray(state.out), reference)))
        if own is None:
          own = row
        else:  # the same tree, so the same tokens and accept length: only the time differs
          row["accept_len_matches_own"] = accept_len == own["accept_len"]
          own["loop_iter_s"], row["loop_iter_s"] = _loop_iteration_seconds(
              policy, both, begin(both), strategy, shape, new_tokens)
          row["padding_cost"] = row["loop_iter_s"] / own["loop_iter_s"]
        rows.append(row)
  return rows


def _loop_iteration_seconds(policy, drafters, state, strategy, shape, iterations, repeats=7):
  """Seconds per SD iteration of `strategy` in its own program and in `shape`'s, as the
  engine runs them: `iterations` in one `decode_loop` call, the two programs alternating from
  the same state, the median of `repeats` calls each (per-call timings of a tiny model are
  mostly dispatch noise)."""
  limits = jnp.asarray([strategy.depth, strategy.verify_tokens], jnp.int32)
  loops = [(jax.jit(functools.partial(decode_loop, sp=GREEDY, eos_id=-1, strategy=s)), lim)
           for s, lim in ((strategy, None), (shape, limits))]
  key, one, most = jax.random.key(1), jnp.int32(1), jnp.int32(iterations)
  per_iter = [[], []]
  for r in range(repeats + 1):  # the first round compiles
    for i, (loop, lim) in enumerate(loops):
      t0 = time.perf_counter()
      _, _, done = loop(policy, drafters, state, key, one, most, limits=lim)
      done = int(done)
      if r:
        per_iter[i].append((time.perf_counter() - t0) / max(done, 1))
  return statistics.median(per_iter[0]), statistics.median(per_iter[1])


def plot(rows, path):
  """Decode speedup per (batch, drafter, strategy) in its own program; with shared-shape rows,
  a second panel with their padding cost per batch size."""
  own = [r for r in rows if "padding_cost" not in r]
  padded = [r for r in rows if "padding_cost" in r]
  fig, axes = plt.subplots(1, 2 if padded else 1, figsize=(13 if padded else 8, 4.2),
                           squeeze=False)
  ax = axes[0, 0]
  labels = [f"b{r['batch']} {r['drafter']} {tuple(r['strategy'])}" for r in own]
  ax.bar(range(len(own)), [r["decode_speedup"] for r in own],
         color=["tab:green" if r["drafter"] == "oracle" else "tab:gray" for r in own])
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(range(len(own)), labels, fontsize=7, rotation=90)
  ax.set_ylabel("decode speedup vs plain (x)")
  ax.set_title("SD iteration: accept length / relative iteration cost", fontsize=10)
  if padded:
    ax = axes[0, 1]
    batches = sorted({r["batch"] for r in padded})
    series = list(dict.fromkeys((r["drafter"], tuple(r["strategy"])) for r in padded))
    width = 0.8 / len(series)
    for i, (drafter, strategy) in enumerate(series):
      cost = {r["batch"]: r["padding_cost"] for r in padded
              if (r["drafter"], tuple(r["strategy"])) == (drafter, strategy)}
      ax.bar([b + (i - (len(series) - 1) / 2) * width for b in range(len(batches))],
             [cost.get(b, np.nan) for b in batches], width,
             label=f"{drafter} {strategy}", hatch="" if drafter == "oracle" else "//")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    ax.set_ylabel("iteration time, shared / own program (x)")
    ax.set_ylim(0, 1.3 * max(r["padding_cost"] for r in padded))
    ax.set_title(f"padding cost in the program shaped for {tuple(padded[0]['program'])}",
                 fontsize=10)
    ax.legend(fontsize=7, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path)
  parser.add_argument("--policy", default=None, help="local HF folder (default: random tiny)")
  parser.add_argument("--strategies", nargs="+", default=["8,4,48", "4,2,8"])
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--shared-shape", default=None, metavar="S,K,T",
                      help="also run each strategy of top-k K in the program shaped for "
                           "(S, K, T), as shared programs do")
  parser.add_argument("--quick", action="store_true", help="small run for smoke tests")
  args = parser.parse_args()
  enable_compilation_cache()
  if args.quick:
    args.strategies, args.batches, args.new_tokens = ["3,2,6"], [2], 12
  shared = Strategy.parse(args.shared_shape) if args.shared_shape else None

  cfg, params = load_policy(args.policy)
  strategies = [Strategy.parse(s) for s in args.strategies]
  drafters = {"oracle": drafter_from_policy(cfg, params),
              "random": (DrafterConfig(), init_drafter_params(cfg, DrafterConfig(),
                                                              jax.random.key(1)))}
  rows = []
  for batch in tqdm(args.batches, desc="batch sizes"):
    rows += bench(cfg, params, drafters, strategies, batch, args.prompt_len, args.new_tokens,
                  shared=shared)
  result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(),
                policy=args.policy or "random tiny default", layers=cfg.num_layers,
                hidden=cfg.hidden_size, vocab=cfg.vocab_size, new_tokens=args.new_tokens,
                rows=rows)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(result, indent=2))
  plot(rows, args.out.with_suffix(".png"))
  for r in rows:
    padded = (f" in {tuple(r['program'])} ({r['padding_cost']:.2f}x its own program)"
              if "padding_cost" in r else "")
    print(f"batch {r['batch']:3d} {r['drafter']:7s} {tuple(r['strategy'])}{padded}: accept "
          f"{r['accept_len']:.2f}, iteration {r['iter_cost_ratio']:.2f}x a plain step, "
          f"speedup {r['decode_speedup']:.2f}x, outputs match plain: "
          f"{r['outputs_match_plain']}")


if __name__ == "__main__":
  main()
