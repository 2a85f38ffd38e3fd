"""Runs every figure experiment, one after another, into one results folder.

  python -m experiments.reproduce --all --out results/ [--quick] [--dry-run]
  python -m experiments.reproduce --only rl_runs simulate_cluster --out results/

Each experiment is a stage of the campaign runner (experiments/stages.py) writing OUT/<name>/;
a failing one does not stop the others; what OUT/reproduce.json records: docs/reproducing.md.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from .common import module_command
from .stages import run_stages

POLICY = "assets/tiny-policy"
# The rollout benchmark's setting (docs/results/rollout): one slice of up to 64 rows, and below,
# 96 held-out prompts with one greedy sample each; the config's (shipped) drafter.
ROLLOUT_SETS = ["rollout.max_batch=64", "mesh.num_cpu_devices=1", "mesh.axes.replica=1"]


def experiments(out: pathlib.Path, quick: bool) -> dict[str, list[str]]:
  """name -> the experiment module (experiments.<module>) and its arguments (paths inside
  `out`)."""
  q = ["--quick"] if quick else []
  baseline_run = out / "rl_runs" / "runs" / "baseline"
  return {
      # 1: the long tail of one policy's samples (the RL runs add it per step).
      "length_histogram": ["length_histogram", "--policy", POLICY,
                           "--out", str(out / "length_histogram"), *q],
      # 1, 3, 4: baseline / TLT / frozen / no-warm-up RL runs, back to back.
      "rl_runs": ["rl_runs", "--out", str(out / "rl_runs"), *q],
      # Held-out accuracy before and after GRPO, per update setting and seed.
      "grpo_settings": ["rl_runs", "--settings", "--out", str(out / "grpo_settings"), *q],
      # 2, 5: rollout throughput by mode and active batch size; the tuner vs fixed strategies.
      "rollout": ["bench_rollout", *[a for kv in ROLLOUT_SETS for a in ("--set", kv)],
                  "--samples", "1", "--temperature", "0", *(q or ["--prompts", "96"]),
                  "--out", str(out / "rollout" / "rollout.json")],
      # 7: cluster-scale projection (8 to 1024 devices), and the simulator against a measured
      # run: its lengths replayed with costs fitted to it, simulated vs measured idle time.
      "simulate_cluster": ["simulate_cluster", "--out", str(out / "simulate_cluster"), *q],
      "simulate_vs_run": ["replay", "--out", str(out / "simulate_vs_run"),
                          "--run", str(baseline_run)],
      # The drafter trained with unrolled draft steps (training-time test), per strategy.
      "drafter_ttt": ["drafter_ttt", "--out", str(out / "drafter_ttt" / "drafter_ttt.json"),
                      *q],
  }


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="results folder")
  parser.add_argument("--all", action="store_true", help="run every experiment")
  parser.add_argument("--only", nargs="+", default=[], metavar="NAME",
                      help="run these experiments (names as in --dry-run)")
  parser.add_argument("--quick", action="store_true", help="each script's smoke mode")
  parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
  args = parser.parse_args()
  commands = {name: module_command(*argv) for name, argv in
              experiments(args.out, args.quick).items()}
  if unknown := [n for n in args.only if n not in commands]:
    sys.exit(f"unknown experiment(s) {unknown}; choose from {list(commands)}")
  if not args.all and not args.only:
    sys.exit(f"pass --all or --only NAME ...; experiments: {list(commands)}")
  names = [n for n in commands if args.all or n in args.only]
  if args.dry_run:
    for i, name in enumerate(names, 1):
      print(f"[{i}/{len(names)}] {name}: {' '.join(commands[name][1:])}")
    return
  stages = run_stages(args.out, commands, names, args.quick, record_name="reproduce.json",
                      resume=False, keep_going=True)
  failed = [n for n, r in stages.items() if r["returncode"]]
  print(f"wrote {args.out / 'reproduce.json'}" + (f"; failed: {failed}" if failed else ""))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
