"""A real model on CPU: SmolLM2-135M-Instruct (configs/smollm2.py), where TLT's regime begins.

  python -m experiments.smollm2_cpu --out runs/smollm2_cpu
  python -m experiments.smollm2_cpu --out /tmp/sm --quick      # configs/smollm2.py:runlocal
  python -m experiments.smollm2_cpu --out runs/smollm2_cpu --stages decode rollout

A campaign (experiments/stages.py: each stage a process, its log in OUT/logs/STAGE.log, a
finished stage recorded in OUT/stages.json and skipped on a rerun): decode (bench_decode: the
plain decode step at each of --batches rows -> OUT/decode.json), warmup (tlt_jax.warmup_drafter
-> OUT/warmup/export/eagle), rollout (bench_rollout with the warmed drafter: --rollout-prompts
problems, plain vs each fixed strategy and BEG-MAB -> OUT/rollout.json), rl (rl_runs: GRPO
baseline and TLT -> OUT/rl). OUT/smollm2_cpu.json holds the run's record and each stage's
headline numbers; OUT/smollm2_cpu.png the decode step against batch size, the rollout's whole
and tail seconds per mode, the RL runs' reward and step time per step.
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


def stage_commands(out: pathlib.Path, quick: bool, sets: list[str], args) -> dict:
  py = sys.executable
  config = CONFIG + (":runlocal" if quick else "")
  flags = [f"--config.{kv}" for kv in sets]
  own = [a for kv in sets for a in ("--set", kv)]
  warmed = ["--set", f"drafter.eagle.path={out / 'warmup' / 'export' / 'eagle'}"]
  return {
      # Plain steps only: the stage measures where the step stops being flat in the batch.
      "decode": [*module_command("bench_decode"), "--config", config, *own, "--strategies",
                 "--batches", *map(str, args.batches), "--iters", str(args.iters),
                 "--out", str(out / "decode.json")],
      "warmup": [py, "-m", "tlt_jax.warmup_drafter", f"--config={config}",
                 f"--workdir={out / 'warmup'}", *flags],
      # Held-out problems (another stream than the warm-up's training prompts), one key.
      "rollout": [*module_command("bench_rollout"), "--config", config, *warmed, *own,
                  "--prompts", str(args.rollout_prompts), "--seed", "7", "--tuners", "beg_mab",
                  "--out", str(out / "rollout.json")],
      "rl": [*module_command("rl_runs"), "--out", str(out / "rl"), "--config", config,
             *warmed, "--variants", "baseline", "tlt", "--resume", *own],
  }


def collect(out: pathlib.Path, stages: dict) -> dict:
  """The headline numbers of every stage, from its own outputs."""
  decode, roll = read_json(out / "decode.json"), read_json(out / "rollout.json")
  warm, rl = read_json(out / "warmup" / "summary.json"), read_json(out / "rl" / "rl_runs.json")
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
  return {**run_metadata(), "device": f"CPU, {usable_cpus()} cores (the rollout and RL stages "
          f"on 2 emulated devices)", "stages": stages,
          "decode": [{"batch": r["batch"], "step_ms": r["tlt_plain_ms"],
                      "tokens_per_s": 1e3 * r["batch"] / r["tlt_plain_ms"]}
                     for r in decode.get("rows", []) if r.get("complete")],
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
  save_figure(fig, out / "smollm2_cpu.png", dpi=120)


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
  args = p.parse_args(argv)
  out = args.out.resolve()
  out.mkdir(parents=True, exist_ok=True)
  stages = run_stages(out, stage_commands(out, args.quick, args.set, args), args.stages,
                      args.quick)
  summary = collect(out, stages)
  write_json(out / "smollm2_cpu.json", summary)
  plot(out, summary)
  print(f"wrote {out / 'smollm2_cpu.json'} and {out / 'smollm2_cpu.png'}")


if __name__ == "__main__":
  main()
