"""A what-if replay of the GPU headline: a run's measured costs, as the rollout cost model
(`experiments.rollout_model`), through the engine's own scheduler, checked against the run it
came from, then with one change at a time: other response lengths, accept lengths, SD at other
row counts, cheaper calls or steps.

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

from tlt_jax.rollout.scheduler import batch_ladder, bucket

from .common import run_stamp, write_json
from .rollout_model import CostModel, load_lengths, make_costs, simulate_rollout

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
  rest of its step ({update_s, other_s}, means over steps >= first). call_s: given (the
  baseline's, for TLT's old records), else fitted (module docstring)."""
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


def plot(result: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
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
  for name, lever in need.items():
    if isinstance(lever, dict) and need["ratio_now"] < need["target"]:
      print(f"  for {need['target']}x before a faster step: {name} {lever['now']:.3g} -> "
            f"{'unreachable' if lever['needed'] is None else format(lever['needed'], '.3g')}")
  if need["ratio_now"] >= need["target"]:
    print(f"  {need['target']}x is reached before a faster step ({need['ratio_now']:.2f}x)")
  print(f"wrote {args.out / 'replay.json'}")


if __name__ == "__main__":
  main()
