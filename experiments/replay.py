"""A what-if replay of the GPU headline: a run's measured costs through the engine's own
scheduler (`experiments/simulate_cluster.py`'s rollout model), checked against the run it came
from, then with one change at a time: other response lengths, accept lengths, SD at other row
counts, cheaper calls or steps.

  python -m experiments.replay --headline docs/results/gpu_h200_2026-12-04/tf32/headline.json \
      --out docs/results/replay
  python -m experiments.replay --headline .../headline.json --out results/replay \
      --lengths results/tail/responses.jsonl --accept results/tail/tail_accept.json \
      --strategy 6,4,32,eagle+suffix

The costs: each (mode, program batch)'s seconds per iteration and every decode call's fixed
seconds. A headline.json written since `run` records its calls' iterations gives them by least
squares; an earlier one (2026-12-04) records when each call began and how many rows ran, so
they come from the calls that ran all their iterations (no row left the program's range) and
the step's total iterations, which fix the rest. Response lengths: the run's own (recorded, or
for an earlier run rebuilt from the baseline's calls: the rows that ended in a call ended
within its iterations), or a responses file's. The update and the rest of a step, and SD's
accept length per step, are the run's.

Writes OUT/replay.json (the costs, the replay of every step against the run, the projected
ratios of each change) and OUT/replay.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

from . import simulate_cluster as sim
from .common import run_stamp, write_json
from tlt_jax.rollout.scheduler import batch_ladder, bucket

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

  def batch_for(self, rows: int) -> int:
    return bucket(rows, self.max_batch, self.ladder)

  def min_running(self, batch: int, speculative: bool) -> int:
    """The scheduler's stop rule for a call at `batch` outside the tail (see
    `SliceScheduler._decode`)."""
    smaller = [b for b in self.ladder if b < batch]
    low = max(smaller, default=0) + 1
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
    end = step["rollout_s"] if last else rows[i + 1][0]
    after = 0 if last else rows[i + 1][1]
    batch = engine.batch_for(active)
    tail = speculative and active <= engine.sd_threshold
    if mode == "prefill":
      full = False
    elif tail:  # a tail call stops when a row finishes
      full = not last and after == active
    else:       # elsewhere when the rows fall out of the program's range
      full = not last and after >= engine.min_running(batch, speculative)
    out.append(Call(mode, active, after, batch, end - t,
                    0.0 if mode == "prefill" else None, full))
  return out


@dataclasses.dataclass
class Costs:
  """One variant's fitted costs: seconds per iteration by (mode, program batch), per call,
  per prefill call; the update and the rest of a step (means over the steady steps)."""
  per_iteration: dict        # mode -> {batch: seconds}
  call_s: float
  prefill_s: float
  update_s: float
  other_s: float

  def to_dict(self) -> dict:
    return {"per_iteration_ms": {m: {str(b): round(s * 1e3, 4) for b, s in v.items()}
                                 for m, v in self.per_iteration.items()},
            "call_ms": self.call_s * 1e3, "prefill_ms": self.prefill_s * 1e3,
            "update_s": self.update_s, "other_s": self.other_s}


def _median_per_iteration(calls, mode, call_s, ipc) -> dict:
  out = {}
  for b in sorted({c.batch for c in calls if c.mode == mode}):
    full = [c.seconds for c in calls if c.mode == mode and c.batch == b and c.full]
    if full:
      out[b] = max(float(np.median(full)) - call_s, 0.0) / ipc
  return out


def _fill_from_totals(per_step_calls, steps, mode, per_iteration, call_s) -> None:
  """Batches of `mode` with no full call: the seconds per iteration that make each step's
  calls add up to its recorded iterations (the median over steps)."""
  key = f"{mode}_iterations"
  missing = sorted({c.batch for calls in per_step_calls for c in calls
                    if c.mode == mode and c.batch not in per_iteration})
  for b in missing:
    values = []
    for calls, step in zip(per_step_calls, steps):
      ours = [c for c in calls if c.mode == mode]
      known = sum((c.seconds - call_s) / per_iteration[c.batch] for c in ours
                  if c.batch in per_iteration)
      unknown = [c for c in ours if c.batch == b]
      rest = step[key] - known
      if unknown and rest > 0:
        values.append(sum(c.seconds - call_s for c in unknown) / rest)
    if values:
      per_iteration[b] = float(np.median(values))


def fit_costs(steps: list[dict], per_step_calls: list[list[Call]], engine: Engine,
              call_s: float | None = None, first: int = 2) -> Costs:
  """A variant's costs (see the module docstring). call_s: given (the baseline's, for TLT),
  or fitted: with recorded iterations by least squares, else from the plain calls that did
  not run all their iterations, whose iterations the step's total fixes."""
  ipc = engine.iterations_per_call
  calls = [c for cs in per_step_calls for c in cs]
  known = [c for c in calls if c.iterations]
  if call_s is None and known:  # seconds = call_s + per_iteration[mode, batch] * iterations
    keys = sorted({(c.mode, c.batch) for c in known})
    a = np.zeros((len(known), 1 + len(keys)))
    a[:, 0] = 1.0
    for i, c in enumerate(known):
      a[i, 1 + keys.index((c.mode, c.batch))] = c.iterations
    solution = np.linalg.lstsq(a, np.asarray([c.seconds for c in known]), rcond=None)[0]
    call_s = max(float(solution[0]), 0.0)
  if call_s is None:
    call_s = 0.0
    for _ in range(20):  # a fixed point: the full calls' costs need call_s and vice versa
      per = _median_per_iteration(calls, "plain", call_s, ipc)
      estimates = []
      for cs, step in zip(per_step_calls, steps):
        partial = [c for c in cs if c.mode == "plain" and not c.full]
        rest = step["plain_iterations"] - ipc * sum(c.mode == "plain" and c.full for c in cs)
        inverse = sum(1.0 / per[c.batch] for c in partial if c.batch in per)
        if partial and inverse:
          estimates.append((sum(c.seconds / per[c.batch] for c in partial) - rest) / inverse)
      call_s = max(float(np.median(estimates)), 0.0) if estimates else 0.0
  per_iteration = {}
  for mode in ("plain", "sd"):
    if known:
      per = {}
      for b in sorted({c.batch for c in known if c.mode == mode}):
        ours = [c for c in known if c.mode == mode and c.batch == b]
        per[b] = max(float(np.median([(c.seconds - call_s) / c.iterations for c in ours])), 0.0)
    else:
      per = _median_per_iteration(calls, mode, call_s, ipc)
      _fill_from_totals(per_step_calls, steps, mode, per, call_s)
    if per:
      per_iteration[mode] = per
  steady = [s for s in steps if s["step"] >= first] or steps
  return Costs(per_iteration, call_s,
               prefill_s=float(np.mean([s["prefill_s"] for s in steady])),
               update_s=float(np.mean([s["update_s"] for s in steady])),
               other_s=float(np.mean([s["step_s"] - s["rollout_s"] - s["update_s"]
                                      for s in steady])))


def rebuild_lengths(step: dict, calls: list[Call], costs: Costs, engine: Engine) -> np.ndarray:
  """A plain rollout's response lengths from its calls: the rows that left during a call
  ended evenly over its iterations (full calls ran iterations_per_call; the others the
  seconds they took, scaled so that the step's iterations add up)."""
  per = costs.per_iteration["plain"]
  iterations = [0.0 if c.mode == "prefill" else float(engine.iterations_per_call) if c.full
                else max((c.seconds - costs.call_s) / per[c.batch], 1.0) for c in calls]
  partial = [i for i, c in enumerate(calls) if c.mode != "prefill" and not c.full]
  fixed = sum(n for i, n in enumerate(iterations) if i not in partial)
  if partial:
    scale = (step["plain_iterations"] - fixed) / sum(iterations[i] for i in partial)
    for i in partial:
      iterations[i] *= max(scale, 0.0)
  lengths, done = [], 0.0
  for c, n in zip(calls, iterations):
    left = c.active - c.after if c.mode != "prefill" else 0
    lengths += [1 + int(round(done + n * (k + 1) / left)) for k in range(left)]
    done += n
  return np.asarray(lengths, np.int64)


def cost_model(costs: Costs, engine: Engine, accept: float | dict, sd: Costs | None = None,
               source: str = "") -> sim.CostModel:
  """The simulator's table at the program batches: plain from `costs`, SD from `sd` (TLT's;
  a batch it never ran at takes the nearest one it did, scaled by the plain steps' ratio),
  accept one number or {batch: accept}."""
  ladder = engine.ladder
  plain = [costs.per_iteration["plain"][b] for b in ladder]
  sd_per = (sd or costs).per_iteration.get("sd", {})
  sd_s = []
  for b, p in zip(ladder, plain):
    if b in sd_per:
      sd_s.append(sd_per[b])
    elif sd_per:
      near = min(sd_per, key=lambda x: abs(np.log(x / b)))
      sd_s.append(sd_per[near] * p / costs.per_iteration["plain"][near])
    else:
      sd_s.append(p)
  acc = [accept.get(b, max(accept.values())) if isinstance(accept, dict) else accept
         for b in ladder]
  return sim.make_costs(ladder, plain, sd_s, acc, prefill_s=costs.prefill_s, source=source,
                        call_s=(sd or costs).call_s if sd else costs.call_s)


def rollout_s(lengths, model: sim.CostModel, engine: Engine, sd_threshold: int,
              where_it_pays: bool = False, floors: tuple | None = None) -> float:
  """One replayed rollout's seconds. floors: the tuner's bucket thresholds, where a tail
  call ends (`SliceScheduler`'s choice_floor); None: at every finished row (the engine
  before 2026-12-05)."""
  floor = None if floors is None else (lambda r: max(f for f in floors if f <= r))
  return sim.simulate_rollout(lengths, 1, engine.max_batch, model, sd_threshold,
                              iterations_per_call=engine.iterations_per_call,
                              batch_sizes=engine.batch_sizes,
                              sd_where_it_pays=where_it_pays,
                              choice_floor=floor)["rollout_s"]


@dataclasses.dataclass
class Calibration:
  """What a headline.json says: the engine, each variant's costs, the steps' response lengths
  and TLT's accept length per step."""
  engine: Engine
  costs: dict
  lengths: list
  accept: list
  steps: list


def calibrate(headline: dict) -> Calibration:
  engine = engine_of(headline)
  variants = headline["variants"]
  calls = {v: [calls_of(s, engine, v == "tlt") for s in variants[v]["steps"]] for v in variants}
  base = fit_costs(variants["baseline"]["steps"], calls["baseline"], engine)
  tlt = fit_costs(variants["tlt"]["steps"], calls["tlt"], engine,
                  call_s=None if any(c.iterations for cs in calls["tlt"] for c in cs)
                  else base.call_s)
  steps = variants["baseline"]["steps"]
  lengths = [np.asarray(s["lengths"]) if "lengths" in s else
             rebuild_lengths(s, cs, base, engine) for s, cs in zip(steps, calls["baseline"])]
  accept = [s["accept_len"] or 1.0 for s in variants["tlt"]["steps"]]
  return Calibration(engine, {"baseline": base, "tlt": tlt}, lengths, accept,
                     [s["step"] for s in steps])


def replay_steps(cal: Calibration, lengths=None, accept=None, sd_threshold=None,
                 where_it_pays=False, tlt_costs: Costs | None = None,
                 base_costs: Costs | None = None, floors: tuple | None = None) -> dict:
  """Per step, the replayed rollout and step seconds of both variants, with the given
  changes (None: the run's)."""
  eng = cal.engine
  lengths = cal.lengths if lengths is None else lengths
  base_c, tlt_c = base_costs or cal.costs["baseline"], tlt_costs or cal.costs["tlt"]
  threshold = eng.sd_threshold if sd_threshold is None else sd_threshold
  rows = []
  for i, step_lengths in enumerate(lengths):
    acc = cal.accept[i % len(cal.accept)] if accept is None else accept
    plain = cost_model(base_c, eng, 1.0)
    spec = cost_model(tlt_c, eng, acc, sd=tlt_c)
    b = rollout_s(step_lengths, plain, eng, 0)
    t = rollout_s(step_lengths, spec, eng, threshold, where_it_pays, floors)
    rows.append({"baseline_rollout_s": b, "tlt_rollout_s": t,
                 "baseline_step_s": b + base_c.update_s + base_c.other_s,
                 "tlt_step_s": t + tlt_c.update_s + tlt_c.other_s})
  return {"steps": rows, **ratios(rows)}


def ratios(rows: list[dict], first: int = 1) -> dict:
  """Baseline / TLT over rows[first:] (steps 2..N: step 1 holds compiles in a run)."""
  rows = rows[first:] or rows
  total = lambda k: sum(r[k] for r in rows)  # noqa: E731
  return {"step_ratio": total("baseline_step_s") / total("tlt_step_s"),
          "rollout_ratio": total("baseline_rollout_s") / total("tlt_rollout_s")}


def validate(headline: dict, cal: Calibration) -> dict:
  """The replay of the run against what it measured, per step and in the steady state."""
  got = replay_steps(cal)
  measured = headline["steady_state"]
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
  for b in BUCKET_BATCH.values():
    out.setdefault(b, row["tail"])
  return out


def steps_of(lengths: np.ndarray, per_step: int) -> list[np.ndarray]:
  """Consecutive groups of `per_step` responses (the last one dropped when short)."""
  return [lengths[i:i + per_step] for i in range(0, len(lengths) - per_step + 1, per_step)]


def with_costs(costs: Costs, scale: dict | None = None, call_s: float | None = None) -> Costs:
  """`costs` with per-iteration seconds replaced ({mode: {batch: seconds}}) and call_s."""
  per = {m: dict(v) for m, v in costs.per_iteration.items()}
  for mode, table in (scale or {}).items():
    per.setdefault(mode, {}).update(table)
  return dataclasses.replace(costs, per_iteration=per,
                             call_s=costs.call_s if call_s is None else call_s)


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
  plain step, with a bound row at the 1-row ratio. Assumptions are stated in their rows.
  Returns {"rows": ..., "needed": what one cost must fall to for `target` with the changes
  that need no faster step (`needed`)}."""
  eng, base, tlt = cal.engine, cal.costs["baseline"], cal.costs["tlt"]
  plain = base.per_iteration["plain"]
  sd_run = tlt.per_iteration.get("sd", {})
  pass_s = max(sd_run.get(1, plain[1]) - plain[1], 0.0) / (ref_depth + 1)
  rows, state = [], {"tlt_costs": tlt}

  def row(label, assumes, changed, bound=False):
    got = replay_steps(cal, **changed)
    rows.append({"change": label, "assumes": assumes, "bound": bound,
                 "step_ratio": got["step_ratio"], "rollout_ratio": got["rollout_ratio"],
                 "baseline_step_s": float(np.mean([r["baseline_step_s"] for r in got["steps"]])),
                 "tlt_step_s": float(np.mean([r["tlt_step_s"] for r in got["steps"]]))})

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
        accept=accept, tlt_costs=with_costs(tlt, {"sd": {b: s + extra * pass_s
                                                         for b, s in sd_run.items()}}))
  add("tail calls run to their bucket's end", f"a tail call ends where the rows leave the "
      f"tuner's bucket {tuple(floors)} or the program batch, not at each finished row",
      floors=tuple(floors))
  add("SD wherever it pays (any row count)", "SD at 128 rows costs the 32-row SD/plain ratio "
      "times the 128-row plain step", sd_threshold=eng.max_batch, where_it_pays=True)
  reached = dict(state)
  sd_now = state["tlt_costs"].per_iteration.get("sd", {})
  ratio_1 = sd_now.get(1, plain[1]) / plain[1]
  row("SD wherever it pays, dearer at 128 rows", f"SD at 128 rows costs {ratio_1:.2f} plain "
      f"steps (the 1-row ratio); not carried below",
      dict(state, tlt_costs=with_costs(state["tlt_costs"], {"sd": {
          eng.max_batch: plain[eng.max_batch] * ratio_1}})), bound=True)
  cheap_call = 1e-3
  add("decode calls cost 1 ms each", f"per-call cost {tlt.call_s * 1e3:.1f} -> 1 ms",
      base_costs=with_costs(base, call_s=cheap_call),
      tlt_costs=with_costs(state["tlt_costs"], call_s=cheap_call))
  flat = {b: min(s, 2 * plain[1]) for b, s in plain.items()}
  add("a plain step flat in rows, an SD iteration <= 1.3 steps",
      "plain at any batch <= 2x the 1-row step; SD <= 1.3 plain steps at its batch",
      base_costs=with_costs(state["base_costs"], {"plain": flat}),
      tlt_costs=with_costs(state["tlt_costs"], {
          "plain": flat,
          "sd": {b: min(s, 1.3 * flat.get(b, plain[1])) for b, s in sd_now.items()}}))
  return {"rows": rows, "needed": needed(cal, reached, target)}


def needed(cal: Calibration, state: dict, target: float) -> dict:
  """What one cost must fall to for `state`'s replay to reach `target`, each alone: the
  per-call seconds (both variants), and TLT's SD seconds per iteration (as a fraction of
  what `state` has); bisection, None where even zero does not reach it."""
  base, tlt = state.get("base_costs", cal.costs["baseline"]), state["tlt_costs"]
  sd = tlt.per_iteration.get("sd", {})
  levers = {
      "call_ms": (tlt.call_s * 1e3, lambda v: dict(
          state, base_costs=with_costs(base, call_s=v / 1e3),
          tlt_costs=with_costs(tlt, call_s=v / 1e3))),
      "sd_iteration_fraction": (1.0, lambda v: dict(
          state, tlt_costs=with_costs(tlt, {"sd": {b: s * v for b, s in sd.items()}}))),
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


def read_lengths(path: pathlib.Path) -> np.ndarray:
  """Response lengths of a responses.jsonl (experiments/tail_accept.py's, or a lease's)."""
  rows = [json.loads(line) for line in open(path)]
  if not rows or "completion" not in rows[0]:
    raise SystemExit(f"{path}: expected JSON lines with a 'completion' (token ids)")
  return np.asarray([len(r["completion"]) for r in rows], np.int64)


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4), dpi=100)
  steps = result["validation"]["steps"]
  x = [s["step"] for s in steps]
  for v, color in (("baseline", "#7f8c8d"), ("tlt", "#c0392b")):
    a.plot(x, [s[f"measured_{v}_rollout_s"] for s in steps], "o-", color=color,
           label=f"{v}, measured")
    a.plot(x, [s[f"{v}_rollout_s"] for s in steps], "x--", color=color, label=f"{v}, replayed")
  a.set_xlabel("RL step")
  a.set_ylabel("rollout seconds")
  val = result["validation"]
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
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--headline", type=pathlib.Path, required=True,
                      help="a headline.json of experiments/gpu_headline.py run")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  parser.add_argument("--lengths", type=pathlib.Path,
                      help="responses.jsonl whose lengths replace the run's")
  parser.add_argument("--accept", type=pathlib.Path, help="a tail_accept.json")
  parser.add_argument("--variant", default="config", help="its drafter variant")
  parser.add_argument("--strategy", help="its strategy (the arm to project)")
  args = parser.parse_args(argv)
  if not args.headline.is_file():
    sys.exit(f"--headline {args.headline}: no such file")
  if args.out.exists() and not args.out.is_dir():
    sys.exit(f"--out {args.out} is a file; give a folder")
  headline = json.loads(args.headline.read_text())
  cal = calibrate(headline)
  lengths = accept = depth = None
  if args.lengths:
    lengths = steps_of(read_lengths(args.lengths), cal.engine.max_batch)
    if not lengths:
      sys.exit(f"--lengths {args.lengths} holds fewer than one step of "
               f"{cal.engine.max_batch} responses")
  if args.accept:
    if not args.strategy:
      sys.exit("--accept needs --strategy (the arm whose accept lengths to use)")
    accept = accept_by_batch(json.loads(args.accept.read_text()), args.variant, args.strategy)
    depth = int(args.strategy.split(",")[0])
  result = {"what": "a what-if replay of the GPU headline (experiments/replay.py)",
            **run_stamp(), "headline": str(args.headline),
            "device": headline.get("device"), "engine": dataclasses.asdict(cal.engine),
            "costs": {v: c.to_dict() for v, c in cal.costs.items()},
            "validation": validate(headline, cal),
            "projection": project(cal, lengths, accept, depth)}
  args.out.mkdir(parents=True, exist_ok=True)
  write_json(args.out / "replay.json", result)
  plot(result, args.out / "replay.png")
  val = result["validation"]
  print(f"replay of {args.headline}: step ratio {val['replayed_step_ratio']:.3f}x against "
        f"{val['measured_step_ratio']:.3f}x measured (rollout {val['replayed_rollout_ratio']:.3f}x "
        f"against {val['measured_rollout_ratio']:.3f}x)")
  for row in result["projection"]["rows"]:
    print(f"  {row['step_ratio']:.2f}x  {row['change']}  ({row['assumes']})")
  need = result["projection"]["needed"]
  for name, lever in need.items():
    if isinstance(lever, dict) and need["ratio_now"] < need["target"]:
      print(f"  for {need['target']}x before a faster step: {name} {lever['now']:.3g} -> "
            f"{'unreachable' if lever['needed'] is None else format(lever['needed'], '.3g')}")
  if need["ratio_now"] >= need["target"]:
    print(f"  {need['target']}x is reached before a faster step ({need['ratio_now']:.2f}x)")
  print(f"wrote {args.out / 'replay.json'}")


if __name__ == "__main__":
  main()
