"""A real model on CPU: SmolLM2-135M-Instruct (configs/smollm2.py), where TLT's regime begins.

  python -m experiments.smollm2_cpu --out runs/smollm2_cpu
  python -m experiments.smollm2_cpu --out /tmp/sm --quick      # configs/smollm2.py:runlocal
  python -m experiments.smollm2_cpu --out runs/smollm2_cpu --stages decode rollout

A campaign (experiments/stages.py: each stage a process, its log in OUT/logs/STAGE.log, a
finished stage recorded in OUT/stages.json and skipped on a rerun): decode (profile_decode: the
plain decode iteration at each of --batches rows -> OUT/decode/profile_decode.json), warmup
(tlt_jax.warmup_drafter -> OUT/warmup/export/eagle), rollout (bench_rollout with the warmed
drafter: --rollout-prompts problems, plain vs each fixed strategy and BEG-MAB ->
OUT/rollout.json), rl (rl_runs: GRPO baseline and TLT -> OUT/rl). OUT/smollm2_cpu.json holds
the run's record and each stage's headline numbers; OUT/smollm2_cpu.png the decode iteration
against batch size, the rollout's whole and tail seconds per mode, the RL runs' reward and
step time per step.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from .common import (REPO, module_command, pyplot, read_json, run_metadata, save_figure,
                     usable_cpus, write_json)
from .stages import run_stages

STAGES = ("decode", "warmup", "rollout", "rl")
CONFIG = str(REPO / "configs" / "smollm2.py")


def stage_commands(out: pathlib.Path, args) -> dict:
  config = CONFIG + (":runlocal" if args.quick else "")
  own = [a for kv in args.set for a in ("--set", kv)]
  warmed = ["--set", f"drafter.eagle.path={out / 'warmup' / 'export' / 'eagle'}"]
  return {
      # Plain iterations only: the stage measures where a step stops being flat in the rows.
      "decode": [*module_command("profile_decode"), "--config", config, "--weights", "config",
                 *own, "--arms", "--batches", *map(str, args.batches), "--iterations",
                 str(args.iterations), "--no-trace", "--flags", "--out", str(out / "decode")],
      "warmup": [sys.executable, "-m", "tlt_jax.warmup_drafter", f"--config={config}",
                 f"--workdir={out / 'warmup'}", *[f"--config.{kv}" for kv in args.set]],
      # Held-out problems (another stream than the warm-up's training prompts), one key.
      "rollout": [*module_command("bench_rollout"), "--config", config, *warmed, *own,
                  "--prompts", str(args.rollout_prompts), "--seed", "7", "--tuners", "beg_mab",
                  "--out", str(out / "rollout.json")],
      "rl": [*module_command("rl_runs"), "--out", str(out / "rl"), "--config", config,
             *warmed, "--variants", "baseline", "tlt", *own],
  }


def collect(out: pathlib.Path, stages: dict) -> dict:
  """The headline numbers of every stage, from its own outputs."""
  decode, roll = read_json(out / "decode" / "profile_decode.json"), read_json(out / "rollout.json")
  warm, rl = read_json(out / "warmup" / "summary.json"), read_json(out / "rl" / "rl_runs.json")
  modes = roll.get("modes", {})
  # Per-step series of each RL run: our name -> rl_runs' metric.
  series = {"reward_by_step": "reward_mean", "reward_vs_initial": "reward_vs_initial",
            "step_s": "step_s", "rollout_s": "rollout_s", "update_s": "update_s"}
  runs = {name: {**{k: [m.get(v) for m in r.get("metrics", [])] for k, v in series.items()},
                 "heldout": {k: v for k, v in r.get("summary", {}).items() if "accuracy" in k}}
          for name, r in rl.get("runs", {}).items()}
  return {**run_metadata(), "device": f"CPU, {usable_cpus()} cores (the rollout and RL stages "
          f"on 2 emulated devices)", "stages": stages,
          "decode": [{"batch": r["batch"], "step_ms": r["plain"]["timing"]["iteration_ms"],
                      "tokens_per_s": r["plain"].get("tokens_per_s")}
                     for r in decode.get("rows", []) if "timing" in r["plain"]],
          "drafter": {k: warm.get(k) for k in ("accept_len_untrained", "accept_len_warmed",
                                              "strategy")},
          "rollout": {name: {k: m.get(k) for k in ("wall_s", "tail_s", "accept_len",
                                                   "speedup_wall", "speedup_tail",
                                                   "identical_to_plain", "strategies_used")}
                      for name, m in modes.items()},
          "rl": {"end_to_end": rl.get("end_to_end"), "runs": runs}}


def plot(out: pathlib.Path, summary: dict) -> None:
  plt = pyplot()
  fig, (ax_d, ax_r, ax_rl) = plt.subplots(1, 3, figsize=(15, 4))
  rows = summary.get("decode") or []
  if rows:
    ax_d.plot([r["batch"] for r in rows], [r["step_ms"] for r in rows], "o-")
    ax_d.set_xscale("log", base=2)
    ax_d.set_ylim(bottom=0)
  ax_d.set_xlabel("batch (rows decoding)")
  ax_d.set_ylabel("plain decode iteration (ms)")
  ax_d.set_title("SmolLM2-135M float32 decode iteration", fontsize=9)
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
  save_figure(fig, out / "smollm2_cpu.png", dpi=120)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="output folder (resumes)")
  p.add_argument("--quick", action="store_true", help="configs/smollm2.py:runlocal")
  p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="config override for every stage (repeatable)")
  p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
  p.add_argument("--iterations", type=int, default=8,
                 help="decode stage: iterations of a long call (see profile_decode)")
  p.add_argument("--rollout-prompts", type=int, default=8,
                 help="problems in the rollout stage's batch (x the config's samples)")
  args = p.parse_args(argv)
  out = args.out.resolve()
  stages = run_stages(out, stage_commands(out, args), args.stages, args.quick)
  summary = collect(out, stages)
  write_json(out / "smollm2_cpu.json", summary)
  plot(out, summary)
  print(f"wrote {out / 'smollm2_cpu.json'} and {out / 'smollm2_cpu.png'}")


if __name__ == "__main__":
  main()
