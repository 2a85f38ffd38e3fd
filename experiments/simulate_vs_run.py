"""The cluster simulator checked against a measured run: simulated vs measured idle time.

Replays each step of a run (its response lengths, in request order) through the rollout cost
model (`experiments.rollout_model`) with costs fitted to the run, and compares the idle
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

from tlt_jax.config import with_current_keys
from tlt_jax.rollout.scheduler import batch_ladder

from .common import write_json
from .rollout_model import make_costs, read_json, read_jsonl, simulate_rollout


def run_settings(run_dir: str, **given) -> tuple[dict, int]:
  """num_slices / max_batch / sd_threshold: `given` where not None, else the run's
  summary.json (mesh replica axis, rollout.max_batch, rollout.sd_threshold); and its
  rollout.iterations_per_call (1 where it does not say)."""
  path = os.path.join(run_dir, "summary.json")
  have = os.path.isfile(path)
  config = read_json(path, "run summary").get("config", {}) if have else {}
  axes = config.get("mesh", {}).get("axes", {})
  replica = axes.get("replica", 1)
  if replica == -1:  # the free axis: the devices left over by the fixed ones
    fixed = int(np.prod([v for k, v in axes.items() if k != "replica"]))
    replica = config.get("mesh", {}).get("num_cpu_devices", 0) // max(fixed, 1) or None
  rollout = with_current_keys("rollout", config.get("rollout", {}))
  found = {"num_slices": replica if have else None, "max_batch": rollout.get("max_batch"),
           "sd_threshold": rollout.get("sd_threshold")}
  out = {k: given.get(k) if given.get(k) is not None else v for k, v in found.items()}
  missing = [k for k, v in out.items() if v is None]
  if missing:
    raise ValueError(f"cannot tell {missing} of the run: no summary.json in {run_dir!r} says "
                     f"so; pass them (--num-slices, --max-batch, --sd-threshold)")
  return {k: int(v) for k, v in out.items()}, int(rollout.get("iterations_per_call", 1))


def compare_with_run(metrics_jsonl_path: str, rollouts_jsonl_path: str | None = None,
                     num_slices: int | None = None, max_batch: int | None = None,
                     sd_threshold: int | None = None, max_compile_share: float = 0.1) -> dict:
  """Simulated vs measured idle slice-seconds for every step of a single-machine run.

  Reads the run's metrics.jsonl (rollout_s, idle_slice_s, compile_s, sd_enabled,
  sd_accept_len_mean per step) and rollouts.jsonl (each response's tokens; written with
  --config.rl.save_rollouts=True), replays each step's lengths in request order and fits the
  cost model: seconds per plain iteration (fixed + per row of the program batch), per SD
  iteration (at the step's accept length) and per prefill call, by non-negative least
  squares. Each schedule is fitted on what it determines exactly: "parallel" on busy
  slice-seconds (slices * rollout_s - idle_slice_s), "interleaved" on rollout_s; the idle
  time is then a prediction. Steps whose compile_s exceeds max_compile_share of rollout_s
  are left out of the fit (compiling is in rollout_s, not in the model).

  Returns {"settings", "iterations_per_call", "steps": [{step, measured_idle_slice_s,
  measured_rollout_s, <schedule>_idle_slice_s, <schedule>_rollout_s, used_in_fit}], "fit":
  {schedule: costs}, "totals": {measured and simulated idle slice-seconds}}.
  """
  from scipy.optimize import nnls
  run_dir = os.path.dirname(os.path.abspath(metrics_jsonl_path))
  hint = "write it with `python -m tlt_jax.train ... --config.rl.save_rollouts=True`"
  metrics = read_jsonl(metrics_jsonl_path, "metrics file", ("step", "rollout_s",
                       "idle_slice_s"), "pass a run's metrics.jsonl")
  rollouts = read_jsonl(rollouts_jsonl_path or os.path.join(run_dir, "rollouts.jsonl"),
                        "rollouts file", ("step", "prompt", "sample", "tokens"), hint)
  settings, iterations_per_call = run_settings(run_dir, num_slices=num_slices,
                                               max_batch=max_batch, sd_threshold=sd_threshold)
  by_step: dict[int, list] = {}
  for r in rollouts:
    by_step.setdefault(int(r["step"]), []).append((r["prompt"], r["sample"], r["tokens"]))
  steps = [m for m in metrics if int(m["step"]) in by_step]
  if not steps:
    raise ValueError(f"no step of {metrics_jsonl_path!r} has responses in rollouts.jsonl; "
                     f"{hint}")
  slices, grid = settings["num_slices"], np.asarray(batch_ladder(settings["max_batch"]), float)
  # Every cost enters a slice's finish time linearly (the schedule of calls does not depend
  # on their costs), so four unit-cost runs give each slice's time for any fitted costs.
  bases = [dict(plain_s=1.0, sd_s=0.0), dict(plain_s=grid, sd_s=0.0),
           dict(plain_s=0.0, sd_s=1.0), dict(plain_s=0.0, sd_s=0.0, prefill_s=1.0)]
  finish = {"parallel": [], "interleaved": []}
  for m in steps:
    lengths = [t for _, _, t in sorted(by_step[int(m["step"])])]
    accept = max(m.get("sd_accept_len_mean") or 1.0, 1.0)
    threshold = settings["sd_threshold"] if m.get("sd_enabled", False) else 0
    for schedule, per_step in finish.items():
      per_step.append(np.stack([simulate_rollout(
          lengths, slices, settings["max_batch"], make_costs(grid, accept_len=accept, **basis),
          threshold, schedule, iterations_per_call)["finish_s"] for basis in bases], 1))  # [R, 4]
  used = np.asarray([(m.get("compile_s") or 0.0) <= max_compile_share * m["rollout_s"]
                     for m in steps])
  if used.sum() < 2:
    used[:] = True  # too few clean steps: fit on all of them, compile time included
  idle, rollout = (np.asarray([m[k] for m in steps]) for k in ("idle_slice_s", "rollout_s"))
  result = {"settings": settings, "iterations_per_call": iterations_per_call, "fit": {},
            "steps": [{"step": int(m["step"]), "measured_idle_slice_s": float(idle[i]),
                       "measured_rollout_s": float(rollout[i]), "used_in_fit": bool(used[i])}
                      for i, m in enumerate(steps)],
            "totals": {"measured_idle_slice_s": float(idle.sum())}}
  for schedule, per_step in finish.items():
    if schedule == "parallel":
      features, target = np.stack([f.sum(0) for f in per_step]), slices * rollout - idle
    else:  # the slice that finishes last waited for every call
      features, target = np.stack([f[np.argmax(f.sum(1))] for f in per_step]), rollout
    coef, _ = nnls(features[used], target[used])
    result["fit"][schedule] = dict(zip(("plain_fixed_s", "plain_per_row_s", "sd_s",
                                        "prefill_s"), coef.tolist()))
    for row, f in zip(result["steps"], per_step):
      t = f @ coef
      row[f"{schedule}_idle_slice_s"] = float((t.max() - t).sum())
      row[f"{schedule}_rollout_s"] = float(t.max())
    result["totals"][f"{schedule}_idle_slice_s"] = float(sum(
        s[f"{schedule}_idle_slice_s"] for s in result["steps"]))
  return result


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
  steps = [s["step"] for s in result["steps"]]
  fig, ax = plt.subplots(figsize=(7, 3.4), dpi=110)
  for key, style, label in (("measured", "ko-", "measured"),
                            ("interleaved", "s--", "simulated, interleaved"),
                            ("parallel", "^:", "simulated, parallel")):
    ax.plot(steps, [s[f"{key}_idle_slice_s"] for s in result["steps"]], style, label=label)
  ax.set(xlabel="RL step", ylabel="idle slice-seconds")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(args.out, "compare.png"))
  plt.close(fig)
  print(json.dumps({"settings": result["settings"], "totals": result["totals"]}))


if __name__ == "__main__":
  main()
