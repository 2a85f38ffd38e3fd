"""The rollout cost model (`experiments.rollout_model`) against measurement, one of:

  python -m experiments.replay --headline docs/results/gpu_h200_2026-12-04/tf32/headline.json \
      --out docs/results/replay [--lengths F] [--accept F --variant V --strategy S]
  python -m experiments.replay --run runs/baseline --out results/simulate_vs_run

--headline: a GPU run's measured costs (`fit_costs`) through the engine's own scheduler,
checked against the run it came from, then with one change at a time (`project`); writes
OUT/replay.{json,png}. --run: a run saved with --config.rl.save_rollouts=True, its steps'
lengths replayed with costs fitted to its rollout times (`compare_with_run`), simulated
against measured idle slice-seconds; writes OUT/compare.{json,png}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys

import numpy as np

from tlt_jax.config import with_current_keys
from tlt_jax.rollout.scheduler import batch_ladder, bucket

from .common import pyplot, run_stamp, save_figure, write_json
from .rollout_model import CostModel, load_lengths, make_costs, read_json, simulate_rollout

# The engine settings of configs/smollm2.py:gpu_headline at 2026-12-04, for a headline.json
# that does not record them.
HEADLINE_ENGINE = {"max_batch": 128, "batch_sizes": [1, 8, 32], "sd_threshold": 32,
                   "iterations_per_call": 32}


@dataclasses.dataclass
class Call:
  """One compiled call of a rollout: seconds from its start to the next call's, the rows
  running before it and after it, its program batch, and its iterations when known."""
  mode: str
  active: int
  after: int
  batch: int
  seconds: float
  iterations: float | None = None
  full: bool = False  # it ran iterations_per_call iterations (old records: inferred)


@dataclasses.dataclass
class Engine:
  max_batch: int
  batch_sizes: tuple
  sd_threshold: int
  iterations_per_call: int

  @property
  def ladder(self) -> tuple:
    return batch_ladder(self.max_batch, self.batch_sizes)

  def min_running(self, batch: int, speculative: bool) -> int:
    """The scheduler's stop rule for a call at `batch` outside the tail."""
    low = max([b for b in self.ladder if b < batch], default=0) + 1
    return max(low, self.sd_threshold + 1) if speculative else low


def engine_of(headline: dict) -> Engine:
  e = {**HEADLINE_ENGINE, **headline.get("engine", {})}
  return Engine(e["max_batch"], tuple(e["batch_sizes"]), e["sd_threshold"],
                e["iterations_per_call"])


def calls_of(step: dict, engine: Engine, speculative: bool) -> list[Call]:
  """A step's calls from headline.json: its `calls` (with iterations), or from `running`
  ([start seconds, rows, mode]) with the full calls marked by the scheduler's rules."""
  if "calls" in step:
    return [Call(c["mode"], c["active"], c["after"], c["bucket"], c["seconds"],
                 c["iterations"], c["iterations"] == engine.iterations_per_call)
            for c in step["calls"]]
  rows, out = step["running"], []
  for i, (t, active, mode) in enumerate(rows):
    last = i + 1 == len(rows)
    after = 0 if last else rows[i + 1][1]
    batch = bucket(active, engine.max_batch, engine.ladder)
    if mode == "prefill" or last:
      full = False
    elif speculative and active <= engine.sd_threshold:  # a tail call stops at a finished row
      full = after == active
    else:  # elsewhere when the rows fall out of the program's range
      full = after >= engine.min_running(batch, speculative)
    out.append(Call(mode, active, after, batch,
                    (step["rollout_s"] if last else rows[i + 1][0]) - t,
                    0.0 if mode == "prefill" else None, full))
  return out


# ---------------------------------------------------------------- costs from the calls

def _median_per_iteration(calls, mode, call_s, ipc) -> dict:
  full = {}
  for c in calls:
    if c.mode == mode and c.full:
      full.setdefault(c.batch, []).append(c.seconds)
  return {b: max(float(np.median(s)) - call_s, 0.0) / ipc for b, s in sorted(full.items())}


def _fill_from_totals(per_step_calls, steps, mode, per_iteration, call_s) -> None:
  """Batches of `mode` with no full call: the seconds per iteration that make each step's
  calls add up to its recorded iterations (the median over steps)."""
  for b in sorted({c.batch for calls in per_step_calls for c in calls
                   if c.mode == mode and c.batch not in per_iteration}):
    values = []
    for calls, step in zip(per_step_calls, steps):
      ours = [c for c in calls if c.mode == mode]
      rest = step[f"{mode}_iterations"] - sum((c.seconds - call_s) / per_iteration[c.batch]
                                              for c in ours if c.batch in per_iteration)
      unknown = [c.seconds - call_s for c in ours if c.batch == b]
      if unknown and rest > 0:
        values.append(sum(unknown) / rest)
    if values:
      per_iteration[b] = float(np.median(values))


def _fixed_point_call_s(steps, per_step_calls, ipc) -> float:
  """Per-call seconds from the plain calls that did not run all their iterations, whose
  iterations the step's total fixes (the full calls' costs need call_s and vice versa)."""
  calls, call_s = [c for cs in per_step_calls for c in cs], 0.0
  for _ in range(20):
    per, estimates = _median_per_iteration(calls, "plain", call_s, ipc), []
    for cs, step in zip(per_step_calls, steps):
      partial = [c for c in cs if c.mode == "plain" and not c.full and c.batch in per]
      rest = step["plain_iterations"] - ipc * sum(c.mode == "plain" and c.full for c in cs)
      inverse = sum(1.0 / per[c.batch] for c in partial)
      if partial and inverse:
        estimates.append((sum(c.seconds / per[c.batch] for c in partial) - rest) / inverse)
    call_s = max(float(np.median(estimates)), 0.0) if estimates else 0.0
  return call_s


def fit_costs(steps: list[dict], per_step_calls: list[list[Call]], engine: Engine,
              call_s: float | None = None, first: int = 2) -> tuple[CostModel, dict]:
  """A variant's cost model on the engine's ladder (NaN where it never ran a mode) and the
  rest of its step ({update_s, other_s}, means over steps >= first). Calls recorded with their
  iterations give the per-call and per-iteration seconds by least squares; a record without
  them (2026-12-04: when each call began and how many rows ran) gives them from the calls that
  ran all their iterations and the step's total iterations, which fix the rest. call_s: given
  (the baseline's, for TLT's old records), else fitted."""
  ipc, calls = engine.iterations_per_call, [c for cs in per_step_calls for c in cs]
  known = [c for c in calls if c.iterations]
  if call_s is None and known:  # seconds = call_s + per_iteration[mode, batch] * iterations
    keys = sorted({(c.mode, c.batch) for c in known})
    a = np.zeros((len(known), 1 + len(keys)))
    a[:, 0] = 1.0
    for i, c in enumerate(known):
      a[i, 1 + keys.index((c.mode, c.batch))] = c.iterations
    call_s = max(float(np.linalg.lstsq(a, [c.seconds for c in known], rcond=None)[0][0]), 0.0)
  elif call_s is None:
    call_s = _fixed_point_call_s(steps, per_step_calls, ipc)
  per = {}
  for mode in ("plain", "sd"):
    if known:
      per[mode] = {b: max(float(np.median([(c.seconds - call_s) / c.iterations for c in known
                                           if c.mode == mode and c.batch == b])), 0.0)
                   for b in sorted({c.batch for c in known if c.mode == mode})}
    else:
      per[mode] = _median_per_iteration(calls, mode, call_s, ipc)
      _fill_from_totals(per_step_calls, steps, mode, per[mode], call_s)
  steady = [s for s in steps if s["step"] >= first] or steps
  mean = lambda f: float(np.mean([f(s) for s in steady]))  # noqa: E731
  model = make_costs(engine.ladder, [per["plain"].get(b, np.nan) for b in engine.ladder],
                     [per["sd"].get(b, np.nan) for b in engine.ladder], 1.0,
                     prefill_s=mean(lambda s: s["prefill_s"]), call_s=call_s)
  return model, {"update_s": mean(lambda s: s["update_s"]),
                 "other_s": mean(lambda s: s["step_s"] - s["rollout_s"] - s["update_s"])}


def rebuild_lengths(step: dict, calls: list[Call], costs: CostModel, engine: Engine
                    ) -> np.ndarray:
  """A plain rollout's response lengths [N] from its calls: the rows that left during a call
  ended evenly over its iterations (full calls ran iterations_per_call; the others the
  seconds they took, scaled so that the step's iterations add up)."""
  per = costs.measured("plain")
  iterations = [0.0 if c.mode == "prefill" else float(engine.iterations_per_call) if c.full
                else max((c.seconds - costs.call_s) / per[c.batch], 1.0) for c in calls]
  partial = [i for i, c in enumerate(calls) if c.mode != "prefill" and not c.full]
  if partial:
    fixed = sum(n for i, n in enumerate(iterations) if i not in partial)
    scale = max((step["plain_iterations"] - fixed) / sum(iterations[i] for i in partial), 0.0)
    for i in partial:
      iterations[i] *= scale
  lengths, done = [], 0.0
  for c, n in zip(calls, iterations):
    left = c.active - c.after if c.mode != "prefill" else 0
    lengths += [1 + int(round(done + n * (k + 1) / left)) for k in range(left)]
    done += n
  return np.asarray(lengths, np.int64)


# ---------------------------------------------------------------- the replay

@dataclasses.dataclass
class Calibration:
  """What a headline.json says: the engine, each variant's cost model and rest of a step, the
  steps' response lengths and TLT's accept length per step."""
  engine: Engine
  costs: dict
  rest: dict
  lengths: list
  accept: list
  steps: list


def calibrate(headline: dict) -> Calibration:
  engine, variants = engine_of(headline), headline["variants"]
  calls = {v: [calls_of(s, engine, v == "tlt") for s in variants[v]["steps"]] for v in variants}
  base, base_rest = fit_costs(variants["baseline"]["steps"], calls["baseline"], engine)
  tlt, tlt_rest = fit_costs(variants["tlt"]["steps"], calls["tlt"], engine,
                            call_s=None if any(c.iterations for cs in calls["tlt"] for c in cs)
                            else base.call_s)
  steps = variants["baseline"]["steps"]
  lengths = [np.asarray(s["lengths"]) if "lengths" in s else
             rebuild_lengths(s, cs, base, engine) for s, cs in zip(steps, calls["baseline"])]
  return Calibration(engine, {"baseline": base, "tlt": tlt},
                     {"baseline": base_rest, "tlt": tlt_rest}, lengths,
                     [s["accept_len"] or 1.0 for s in variants["tlt"]["steps"]],
                     [s["step"] for s in steps])


def replay_steps(cal: Calibration, lengths=None, accept=None, sd_threshold=None,
                 where_it_pays=False, tlt_costs: CostModel | None = None,
                 base_costs: CostModel | None = None, floors: tuple | None = None) -> dict:
  """Per step, the replayed rollout and step seconds of both variants, with the given changes
  (None: the run's); floors: the tuner's bucket floors, where a tail call ends (None: at
  every finished row, the engine before 2026-12-05). With the ratios over steps 2..N."""
  eng = cal.engine
  floor = None if floors is None else (lambda r: max(f for f in floors if f <= r))
  models = {"baseline": (base_costs or cal.costs["baseline"], 0, False, None),
            "tlt": (tlt_costs or cal.costs["tlt"], eng.sd_threshold if sd_threshold is None
                    else sd_threshold, where_it_pays, floor)}
  rows = []
  for i, step_lengths in enumerate(cal.lengths if lengths is None else lengths):
    acc = cal.accept[i % len(cal.accept)] if accept is None else accept
    row = {}
    for v, (costs, threshold, pays, choice_floor) in models.items():
      row[f"{v}_rollout_s"] = simulate_rollout(
          step_lengths, 1, eng.max_batch, costs.with_table(accept=acc) if threshold else costs,
          threshold, iterations_per_call=eng.iterations_per_call, batch_sizes=eng.batch_sizes,
          sd_where_it_pays=pays, choice_floor=choice_floor)["rollout_s"]
      row[f"{v}_step_s"] = (row[f"{v}_rollout_s"] + cal.rest[v]["update_s"]
                            + cal.rest[v]["other_s"])
    rows.append({k: row[k] for k in ("baseline_rollout_s", "tlt_rollout_s",
                                     "baseline_step_s", "tlt_step_s")})
  later = rows[1:] or rows  # step 1 holds compiles in a run
  total = lambda k: sum(r[k] for r in later)  # noqa: E731
  return {"steps": rows, "step_ratio": total("baseline_step_s") / total("tlt_step_s"),
          "rollout_ratio": total("baseline_rollout_s") / total("tlt_rollout_s")}


def validate(headline: dict, cal: Calibration) -> dict:
  """The replay of the run against what it measured, per step and in the steady state."""
  got, measured = replay_steps(cal), headline["steady_state"]
  per_step = [{"step": n, **{k: round(v, 4) for k, v in r.items()},
               **{f"measured_{v}_rollout_s": headline["variants"][v]["steps"][i]["rollout_s"]
                  for v in ("baseline", "tlt")}}
              for i, (n, r) in enumerate(zip(cal.steps, got["steps"]))]
  return {"replayed_step_ratio": got["step_ratio"], "measured_step_ratio": measured["step_ratio"],
          "replayed_rollout_ratio": got["rollout_ratio"],
          "measured_rollout_ratio": measured["rollout_ratio"],
          "error": got["step_ratio"] - measured["step_ratio"], "steps": per_step}


# ---------------------------------------------------------------- what if

# Program batches of the running-row buckets experiments/tail_accept.py reports.
BUCKET_BATCH = {"1": 1, "2-8": 8, "9-32": 32, ">=33": 128}


def accept_by_batch(tail_accept: dict, label: str, strategy: str) -> dict:
  """{program batch: accept length} of one variant and strategy of a tail_accept.json (a
  bucket it has no iterations in takes the tail's)."""
  try:
    row = tail_accept["variants"][label][strategy]
  except KeyError:
    have = {k: list(v) for k, v in tail_accept.get("variants", {}).items()}
    raise SystemExit(f"tail_accept.json has no {label!r} / {strategy!r}; it has {have}") from None
  out = {BUCKET_BATCH[k]: v["accept"] for k, v in row["buckets"].items() if k in BUCKET_BATCH}
  return {b: out.get(b, row["tail"]) for b in BUCKET_BATCH.values()}


def project(cal: Calibration, lengths=None, accept=None, depth: int | None = None,
            ref_depth: float = 6.0, floors: tuple = (1, 2, 9, 33),
            target: float = 1.6) -> dict:
  """The run replayed with changes added one at a time (each row keeps the ones above): the
  responses' lengths, the accept lengths, tail calls that run to their tuner bucket's end
  (`floors`), SD at any row count where it pays, then the cuts of the per-call and
  per-iteration costs that a fast baseline aims at. An arm of another depth costs the run's
  SD iteration plus (depth - ref_depth) drafter passes, a pass being the run's one-row SD
  iteration over a plain step divided by ref_depth + 1 (the verify counted as one); SD at
  128 rows, which the run never measured, costs the 32-row SD/plain ratio times the 128-row
  plain step (the cost model's rule), with a bound row at the 1-row ratio. Returns {"rows",
  "needed": what one cost must fall to for `target` with the changes that need no faster
  step}."""
  eng, base, tlt = cal.engine, cal.costs["baseline"], cal.costs["tlt"]
  plain, sd_run = base.measured("plain"), tlt.measured("sd")
  pass_s = max(sd_run.get(1, plain[1]) - plain[1], 0.0) / (ref_depth + 1)
  rows, state = [], {"tlt_costs": tlt}

  def row(label, assumes, changed, bound=False):
    got = replay_steps(cal, **changed)
    mean = lambda k: float(np.mean([r[k] for r in got["steps"]]))  # noqa: E731
    rows.append({"change": label, "assumes": assumes, "bound": bound,
                 "step_ratio": got["step_ratio"], "rollout_ratio": got["rollout_ratio"],
                 "baseline_step_s": mean("baseline_step_s"), "tlt_step_s": mean("tlt_step_s")})

  def add(label, assumes, **change):
    state.update(change)
    row(label, assumes, state)

  add("the run as it was", "the run's costs, lengths and accept length per step")
  if lengths is not None:
    add("the new task's response lengths", "CPU-sampled responses grouped into steps",
        lengths=lengths)
  if accept is not None:
    extra = (depth or ref_depth) - ref_depth
    add("the new drafter and arm", f"accept per running-row bucket measured on CPU "
        f"(teacher-forced); SD iteration +{extra:g} drafter passes of {pass_s * 1e3:.2f} ms",
        accept=accept, tlt_costs=tlt.with_table(sd={b: s + extra * pass_s
                                                    for b, s in sd_run.items()}))
  add("tail calls run to their bucket's end", f"a tail call ends where the rows leave the "
      f"tuner's bucket {tuple(floors)} or the program batch, not at each finished row",
      floors=tuple(floors))
  add("SD wherever it pays (any row count)", "SD at 128 rows costs the 32-row SD/plain ratio "
      "times the 128-row plain step", sd_threshold=eng.max_batch, where_it_pays=True)
  reached, sd_now = dict(state), state["tlt_costs"].measured("sd")
  ratio_1 = sd_now.get(1, plain[1]) / plain[1]
  row("SD wherever it pays, dearer at 128 rows", f"SD at 128 rows costs {ratio_1:.2f} plain "
      f"steps (the 1-row ratio); not carried below",
      dict(state, tlt_costs=state["tlt_costs"].with_table(
          sd={eng.max_batch: plain[eng.max_batch] * ratio_1})), bound=True)
  add("decode calls cost 1 ms each", f"per-call cost {tlt.call_s * 1e3:.1f} -> 1 ms",
      base_costs=base.with_table(call_s=1e-3),
      tlt_costs=state["tlt_costs"].with_table(call_s=1e-3))
  flat = {b: min(s, 2 * plain[1]) for b, s in plain.items()}
  add("a plain step flat in rows, an SD iteration <= 1.3 steps",
      "plain at any batch <= 2x the 1-row step; SD <= 1.3 plain steps at its batch",
      base_costs=state["base_costs"].with_table(plain=flat),
      tlt_costs=state["tlt_costs"].with_table(
          plain=flat, sd={b: min(s, 1.3 * flat.get(b, plain[1])) for b, s in sd_now.items()}))
  return {"rows": rows, "needed": needed(cal, reached, target)}


def needed(cal: Calibration, state: dict, target: float) -> dict:
  """What one cost must fall to for `state`'s replay to reach `target`, each alone: the
  per-call seconds (both variants), and TLT's SD seconds per iteration (as a fraction of
  what `state` has); bisection, None where even zero does not reach it."""
  base, tlt = state.get("base_costs", cal.costs["baseline"]), state["tlt_costs"]
  sd = tlt.measured("sd")
  levers = {
      "call_ms": (tlt.call_s * 1e3, lambda v: dict(
          state, base_costs=base.with_table(call_s=v / 1e3),
          tlt_costs=tlt.with_table(call_s=v / 1e3))),
      "sd_iteration_fraction": (1.0, lambda v: dict(
          state, tlt_costs=tlt.with_table(sd={b: s * v for b, s in sd.items()}))),
  }
  out = {"target": target, "ratio_now": replay_steps(cal, **state)["step_ratio"]}
  for name, (now, change) in levers.items():
    ratio = lambda v, change=change: replay_steps(cal, **change(v))["step_ratio"]  # noqa: E731
    if out["ratio_now"] >= target:
      out[name] = {"now": now, "needed": now}
      continue
    value = None
    if ratio(0.0) >= target:
      low, high = 0.0, now
      for _ in range(20):
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) >= target else (low, mid)
      value = low
    out[name] = {"now": now, "needed": value, "at_zero": ratio(0.0)}
  return out


def costs_record(costs: CostModel, rest: dict) -> dict:
  """A variant's cost model as replay.json writes it (milliseconds, measured entries)."""
  per = {m: {str(b): round(s * 1e3, 4) for b, s in costs.measured(m).items()}
         for m in ("plain", "sd")}
  return {"per_iteration_ms": {m: v for m, v in per.items() if v},
          "call_ms": costs.call_s * 1e3, "prefill_ms": costs.prefill_s * 1e3, **rest}


# ---------------------------------------------------------------- a CPU run

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


def _run_rows(run_dir: str, name: str, need: tuple, hint: str) -> list[dict]:
  rows = read_json(os.path.join(run_dir, name), name, lines=True, hint=hint)
  missing = sorted({k for r in rows for k in need if k not in r})
  if not rows or missing:
    raise ValueError(f"{name} in {run_dir!r} is empty or lacks keys {missing}; {hint}")
  return rows


def compare_with_run(run_dir: str, num_slices: int | None = None, max_batch: int | None = None,
                     sd_threshold: int | None = None, max_compile_share: float = 0.1) -> dict:
  """Simulated against measured idle slice-seconds for every step of a single-machine run.

  A CPU run records no calls, only each step's totals (RUN/metrics.jsonl: rollout_s,
  idle_slice_s, compile_s, sd_enabled, sd_accept_len_mean) and responses (RUN/rollouts.jsonl,
  each one's tokens). Each step's lengths are replayed in request order and the cost model
  fitted by non-negative least squares: seconds per plain iteration (fixed + per row of the
  program batch), per SD iteration (at the step's accept length) and per prefill call. Each
  schedule is fitted on what it determines exactly: "parallel" on busy slice-seconds (slices *
  rollout_s - idle_slice_s), "interleaved" on rollout_s; the idle time is then a prediction.
  Steps whose compile_s exceeds max_compile_share of rollout_s are left out of the fit
  (compiling is in rollout_s, not in the model).

  Returns {"settings", "iterations_per_call", "steps": [{step, measured_idle_slice_s,
  measured_rollout_s, used_in_fit, <schedule>_idle_slice_s, <schedule>_rollout_s}], "fit":
  {schedule: costs}, "totals": {measured and simulated idle slice-seconds}}.
  """
  from scipy.optimize import nnls
  hint = "write it with `python -m tlt_jax.train ... --config.rl.save_rollouts=True`"
  metrics = _run_rows(run_dir, "metrics.jsonl", ("step", "rollout_s", "idle_slice_s"),
                      "pass a run's workdir")
  rollouts = _run_rows(run_dir, "rollouts.jsonl", ("step", "prompt", "sample", "tokens"), hint)
  settings, iterations_per_call = run_settings(run_dir, num_slices=num_slices,
                                               max_batch=max_batch, sd_threshold=sd_threshold)
  by_step: dict[int, list] = {}
  for r in rollouts:
    by_step.setdefault(int(r["step"]), []).append((r["prompt"], r["sample"], r["tokens"]))
  steps = [m for m in metrics if int(m["step"]) in by_step]
  if not steps:
    raise ValueError(f"no step of {run_dir!r}/metrics.jsonl has responses in rollouts.jsonl; "
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


# ---------------------------------------------------------------- the command

def plot(result: dict, path: pathlib.Path) -> None:
  """replay.png: the replay against the run per step, and the projected ratios."""
  plt = pyplot()
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
  val = result["validation"]
  x = [s["step"] for s in val["steps"]]
  for v, color in (("baseline", "#7f8c8d"), ("tlt", "#c0392b")):
    for key, style, how in ((f"measured_{v}_rollout_s", "o-", "measured"),
                            (f"{v}_rollout_s", "x--", "replayed")):
      a.plot(x, [s[key] for s in val["steps"]], style, color=color, label=f"{v}, {how}")
  a.set(xlabel="RL step", ylabel="rollout seconds")
  a.set_title(f"replay vs run: step ratio {val['replayed_step_ratio']:.2f}x vs "
              f"{val['measured_step_ratio']:.2f}x", fontsize=9)
  a.legend(fontsize=7)
  rows = result["projection"]["rows"]
  b.barh(range(len(rows)), [r["step_ratio"] for r in rows],
         color=["#aab7c4" if r.get("bound") else "#2e86c1" for r in rows])
  for i, r in enumerate(rows):
    b.text(r["step_ratio"], i, f" {r['step_ratio']:.2f}x", va="center", fontsize=8)
  b.set_yticks(range(len(rows)))
  b.set_yticklabels([r["change"] for r in rows], fontsize=7)
  b.invert_yaxis()
  b.axvline(result["projection"]["needed"]["target"], color="#999", lw=0.8, ls=":")
  b.set_xlabel("projected step ratio (each row adds to those above; grey: a bound)")
  save_figure(fig, path)


def plot_run(result: dict, path: pathlib.Path) -> None:
  """compare.png: measured and simulated idle slice-seconds per step."""
  fig, ax = pyplot().subplots(figsize=(7, 3.4), dpi=110)
  for key, style, label in (("measured", "ko-", "measured"),
                            ("interleaved", "s--", "simulated, interleaved"),
                            ("parallel", "^:", "simulated, parallel")):
    ax.plot([s["step"] for s in result["steps"]],
            [s[f"{key}_idle_slice_s"] for s in result["steps"]], style, label=label)
  ax.set(xlabel="RL step", ylabel="idle slice-seconds")
  ax.legend(fontsize=8)
  save_figure(fig, path)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--headline", type=pathlib.Path,
                      help="a headline.json of experiments/gpu_headline.py run")
  source.add_argument("--run", type=pathlib.Path,
                      help="a run's workdir (metrics.jsonl, rollouts.jsonl)")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--lengths", type=pathlib.Path,
                      help="responses.jsonl whose lengths replace the run's")
  parser.add_argument("--accept", type=pathlib.Path, help="a tail_accept.json")
  parser.add_argument("--variant", default="config", help="its drafter variant")
  parser.add_argument("--strategy", help="its strategy (the arm to project)")
  for flag in ("--num-slices", "--max-batch", "--sd-threshold"):
    parser.add_argument(flag, type=int, help="with --run: the run's (default: its summary.json)")
  args = parser.parse_args(argv)
  if args.out.exists() and not args.out.is_dir():
    sys.exit(f"--out {args.out} is a file; give a folder")
  if args.run:
    try:
      result = compare_with_run(str(args.run), args.num_slices, args.max_batch,
                                args.sd_threshold)
    except (ValueError, FileNotFoundError) as e:
      sys.exit(f"error: {e}")
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "compare.json", result)
    plot_run(result, args.out / "compare.png")
    print(json.dumps({"settings": result["settings"], "totals": result["totals"]}))
    return
  if not args.headline.is_file():
    sys.exit(f"--headline {args.headline}: no such file")
  if args.accept and not args.strategy:
    sys.exit("--accept needs --strategy (the arm whose accept lengths to use)")
  headline = json.loads(args.headline.read_text())
  cal = calibrate(headline)
  lengths = accept = depth = None
  if args.lengths:  # consecutive steps of max_batch responses (a short last one dropped)
    every, n = load_lengths(args.lengths), cal.engine.max_batch
    lengths = [every[i:i + n] for i in range(0, len(every) - n + 1, n)]
    if not lengths:
      sys.exit(f"--lengths {args.lengths} holds fewer than one step of {n} responses")
  if args.accept:
    accept = accept_by_batch(json.loads(args.accept.read_text()), args.variant, args.strategy)
    depth = int(args.strategy.split(",")[0])
  result = {"what": "a what-if replay of the GPU headline (experiments/replay.py)",
            **run_stamp(), "headline": str(args.headline),
            "device": headline.get("device"), "engine": dataclasses.asdict(cal.engine),
            "costs": {v: costs_record(c, cal.rest[v]) for v, c in cal.costs.items()},
            "validation": validate(headline, cal),
            "projection": project(cal, lengths, accept, depth)}
  args.out.mkdir(parents=True, exist_ok=True)
  write_json(args.out / "replay.json", result)
  plot(result, args.out / "replay.png")
  val, need = result["validation"], result["projection"]["needed"]
  print(f"replay of {args.headline}: step ratio {val['replayed_step_ratio']:.3f}x against "
        f"{val['measured_step_ratio']:.3f}x measured (rollout {val['replayed_rollout_ratio']:.3f}x "
        f"against {val['measured_rollout_ratio']:.3f}x)")
  for row in result["projection"]["rows"]:
    print(f"  {row['step_ratio']:.2f}x  {row['change']}  ({row['assumes']})")
  if need["ratio_now"] >= need["target"]:
    print(f"  {need['target']}x is reached before a faster step ({need['ratio_now']:.2f}x)")
  for name in ("call_ms", "sd_iteration_fraction"):
    if need["ratio_now"] < need["target"]:
      got = need[name]["needed"]
      print(f"  for {need['target']}x before a faster step: {name} {need[name]['now']:.3g} -> "
            f"{'unreachable' if got is None else format(got, '.3g')}")
  print(f"wrote {args.out / 'replay.json'}")


if __name__ == "__main__":
  main()
