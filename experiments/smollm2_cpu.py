"""A real model on CPU: SmolLM2-135M-Instruct (configs/smollm2.py), where TLT's regime begins.

  python -m experiments.smollm2_cpu --out runs/smollm2_cpu
  python -m experiments.smollm2_cpu --out /tmp/sm --quick      # configs/smollm2.py:runlocal
  python -m experiments.smollm2_cpu --out runs/smollm2_cpu --stages decode rollout

Stages (each a subprocess; its output streams to the console and OUT/logs/STAGE.log; a stage
that finished is recorded in OUT/stages.json and skipped when the command is run again):
  decode   the policy's decode step (float32, scanned layers, the rollout's cache size) at
           each batch size of --batches: median of --iters steps -> OUT/decode.json
  warmup   python -m tlt_jax.warmup_drafter: the EAGLE drafter on the model's own responses
           -> OUT/warmup/export/eagle
  rollout  one long-tailed batch (--rollout-prompts problems x the config's samples, the
           config's temperature and one key) decoded plainly and with SD under each fixed
           strategy of the config's arms and under BEG-MAB: tokens checked identical to the
           plain rollout's; whole-rollout and tail seconds (calls with at most
           rollout.sd_threshold rows running), accept length -> OUT/rollout.json
  rl       experiments/rl_runs.py: GRPO baseline and TLT back to back -> OUT/rl
Every rollout mode runs once untimed (its compiles) and once timed, with the same key.

OUT/smollm2_cpu.json: device, date, commit, the stages' commands and seconds, and the
headline numbers of each stage; OUT/smollm2_cpu.png: the decode step against batch size, the
rollout's whole and tail seconds per mode, and the RL runs' reward and step time per step.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .common import REPO, module_command
from .gpu_e2e import run_recorded_stages

STAGES = ("decode", "warmup", "rollout", "rl")
CONFIG = str(REPO / "configs" / "smollm2.py")


def _read(path: pathlib.Path) -> dict:
  return json.loads(path.read_text()) if path.is_file() else {}


def _config(quick: bool, sets: list[str]):
  """configs/smollm2.py (:runlocal when quick) with --set overrides, devices set up."""
  from tlt_jax.cli import config_from_file, setup_devices
  config = config_from_file(CONFIG + (":runlocal" if quick else ""), sets)
  setup_devices(config)
  return config


# ---------------------------------------------------------------- decode


def decode_stage(out: pathlib.Path, quick: bool, sets: list[str], batches: list[int],
                 iters: int) -> None:
  """Median decode-step milliseconds per batch size, with a cache as long as the rollout's
  (prompt of max_prompt_len tokens already in it)."""
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from tlt_jax.components import load_policy
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models import decode, init_cache, prefill

  config = _config(quick, sets)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  cfg, params = load_policy(config, mesh)
  prompt_len = config.rollout.max_prompt_len
  slots = prompt_len + config.rollout.max_new_tokens
  pre = jax.jit(functools.partial(prefill, cfg=cfg, fresh=True))
  step = jax.jit(functools.partial(decode, cfg=cfg), donate_argnums=(2,))
  rows = []
  for b in batches:
    tokens = jnp.asarray(np.random.default_rng(b).integers(0, cfg.vocab_size, (b, prompt_len)),
                         jnp.int32)
    lengths = jnp.full((b,), prompt_len, jnp.int32)
    _, _, cache = pre(params, tokens, lengths, init_cache(cfg, b, slots))
    nxt = tokens[:, -1]
    times = []
    for i in range(iters + 2):
      t0 = time.perf_counter()
      logits, _, cache = step(params, nxt, cache)
      jax.block_until_ready(logits)
      times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times[2:])
    rows.append({"batch": b, "step_ms": ms, "tokens_per_s": 1e3 * b / ms})
    print(f"batch {b:3d}: decode step {ms:7.1f} ms, {1e3 * b / ms:7.1f} tokens/s", flush=True)
    (out / "decode.json").write_text(json.dumps(
        {"model": config.model.path, "dtype": cfg.dtype, "scan_layers": True,
         "cache_slots": slots, "iters": iters, "rows": rows}, indent=2))


# ---------------------------------------------------------------- rollout


def rollout_stage(out: pathlib.Path, quick: bool, sets: list[str], num_prompts: int) -> None:
  """Plain decoding against SD per fixed strategy and BEG-MAB on one batch, same key."""
  import jax

  from .bench_rollout import summarize
  from tlt_jax.components import (load_drafters_for, load_policy, load_tokenizer_for,
                                  make_engine, make_tuner_from_config, sampling_params,
                                  task_prompts)
  from tlt_jax.mesh import make_mesh
  from tlt_jax.speculative.tuner import FixedTuner

  warmed = out / "warmup" / "export" / "eagle"
  config = _config(quick, sets + [f"drafter.eagle.path={warmed}"])
  mesh = make_mesh(dict(config.mesh.axes))
  tok = load_tokenizer_for(config)
  cfg, params = load_policy(config, mesh)
  drafters = load_drafters_for(config, cfg)
  # Held-out problems: another stream than the warm-up's training prompts.
  _, prompts = task_prompts(config, tok, num_prompts, eval_split=True)
  sp = sampling_params(config)
  key = jax.random.key(7)
  threshold = config.rollout.sd_threshold
  eos, pad = tok.eos_token_id, tok.pad_token_id or 0
  modes = {"plain": dict(speculative=False)}
  for arm in config.rollout.speculative.arms:
    modes[f"sd({arm})"] = dict(speculative=True, tuner=FixedTuner(arm))
  modes["sd-beg_mab"] = dict(speculative=True, tuner=make_tuner_from_config(config))
  rows, plain_tokens = {}, None
  for name, kw in modes.items():
    engine = make_engine(config, cfg, params, mesh, eos, pad,
                         drafters=drafters if kw["speculative"] else None, compile_ahead=False,
                         **kw)
    first = engine.generate(prompts, config.rl.num_samples, sp, key)
    result = engine.generate(prompts, config.rl.num_samples, sp, key)
    result.timed_compiles = result.pool["compiles"] - first.pool["compiles"]
    row = summarize(result, threshold, result.pool["compile_s"], result.pool["executables"])
    if plain_tokens is None:
      plain_tokens = result.tokens
    row["identical_to_plain"] = result.tokens == plain_tokens
    row["lengths"] = [len(t) for t in result.tokens]
    rows[name] = row
    print(f"{name:16s} wall {row['wall_s']:6.1f} s  tail {row['tail_s']:6.1f} s  accept "
          f"{row['accept_len'] or 0:.2f}  identical {row['identical_to_plain']}", flush=True)
  plain = rows["plain"]
  for row in rows.values():
    row["speedup_wall"] = plain["wall_s"] / row["wall_s"]
    row["speedup_tail"] = plain["tail_s"] / row["tail_s"] if row["tail_s"] else None
  (out / "rollout.json").write_text(json.dumps(
      {"num_prompts": num_prompts, "num_samples": config.rl.num_samples,
       "temperature": sp.temperature, "sd_threshold": threshold,
       "max_new_tokens": config.rollout.max_new_tokens, "modes": rows}, indent=2))


# ---------------------------------------------------------------- pipeline


def stage_commands(out: pathlib.Path, quick: bool, sets: list[str], args) -> dict:
  py = sys.executable
  config = CONFIG + (":runlocal" if quick else "")
  flags = [f"--config.{kv}" for kv in sets]
  own = ["--out", str(out), *(["--quick"] if quick else []),
         *[a for kv in sets for a in ("--set", kv)]]
  return {
      "decode": [*module_command("smollm2_cpu"), "--run-stage", "decode", *own, "--batches",
                 *map(str, args.batches), "--iters", str(args.iters)],
      "warmup": [py, "-m", "tlt_jax.warmup_drafter", f"--config={config}",
                 f"--workdir={out / 'warmup'}", *flags],
      "rollout": [*module_command("smollm2_cpu"), "--run-stage", "rollout", *own, "--rollout-prompts",
                  str(args.rollout_prompts)],
      "rl": [*module_command("rl_runs"), "--out", str(out / "rl"),
             "--config", config, "--set",
             f"drafter.eagle.path={out / 'warmup' / 'export' / 'eagle'}",
             "--variants", "baseline", "tlt", "--resume",
             *[a for kv in sets for a in ("--set", kv)]],
  }


def collect(out: pathlib.Path, stages: dict) -> dict:
  """The headline numbers of every stage, from its own outputs."""
  from .common import run_metadata
  decode, roll = _read(out / "decode.json"), _read(out / "rollout.json")
  warm, rl = _read(out / "warmup" / "summary.json"), _read(out / "rl" / "rl_runs.json")
  modes = roll.get("modes", {})
  runs = {}
  for name, r in rl.get("runs", {}).items():
    metrics = r.get("metrics", [])
    runs[name] = {"reward_by_step": [m["reward_mean"] for m in metrics],
                  "reward_vs_initial": [m.get("reward_vs_initial") for m in metrics],
                  "step_s": [m["step_s"] for m in metrics],
                  "rollout_s": [m["rollout_s"] for m in metrics],
                  "update_s": [m["update_s"] for m in metrics],
                  "heldout": {k: v for k, v in r.get("summary", {}).items() if "accuracy" in k}}
  return {**run_metadata(), "device": f"CPU, {_cpu_cores()} cores (the rollout and RL stages "
          f"on 2 emulated devices)", "stages": stages,
          "decode": decode.get("rows"),
          "drafter": {k: warm.get(k) for k in ("accept_len_untrained", "accept_len_warmed",
                                              "strategy")},
          "rollout": {name: {k: m.get(k) for k in ("wall_s", "tail_s", "accept_len",
                                                   "speedup_wall", "speedup_tail",
                                                   "identical_to_plain", "strategies_used")}
                      for name, m in modes.items()},
          "rl": {"end_to_end": rl.get("end_to_end"), "runs": runs}}


def _cpu_cores() -> int:
  import os
  return len(os.sched_getaffinity(0))


def plot(out: pathlib.Path, summary: dict) -> None:
  fig, (ax_d, ax_r, ax_rl) = plt.subplots(1, 3, figsize=(15, 4))
  rows = summary.get("decode") or []
  if rows:
    ax_d.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-")
    ax_d.set_xscale("log", base=2)
    ax_d.set_ylim(bottom=0)
  ax_d.set_xlabel("batch (rows decoding)")
  ax_d.set_ylabel("decode step (ms)")
  ax_d.set_title("SmolLM2-135M float32 decode step", fontsize=9)
  modes = summary.get("rollout") or {}
  names = list(modes)
  x = range(len(names))
  ax_r.bar([i - 0.2 for i in x], [modes[n]["wall_s"] for n in names], 0.4, label="whole")
  ax_r.bar([i + 0.2 for i in x], [modes[n]["tail_s"] for n in names], 0.4, label="tail")
  for i, n in enumerate(names):
    if modes[n].get("accept_len"):
      ax_r.text(i + 0.2, modes[n]["tail_s"], f"{modes[n]['accept_len']:.2f}", ha="center",
                va="bottom", fontsize=7)
  ax_r.set_xticks(list(x), names, fontsize=7, rotation=15)
  ax_r.set_ylabel("seconds (accept length on the tail bars)")
  ax_r.set_title("one rollout, plain vs SD (identical tokens)", fontsize=9)
  ax_r.legend(fontsize=7)
  runs = summary.get("rl", {}).get("runs", {})
  ax_t = ax_rl.twinx()
  for name, color in (("baseline", "#7f8c8d"), ("tlt", "#c0392b")):
    r = runs.get(name)
    if not r:
      continue
    steps = range(1, len(r["reward_by_step"]) + 1)
    ax_rl.plot(steps, r["reward_by_step"], "o-", color=color, label=f"{name} reward")
    if None not in r["reward_vs_initial"]:
      ax_rl.plot(steps, r["reward_vs_initial"], "^--", color=color,
                 label=f"{name} reward - initial policy's (paired)")
    ax_t.plot(steps, r["step_s"], "s:", color=color, alpha=0.6, label=f"{name} step s")
  ax_rl.set_xlabel("RL step")
  ax_rl.set_ylabel("reward (mean)")
  ax_t.set_ylabel("step seconds (dotted)")
  if runs:
    ax_rl.legend(fontsize=7, loc="upper left")
  ax_rl.set_title("GRPO: baseline and TLT", fontsize=9)
  fig.suptitle(f"{summary['device']}, {summary['date']}", fontsize=9)
  fig.tight_layout()
  fig.savefig(out / "smollm2_cpu.png", dpi=120)
  plt.close(fig)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="output folder (resumes)")
  p.add_argument("--quick", action="store_true", help="configs/smollm2.py:runlocal")
  p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every stage (repeatable)")
  p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--rollout-prompts", type=int, default=8,
                 help="problems in the rollout stage's batch (x the config's samples)")
  p.add_argument("--run-stage", choices=("decode", "rollout"), help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)
  if args.run_stage == "decode":
    return decode_stage(out, args.quick, args.set, args.batches, args.iters)
  if args.run_stage == "rollout":
    return rollout_stage(out, args.quick, args.set, args.rollout_prompts)
  stages = run_recorded_stages(out, args.quick, stage_commands(out, args.quick, args.set, args),
                               args.stages)
  summary = collect(out, stages)
  (out / "smollm2_cpu.json").write_text(json.dumps(summary, indent=2))
  plot(out, summary)
  print(f"wrote {out / 'smollm2_cpu.json'} and {out / 'smollm2_cpu.png'}")


if __name__ == "__main__":
  main()
