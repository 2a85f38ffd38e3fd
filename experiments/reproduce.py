"""Runs every figure experiment, one after another, into one results folder.

  python -m experiments.reproduce --all --out results/
  python -m experiments.reproduce --all --out /tmp/results --quick     # smoke run, minutes
  python -m experiments.reproduce --only rl_runs simulate_cluster --out results/
  python -m experiments.reproduce --all --out results/ --dry-run       # print the commands

Each experiment runs as its own process (a fresh JAX runtime, its own device setup) and writes
into OUT/<name>/. A failing experiment does not stop the others: OUT/reproduce.json records
each one's command, exit status, seconds and files, and the exit status is non-zero if any
failed. An experiment whose extra package is missing (vs_hf needs torch) is skipped and
recorded as such. The cluster projection uses the simulator's illustrative 7B cost model; the
simulator is also checked against the baseline RL run (simulate_vs_run) when rl_runs ran first.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import subprocess
import sys
import time

from .common import REPO, module_command, write_json
POLICY = "assets/tiny-policy"
# The rollout benchmark's setting (docs/results/rollout): one slice of up to 64 rows, and below,
# 96 held-out prompts with one greedy sample each; the config's (shipped) drafter.
ROLLOUT_SETS = ["rollout.max_batch=64", "mesh.num_cpu_devices=1", "mesh.axes.replica=1"]
# Experiments that need a package `pip install -e .` does not install: skipped, not failed,
# when it is missing.
REQUIRES = {"vs_hf": "torch"}


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
      "grpo_settings": ["grpo_settings", "--out", str(out / "grpo_settings"), *q],
      # 2, 5: rollout throughput by mode and active batch size; the tuner vs fixed strategies.
      "rollout": ["bench_rollout", *[a for kv in ROLLOUT_SETS for a in ("--set", kv)],
                  "--samples", "1", "--temperature", "0", *(q or ["--prompts", "96"]),
                  "--sweep-iterations-per-call", *([1, 32] if quick else [1, 4, 16, 32, 128]),
                  "--out", str(out / "rollout" / "rollout.json")],
      # 6: the compiled-executable pool.
      "executable_pool": ["executable_pool", "--out", str(out / "executable_pool"), *q],
      # 7: cluster-scale projection (8 to 1024 devices), and the simulator against a measured
      # run: its lengths replayed with costs fitted to it, simulated vs measured idle time.
      "simulate_cluster": ["simulate_cluster", "--out", str(out / "simulate_cluster"), *q],
      "simulate_vs_run": ["simulate_vs_run", "--out", str(out / "simulate_vs_run"),
                          "--run", str(baseline_run)],
      # Against transformers on the same checkpoint.
      "vs_hf": ["bench_vs_hf", "--out", str(out / "vs_hf" / "vs_hf.json"), *q],
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
  known = list(experiments(args.out, args.quick))
  unknown = [n for n in args.only if n not in known]
  if unknown:
    sys.exit(f"unknown experiment(s) {unknown}; choose from {known}")
  if not args.all and not args.only:
    sys.exit(f"pass --all or --only NAME ...; experiments: {known}")
  names = known if args.all else [n for n in known if n in args.only]

  args.out.mkdir(parents=True, exist_ok=True)
  report_path = args.out / "reproduce.json"
  report = {"quick": args.quick, "experiments": {}}
  for i, name in enumerate(names, 1):
    # Built per experiment: the simulator reads what rl_runs has just written.
    module, *module_args = experiments(args.out, args.quick)[name]
    cmd = module_command(module, *module_args)
    print(f"[{i}/{len(names)}] {name}: {' '.join(cmd[1:])}", flush=True)
    if args.dry_run:
      continue
    folder = args.out / name
    needs = REQUIRES.get(name)
    if needs and importlib.util.find_spec(needs) is None:
      report["experiments"][name] = {"command": cmd[1:], "returncode": None, "seconds": 0.0,
                                     "files": [], "skipped": f"needs {needs}"}
      print(f"    skipped: needs {needs} (pip install {needs})", flush=True)
      write_json(report_path, report)
      continue
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    seconds = time.perf_counter() - t0
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "log.txt").write_text(proc.stdout)
    files = sorted(str(p.relative_to(args.out)) for p in folder.rglob("*")
                   if p.is_file() and p.suffix in (".json", ".csv", ".png"))
    report["experiments"][name] = {"command": cmd[1:], "returncode": proc.returncode,
                                   "seconds": seconds, "files": files}
    status = ("ok" if proc.returncode == 0
              else f"FAILED (exit {proc.returncode}; see {folder}/log.txt)")
    print(f"    {status} in {seconds:.0f} s", flush=True)
    write_json(report_path, report)  # kept current: nothing lost on a crash
  if args.dry_run:
    return
  failed = [n for n, r in report["experiments"].items() if r["returncode"]]
  print(f"wrote {report_path}" + (f"; failed: {failed}" if failed else ""))
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
