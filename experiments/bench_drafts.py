"""Benchmark: EAGLE alone, suffix alone and their hybrid, per strategy, on one config's policy,
drafter and task: accept length and tail decode time in GRPO-shaped rollouts, and what one SD
iteration of each costs.

A rollout here is what a GRPO step samples: `--prompts` held-out prompts x the config's
`rl.num_samples` responses at the rollout temperature, on one device, SD for the last
`--sd-threshold` running rows. The suffix drafter copies from the rows of its batch and from
its group's siblings that finished first (the engine's corpus). Every mode decodes the same
requests with the same key, so their tokens are identical to plain decoding (checked); each
mode runs once to compile and once timed.

  python -m experiments.bench_drafts --out results/drafts/drafts.json
  python -m experiments.bench_drafts --config configs/smollm2.py \
      --set drafter.eagle.path=runs/smollm2_cpu/warmup/export/eagle \
      --out results/drafts_smollm2/drafts.json

JSON: settings; per mode (plain and each strategy) bench_rollout.py's summary of the timed
rollout (wall and tail seconds, tail tokens/s, accept length, SD iterations and seconds per SD
iteration, ...), and whether the tokens are plain decoding's; `iteration`: seconds per SD
iteration of each strategy in one decode call at each --iteration-batches size, timed from
the same state and alternating (medians);
`hybrid_vs_eagle`: per (depth, topk, verify) with both, the hybrid's accept length and
iteration time over EAGLE's. The PNG shows accept length and tail time per strategy.
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

from .bench_rollout import summarize
from tlt_jax.cli import config_from_file
from tlt_jax.config import ConfigError
from tlt_jax.components import (load_drafters_for, load_policy, load_tokenizer_for,
                                make_engine, sampling_params, task_prompts)
from tlt_jax.drafters import drafters_named
from tlt_jax.mesh import make_mesh
from tlt_jax.models import Policy, init_cache
from tlt_jax.speculative.decoding import decode_loop, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import FixedTuner

REPO = pathlib.Path(__file__).resolve().parents[1]
GREEDY = SamplingParams(0.0)  # the timed iterations' sampling
DEFAULT_STRATEGIES = ["6,2,12", "6,1,7,suffix", "6,2,12,eagle+suffix",
                      "4,2,8", "4,1,5,suffix", "4,2,8,eagle+suffix"]


def label(s: Strategy | None) -> str:
  return "plain" if s is None else ",".join(map(str, s.as_tuple()))


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, help="JSON path; the PNG goes next to it")
  p.add_argument("--config", default=str(REPO / "configs" / "default.py"))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override, e.g. --set drafter.eagle.path=DIR (repeatable)")
  p.add_argument("--strategies", nargs="+", default=DEFAULT_STRATEGIES,
                 help="'steps,topk,verify[,drafts]' each, drafts eagle | suffix | eagle+suffix")
  p.add_argument("--prompts", type=int, default=16, help="held-out prompts per rollout")
  p.add_argument("--max-new-tokens", type=int, default=0, help="0: the config's")
  p.add_argument("--sd-threshold", type=int, default=0, help="0: the config's")
  p.add_argument("--iteration-batches", type=int, nargs="+", default=[1, 4])
  p.add_argument("--iterations", type=int, default=24, help="SD iterations per timed call")
  p.add_argument("--repeats", type=int, default=5, help="timed calls per strategy and batch")
  p.add_argument("--quick", action="store_true", help="smoke setting (under a minute)")
  args = p.parse_args(argv)
  if args.quick:
    args.strategies = ["4,2,8", "4,2,8,eagle+suffix"]  # suffix alone: the engine's tests
    args.prompts, args.max_new_tokens, args.iterations, args.repeats = 2, 48, 4, 2
    args.iteration_batches, args.sd_threshold = [1], 8
  for s in args.strategies:
    try:
      Strategy.parse(s)
    except ValueError as e:
      p.error(f"--strategies {s!r}: {e}")
  return args


def iteration_seconds(cfg, params, drafters, strategies, prompts, corpus_rows, batch: int,
                      iterations: int, repeats: int, max_new: int) -> dict:
  """Seconds per SD iteration of each strategy at `batch` rows: one `decode_loop` call of
  `iterations` from the same freshly prefilled state, the strategies alternating, the median
  of `repeats` calls each. The suffix drafter's corpus is `corpus_rows` random responses per
  row (its matching costs the same whatever they hold). With fewer prompts than rows the
  prompts repeat."""
  policy = Policy(params, cfg)
  rows = [prompts[i % len(prompts)] for i in range(batch)]
  width = max(len(p) for p in rows)
  toks = np.zeros((batch, width), np.int32)
  for i, p in enumerate(rows):
    toks[i, :len(p)] = p
  lengths = jnp.asarray([len(p) for p in rows], jnp.int32)
  cap = -(-(width + max_new + 16) // 64) * 64
  states = {n: d.init_state(cfg, batch, cap) for n, d in drafters.items()}
  state = jax.jit(functools.partial(start, sp=GREEDY, max_new_tokens=max_new, eos_id=-1))(
      policy, jnp.asarray(toks), lengths, init_cache(cfg, batch, cap), jax.random.key(0),
      drafters=drafters, draft_states={n: s for n, s in states.items() if s is not None})
  corpus = jax.random.randint(jax.random.key(1), (batch, corpus_rows, max_new), 0,
                              cfg.vocab_size)
  loops = {label(s): jax.jit(functools.partial(decode_loop, sp=GREEDY, eos_id=-1, strategy=s))
           for s in strategies}
  one, most, key = jnp.int32(1), jnp.int32(iterations), jax.random.key(2)
  times = {name: [] for name in loops}
  for r in range(repeats + 1):  # the first round compiles
    for name, loop in loops.items():
      t0 = time.perf_counter()
      _, _, done = loop(policy, drafters, state, key, one, most, corpus=corpus)
      done = int(done)
      if r:
        times[name].append((time.perf_counter() - t0) / max(done, 1))
  return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
  args = parse_args(argv)
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  try:
    config = config_from_file(args.config, args.set)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  strategies = [Strategy.parse(s) for s in args.strategies]
  max_new = args.max_new_tokens or config.rollout.max_new_tokens
  threshold = args.sd_threshold or config.rollout.sd_threshold
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  tokenizer = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  drafters = load_drafters_for(config, cfg, names=drafters_named(strategies))
  eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
  _, prompts = task_prompts(config, tokenizer, args.prompts, eval_split=True)
  samples, sp = config.rl.num_samples, sampling_params(config)
  key = jax.random.key(config.seed)

  modes, runs = {}, {}
  for strategy in [None, *strategies]:
    engine = make_engine(config, cfg, params, mesh, eos, pad, drafters=drafters,
                         speculative=strategy is not None,
                         tuner=FixedTuner(strategy) if strategy else None,
                         sd_threshold=threshold, max_new_tokens=max_new,
                         compile_ahead=False)  # every tail call SD: what is measured
    engine.generate(prompts, samples, sp, key)  # compiles
    runs[label(strategy)] = result = engine.generate(prompts, samples, sp, key)
    modes[label(strategy)] = summarize(result, threshold, result.pool["compile_s"],
                                       result.pool["executables"])
    m = modes[label(strategy)]
    print(f"{label(strategy):22s} tail {m['tail_s']:6.2f} s  accept {m['accept_len'] or 1:.2f}"
          f"  wall {m['wall_s']:6.2f} s", flush=True)
  plain = runs["plain"].tokens
  for name, m in modes.items():
    m["identical_to_plain"] = runs[name].tokens == plain
    m["tail_speedup"] = (modes["plain"]["tail_s"] / m["tail_s"]) if m["tail_s"] else None

  iteration = {}
  for b in args.iteration_batches:
    iteration[str(b)] = iteration_seconds(cfg, params, drafters, strategies, prompts,
                                          config.rollout.speculative.corpus_rows, b,
                                          args.iterations, args.repeats, max_new)
    print(f"batch {b}: " + ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in
                                     iteration[str(b)].items()), flush=True)

  hybrid_vs_eagle = {}
  for s in strategies:
    if s.drafts != ("eagle", "suffix"):
      continue
    eagle = label(Strategy(s.depth, s.topk, s.verify_tokens))
    if eagle not in modes:
      continue
    hybrid_vs_eagle[label(s)] = dict(
        accept_len=(modes[label(s)]["accept_len"] or 1) / (modes[eagle]["accept_len"] or 1),
        tail_s=(modes[label(s)]["tail_s"] / modes[eagle]["tail_s"]
                if modes[eagle]["tail_s"] else None),
        iteration_s={b: t[label(s)] / t[eagle] for b, t in iteration.items()})
  settings = {k: v for k, v in vars(args).items() if k != "out"}
  settings.update(samples=samples, temperature=sp.temperature, max_new_tokens=max_new,
                  sd_threshold=threshold, policy=str(config.model.path),
                  drafter=str(config.drafter.eagle.path), device=jax.devices()[0].device_kind,
                  date=time.strftime("%Y-%m-%d"))
  out.write_text(json.dumps({"settings": settings, "modes": modes, "iteration": iteration,
                             "hybrid_vs_eagle": hybrid_vs_eagle}, indent=2))
  plot(modes, iteration, out.with_suffix(".png"))
  for name, r in hybrid_vs_eagle.items():
    print(f"{name} over EAGLE alone: accept length {r['accept_len']:.2f}x, tail time "
          f"{r['tail_s'] or 0:.2f}x, iteration " + ", ".join(
              f"batch {b} {v:.2f}x" for b, v in r["iteration_s"].items()))
  print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(modes: dict, iteration: dict, path) -> None:
  """Accept length, tail seconds and seconds per SD iteration per strategy."""
  names = [n for n in modes if n != "plain"]
  colors = ["#3b6ea5" if "suffix" not in n else "#c2703d" if "eagle" not in n else "#5a9e52"
            for n in names]
  fig, (a, b, c) = plt.subplots(1, 3, figsize=(13, 3.8))
  x = np.arange(len(names))
  a.bar(x, [modes[n]["accept_len"] or 1 for n in names], color=colors)
  a.set_ylabel("accept length (tokens per row per SD iteration)")
  b.bar(x, [modes[n]["tail_s"] for n in names], color=colors)
  b.axhline(modes["plain"]["tail_s"], color="k", lw=0.8, ls="--", label="plain")
  b.set_ylabel("seconds in the tail")
  b.legend(fontsize=8)
  width = 0.8 / max(len(iteration), 1)
  for i, (batch, times) in enumerate(iteration.items()):
    c.bar(x + i * width, [times[n] * 1e3 for n in names], width, label=f"batch {batch}")
  c.set_ylabel("ms per SD iteration")
  c.legend(fontsize=8)
  for ax in (a, b, c):
    ax.set_xticks(x + (width * (len(iteration) - 1) / 2 if ax is c else 0), names, rotation=30,
                  ha="right", fontsize=7)
  fig.suptitle("blue: EAGLE alone, orange: suffix alone, green: hybrid", fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  main()
