"""The cluster simulator checked against a measured run: simulated vs measured idle time.

Replays each step of a run (its response lengths, in request order) through
simulate_cluster.py's rollout model with costs fitted to the run, and compares the idle
slice-seconds it predicts with those the run measured.

  python -m tlt_jax.train --config configs/default.py:baseline --workdir runs/baseline \
      --config.rl.save_rollouts=True
  python -m experiments.simulate_vs_run --run runs/baseline --out results/simulate_vs_run

Reads RUN/metrics.jsonl, RUN/rollouts.jsonl and RUN/summary.json; writes OUT/compare.json and
OUT/compare.png.
"""

from __future__ import annotations

import argparse
import json
import os


import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from . import simulate_cluster as sim
from .common import write_json
from tlt_jax.config import with_current_keys


def _read_jsonl(path: str, what: str, need: tuple, hint: str) -> list[dict]:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r} not found; {hint}")
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  missing = sorted({k for r in rows for k in need if k not in r})
  if not rows or missing:
    raise ValueError(f"{what} {path!r} is empty or lacks keys {missing}; {hint}")
  return rows


def _run_settings(metrics_path: str, num_slices, max_batch, sd_threshold) -> dict:
  """num_slices / max_batch / sd_threshold: the arguments, else the run's summary.json."""
  given = {"num_slices": num_slices, "max_batch": max_batch, "sd_threshold": sd_threshold}
  summary = os.path.join(os.path.dirname(os.path.abspath(metrics_path)), "summary.json")
  if None in given.values() and os.path.isfile(summary):
    config = sim.read_json(summary, "run summary").get("config", {})
    axes = config.get("mesh", {}).get("axes", {})
    replica = axes.get("replica", 1)
    if replica == -1:  # the free axis: the devices left over by the fixed ones
      fixed = int(np.prod([v for k, v in axes.items() if k != "replica"]))
      replica = config.get("mesh", {}).get("num_cpu_devices", 0) // max(fixed, 1) or None
    found = {"num_slices": replica, "max_batch": config.get("rollout", {}).get("max_batch"),
             "sd_threshold": config.get("rollout", {}).get("sd_threshold")}
    given = {k: v if v is not None else found[k] for k, v in given.items()}
  missing = [k for k, v in given.items() if v is None]
  if missing:
    raise ValueError(f"cannot tell {missing} of the run: no summary.json next to "
                     f"{metrics_path!r} says so; pass them (--num-slices, --max-batch, "
                     f"--sd-threshold)")
  return {k: int(v) for k, v in given.items()}


def _run_iterations_per_call(metrics_path: str) -> int:
  """The run's rollout.iterations_per_call from its summary.json; 1 (a call per iteration) when it
  does not say."""
  summary = os.path.join(os.path.dirname(os.path.abspath(metrics_path)), "summary.json")
  if not os.path.isfile(summary):
    return 1
  config = sim.read_json(summary, "run summary").get("config", {})
  return int(with_current_keys("rollout", config.get("rollout", {})).get("iterations_per_call",
                                                                        1))


def compare_with_run(metrics_jsonl_path: str, rollouts_jsonl_path: str | None = None,
                     num_slices: int | None = None, max_batch: int | None = None,
                     sd_threshold: int | None = None, max_compile_share: float = 0.1) -> dict:
  """Simulated vs measured idle slice-seconds for every step of a single-machine run.

  Reads the run's metrics.jsonl (rollout_s, idle_slice_s, compile_s, sd_enabled,
  sd_accept_len_mean per step) and rollouts.jsonl (the tokens of each response; written with
  --config.rl.save_rollouts=True), replays each step's lengths in request order and fits a
  cost model: seconds per plain iteration (fixed + per row of the program batch), per SD
  iteration (at the step's measured accept length) and per prefill call, by non-negative
  least squares. Each schedule is fitted on what it determines exactly: "parallel" on busy
  slice-seconds (slices * rollout_s - idle_slice_s), "interleaved" on rollout_s; the idle
  time is then a prediction, not a fit. Steps whose compile_s exceeds max_compile_share of
  rollout_s are left out of the fit (compiling is in rollout_s, not in the model).
  Settings default to the run's summary.json (mesh replica axis, rollout.max_batch,
  rollout.sd_threshold).

  Returns {"settings", "steps": [{step, measured_idle_slice_s, measured_rollout_s,
  <schedule>_idle_slice_s, <schedule>_rollout_s, used_in_fit}], "fit": {schedule: costs},
  "totals": {measured and simulated idle slice-seconds}}.
  """
  from scipy.optimize import nnls
  hint = "write it with `python -m tlt_jax.train ... --config.rl.save_rollouts=True`"
  metrics = _read_jsonl(metrics_jsonl_path, "metrics file", ("step", "rollout_s",
                        "idle_slice_s"), "pass a run's metrics.jsonl")
  rollouts_jsonl_path = rollouts_jsonl_path or os.path.join(
      os.path.dirname(os.path.abspath(metrics_jsonl_path)), "rollouts.jsonl")
  rollouts = _read_jsonl(rollouts_jsonl_path, "rollouts file",
                         ("step", "prompt", "sample", "tokens"), hint)
  settings = _run_settings(metrics_jsonl_path, num_slices, max_batch, sd_threshold)
  iterations_per_call = _run_iterations_per_call(metrics_jsonl_path)
  by_step: dict[int, list] = {}
  for r in rollouts:
    by_step.setdefault(int(r["step"]), []).append((r["prompt"], r["sample"], r["tokens"]))
  steps = [m for m in metrics if int(m["step"]) in by_step]
  if not steps:
    raise ValueError(f"no step of {metrics_jsonl_path!r} has responses in "
                     f"{rollouts_jsonl_path!r}; {hint}")
  r_, b_ = settings["num_slices"], settings["max_batch"]
  grid = sim.pow2_upto(b_)
  # Every cost enters a slice's finish time linearly (the schedule of calls does not depend
  # on their costs), so four unit-cost runs give each slice's time for any fitted costs.
  bases = [dict(plain_s=1.0, sd_s=0.0), dict(plain_s=grid, sd_s=0.0),
           dict(plain_s=0.0, sd_s=1.0), dict(plain_s=0.0, sd_s=0.0, prefill_s=1.0)]
  names = ("plain_fixed_s", "plain_per_row_s", "sd_s", "prefill_s")
  finish = {"parallel": [], "interleaved": []}
  for m in steps:
    lengths = [t for _, _, t in sorted(by_step[int(m["step"])])]
    accept = m.get("sd_accept_len_mean") or 1.0
    threshold = settings["sd_threshold"] if m.get("sd_enabled", False) else 0
    for schedule in finish:
      finish[schedule].append(np.stack([sim.simulate_rollout(
          lengths, r_, b_, sim.make_costs(grid, accept_len=max(accept, 1.0), **basis),
          threshold, schedule, iterations_per_call)["finish_s"] for basis in bases], 1))  # [R, 4]
  used = np.asarray([(m.get("compile_s") or 0.0) <= max_compile_share * m["rollout_s"]
                     for m in steps])
  if used.sum() < 2:
    used[:] = True  # too few clean steps: fit on all of them, compile time included
  measured_idle = np.asarray([m["idle_slice_s"] for m in steps])
  measured_rollout = np.asarray([m["rollout_s"] for m in steps])
  result = {"settings": settings, "iterations_per_call": iterations_per_call, "fit": {}, "steps": [
      {"step": int(m["step"]), "measured_idle_slice_s": float(measured_idle[i]),
       "measured_rollout_s": float(measured_rollout[i]), "used_in_fit": bool(used[i])}
      for i, m in enumerate(steps)]}
  totals = {"measured_idle_slice_s": float(measured_idle.sum())}
  for schedule, per_step in finish.items():
    if schedule == "parallel":
      features = np.stack([f.sum(0) for f in per_step])
      target = r_ * measured_rollout - measured_idle
    else:
      features = np.stack([f[np.argmax(f.sum(1))] for f in per_step])  # total of all calls
      target = measured_rollout
    coef, _ = nnls(features[used], target[used])
    result["fit"][schedule] = dict(zip(names, coef.tolist()))
    for i, f in enumerate(per_step):
      t = f @ coef
      result["steps"][i][f"{schedule}_idle_slice_s"] = float((t.max() - t).sum())
      result["steps"][i][f"{schedule}_rollout_s"] = float(t.max())
    totals[f"{schedule}_idle_slice_s"] = float(sum(s[f"{schedule}_idle_slice_s"]
                                                   for s in result["steps"]))
  result["totals"] = totals
  return result


def plot_compare(result: dict, path: str) -> None:
  steps = [s["step"] for s in result["steps"]]
  fig, ax = plt.subplots(figsize=(7, 3.4), dpi=110)
  ax.plot(steps, [s["measured_idle_slice_s"] for s in result["steps"]], "ko-", label="measured")
  for schedule, style in (("interleaved", "s--"), ("parallel", "^:")):
    ax.plot(steps, [s[f"{schedule}_idle_slice_s"] for s in result["steps"]], style,
            label=f"simulated, {schedule}")
  ax.set_xlabel("RL step")
  ax.set_ylabel("idle slice-seconds")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", required=True, help="a run's workdir (metrics, rollouts)")
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--num-slices", type=int, help="the run's slices (default: its summary)")
  parser.add_argument("--max-batch", type=int, help="its rollout.max_batch (default: summary)")
  parser.add_argument("--sd-threshold", type=int, help="its SD threshold (default: summary)")
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  try:
    result = compare_with_run(os.path.join(args.run, "metrics.jsonl"),
                              num_slices=args.num_slices, max_batch=args.max_batch,
                              sd_threshold=args.sd_threshold)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None
  write_json(os.path.join(args.out, "compare.json"), result)
  plot_compare(result, os.path.join(args.out, "compare.png"))
  print(json.dumps({"settings": result["settings"], "totals": result["totals"]}))


if __name__ == "__main__":
  main()
