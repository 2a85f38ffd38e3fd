"""experiments/replay.py: the replay of a GPU headline reproduces the run it came from, fits
costs it was given back, rebuilds a rollout's lengths from its calls, and projects changes in
the direction they must go; costs fitted to a CPU run's totals are the ones it ran with."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO
from tests.experiment_modules import load_experiment

replay = load_experiment("replay")
model = load_experiment("rollout_model")
H200 = REPO + "/docs/results/gpu_h200_2026-12-04"


@pytest.mark.parametrize("run", ["tf32", "fp32-highest"])
def test_the_replay_reproduces_the_2026_12_04_run(run):
  """From the run's own costs, rebuilt lengths and accept lengths: its steady-state step
  ratio within 0.1 (1.25x under TF32, 1.11x at the highest precision), and each step's
  baseline rollout within 10%."""
  headline = json.load(open(f"{H200}/{run}/headline.json"))
  cal = replay.calibrate(headline)
  got = replay.validate(headline, cal)
  assert abs(got["error"]) < 0.1, got
  for step in got["steps"]:
    assert step["baseline_rollout_s"] == pytest.approx(step["measured_baseline_rollout_s"],
                                                       rel=0.1)
  # 128 responses a step, the longest at the limit where the run had one there.
  assert all(len(lengths) == 128 for lengths in cal.lengths)
  steps = headline["variants"]["baseline"]["steps"]
  assert [int(lengths.max()) for lengths in cal.lengths] == [s["response_len_max"]
                                                             for s in steps]


def _engine():
  return replay.Engine(max_batch=8, batch_sizes=(1, 4), sd_threshold=4, iterations_per_call=8)


def _recorded_steps(lengths_per_step, plain, sd, call_s, accept, engine):
  """Steps as `run` records them (calls with their iterations) from the engine's scheduler
  driven by the simulator's model: every call costs call_s + its iterations' seconds."""
  from tlt_jax.rollout.scheduler import Compact, Refill, SliceScheduler, Start
  out = {"baseline": [], "tlt": []}
  for variant in out:
    for n, lengths in enumerate(lengths_per_step, start=1):
      speculative = variant == "tlt"
      sched = SliceScheduler(range(len(lengths)), engine.max_batch,
                             engine.sd_threshold if speculative else 0,
                             engine.iterations_per_call,
                             (lambda r: "sd") if speculative else None, engine.batch_sizes)
      rows, calls, t = {}, [], 0.0
      while sched.busy:
        action = sched.next_action()
        if isinstance(action, Start):
          rows = {i: float(lengths[r] - 1) for i, r in enumerate(action.requests)}
          calls.append({"mode": "prefill", "active": len(action.requests), "bucket": action.batch,
                        "iterations": 0, "seconds": 0.01})
          continue
        if isinstance(action, (Compact, Refill)):
          rows = {new: rows[old] for new, old in enumerate(action.order) if old in rows}
          continue
        mode = "sd" if action.strategy else "plain"
        step = accept if mode == "sd" else 1.0
        batch = sched.batch
        i = 0
        while i < action.max_iterations and sum(v > 1e-9 for v in rows.values()) >= \
            action.min_running:
          rows = {k: v - step if v > 1e-9 else v for k, v in rows.items()}
          i += 1
        done = [k for k, v in rows.items() if v <= 1e-9 and sched.rows[k] >= 0]
        secs = call_s + i * (sd if mode == "sd" else plain)[batch]
        calls.append({"mode": mode, "active": action.running, "bucket": batch, "iterations": i,
                      "seconds": secs})
        sched.finished(done)
        t += secs
      for c, nxt in zip(calls, calls[1:] + [None]):
        c["after"] = nxt["active"] if nxt else 0
      out[variant].append({"step": n, "calls": calls, "lengths": list(lengths),
                           "rollout_s": t + 0.01, "prefill_s": 0.01, "update_s": 1.0,
                           "step_s": t + 1.01, "accept_len": accept if speculative else None,
                           "plain_iterations": sum(c["iterations"] for c in calls
                                                   if c["mode"] == "plain"),
                           "sd_iterations": sum(c["iterations"] for c in calls
                                                if c["mode"] == "sd")})
  return out


def test_costs_recorded_with_their_iterations_are_fitted_back():
  engine = _engine()
  rng = np.random.default_rng(0)
  lengths = [rng.integers(2, 60, 8) for _ in range(4)]
  plain = {1: 1e-3, 4: 2e-3, 8: 3e-3}
  sd = {1: 2e-3, 4: 2.5e-3, 8: 4e-3}
  steps = _recorded_steps(lengths, plain, sd, 5e-3, 2.0, engine)
  calls = {v: [replay.calls_of(s, engine, v == "tlt") for s in steps[v]] for v in steps}
  base, rest = replay.fit_costs(steps["baseline"], calls["baseline"], engine)
  tlt, _ = replay.fit_costs(steps["tlt"], calls["tlt"], engine)
  assert base.call_s == pytest.approx(5e-3, rel=1e-6)
  assert base.measured("plain") == pytest.approx(plain, rel=1e-6)
  assert base.measured("sd") == {}  # the baseline never ran SD
  assert tlt.measured("sd") and all(tlt.measured("sd")[b] == pytest.approx(sd[b], rel=1e-6)
                                    for b in tlt.measured("sd"))
  assert rest["update_s"] == 1.0


def test_lengths_are_rebuilt_from_a_plain_rollouts_calls():
  """Without recorded iterations or lengths (2026-12-04's record): each call's rows ended
  within its iterations, the full calls ran all of theirs, the step's total fixes the rest."""
  engine = _engine()
  lengths = np.asarray([3, 9, 17, 20, 33, 41, 52, 80])
  plain = {1: 1e-3, 4: 2e-3, 8: 3e-3}
  step = _recorded_steps([lengths], plain, plain, 0.0, 1.0, engine)["baseline"][0]
  t, running = 0.0, []
  for c in step["calls"]:
    running.append([t, c["active"], c["mode"]])
    t += c["seconds"]
  old = {k: v for k, v in step.items() if k not in ("calls", "lengths")}
  old.update(running=running, rollout_s=t)
  calls = replay.calls_of(old, engine, speculative=False)
  costs, _ = replay.fit_costs([old], [calls], engine)
  rebuilt = replay.rebuild_lengths(old, calls, costs, engine)
  assert len(rebuilt) == 8 and rebuilt.max() == lengths.max()
  assert abs(int(rebuilt.sum()) - int(lengths.sum())) <= 8 * 8  # within a call per response


def test_the_projection_moves_the_way_each_change_must():
  """On the 2026-12-04 run: a drafter that accepts more raises the ratio, and so do tail calls
  that run to their bucket's end (the tail made one call per finished row); cheaper calls
  and steps make both variants faster."""
  headline = json.load(open(f"{H200}/tf32/headline.json"))
  cal = replay.calibrate(headline)
  got = replay.project(cal, accept={1: 3.0, 8: 3.0, 32: 3.0, 128: 3.0}, depth=6)
  rows = got["rows"]
  by = {r["change"]: r["step_ratio"] for r in rows}
  assert by["the new drafter and arm"] > by["the run as it was"]
  assert by["tail calls run to their bucket's end"] > by["the new drafter and arm"]
  for before, after in zip(rows[-3:], rows[-2:]):
    assert after["tlt_step_s"] < before["tlt_step_s"]
    assert after["baseline_step_s"] < before["baseline_step_s"]
  need = replay.needed(cal, {"tlt_costs": cal.costs["tlt"]}, target=1.5)
  assert need["ratio_now"] < 1.5
  lever = need["sd_iteration_fraction"]
  assert lever["needed"] is not None and 0 < lever["needed"] < 1  # cheaper SD reaches it
  at = cal.costs["tlt"].with_table(sd={b: s * lever["needed"] for b, s in
                                       cal.costs["tlt"].measured("sd").items()})
  assert replay.replay_steps(cal, tlt_costs=at)["step_ratio"] >= 1.5
  assert rows[0]["step_ratio"] == pytest.approx(replay.validate(headline, cal)[
      "replayed_step_ratio"])


def test_sd_where_it_pays_skips_batches_where_a_token_costs_more():
  """A table where SD pays at one row only: with the rule, the 4-row phase decodes plainly
  and the rollout is no slower than plain decoding there."""
  costs = model.make_costs([1, 4], [1.0, 1.0], [1.5, 3.0], 2.0)
  assert costs.sd_pays_at(1) and not costs.sd_pays_at(4)
  lengths = [40, 40, 40, 100]
  always = model.simulate_rollout(lengths, 1, 4, costs, 4)["rollout_s"]
  paid = model.simulate_rollout(lengths, 1, 4, costs, 4, sd_where_it_pays=True)["rollout_s"]
  plain = model.simulate_rollout(lengths, 1, 4, costs, 0)["rollout_s"]
  assert paid < always and paid < plain


# ---------------------------------------------------------------- --run: a CPU run

TRUE = dict(plain_fixed_s=0.02, plain_per_row_s=0.001, sd_s=0.05, prefill_s=0.03)


def _write_run(workdir, schedule, num_slices=2, max_batch=4, threshold=2, summary=False):
  """A synthetic run: per step random lengths, its timings simulated with TRUE costs."""
  rng = np.random.default_rng(7)
  grid = 2.0 ** np.arange(3)
  metrics, rollouts = [], []
  for step in range(1, 9):
    g, prompts = 4, 3
    lengths = rng.integers(1, 120, prompts * g)
    sd_on, accept = step % 3 != 0, float(rng.uniform(1.5, 3.5))
    costs = model.make_costs(grid, TRUE["plain_fixed_s"] + TRUE["plain_per_row_s"] * grid,
                             TRUE["sd_s"], accept, TRUE["prefill_s"])
    r = model.simulate_rollout(lengths, num_slices, max_batch, costs,
                               threshold if sd_on else 0, schedule)
    compile_s = 50.0 if step == 1 else 0.0  # compiling step: its rollout_s is inflated
    metrics.append({"step": step, "rollout_s": r["rollout_s"] + compile_s,
                    "idle_slice_s": float((r["rollout_s"] - r["finish_s"]).sum()),
                    "compile_s": compile_s, "sd_enabled": sd_on,
                    "sd_accept_len_mean": accept if sd_on else None,
                    "response_len_mean": float(lengths.mean()),
                    "response_len_max": int(lengths.max()), "update_s": 1.0, "step_s": 2.0,
                    "reclaimed_slice_s": 0.0})
    rollouts += [{"step": step, "prompt": i // g, "sample": i % g, "tokens": int(t)}
                 for i, t in enumerate(lengths)]
  rng.shuffle(rollouts)  # the order of lines must not matter: (prompt, sample) does
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.writelines(json.dumps(m) + "\n" for m in metrics)
  with open(os.path.join(workdir, "rollouts.jsonl"), "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rollouts)
  if summary:
    config = {"mesh": {"axes": {"replica": num_slices, "fsdp": 1, "tensor": 1}},
              "rollout": {"max_batch": max_batch, "sd_threshold": threshold}}
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump({"config": config}, f)
  return metrics


@pytest.mark.parametrize("schedule", ["interleaved", "parallel"])
def test_compare_with_run_recovers_a_synthetic_run(tmp_path, schedule):
  metrics = _write_run(str(tmp_path), schedule)
  res = replay.compare_with_run(str(tmp_path), num_slices=2, max_batch=4, sd_threshold=2)
  assert [s["used_in_fit"] for s in res["steps"]] == [False] + [True] * 7
  for name, value in TRUE.items():
    assert res["fit"][schedule][name] == pytest.approx(value, rel=1e-6, abs=1e-9)
  for s, m in zip(res["steps"][1:], metrics[1:]):
    assert s[f"{schedule}_idle_slice_s"] == pytest.approx(m["idle_slice_s"], rel=1e-6)
    assert s[f"{schedule}_rollout_s"] == pytest.approx(m["rollout_s"], rel=1e-6)


def test_compare_with_run_needs_rollouts(tmp_path):
  _write_run(str(tmp_path), "parallel")
  os.remove(tmp_path / "rollouts.jsonl")
  with pytest.raises(FileNotFoundError, match="save_rollouts=True"):
    replay.compare_with_run(str(tmp_path), num_slices=2, max_batch=4, sd_threshold=2)
  _write_run(str(tmp_path), "parallel")
  with pytest.raises(ValueError, match="num_slices"):  # no summary.json to read them from
    replay.compare_with_run(str(tmp_path))


def test_compare_run_cli_reads_the_run_summary(tmp_path):
  _write_run(str(tmp_path / "run"), "interleaved", summary=True)
  r = subprocess.run([sys.executable, "-m", "experiments.replay", "--run",
                      str(tmp_path / "run"), "--out", str(tmp_path / "out")], cwd=REPO,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads((tmp_path / "out" / "compare.json").read_text())
  assert res["settings"] == {"num_slices": 2, "max_batch": 4, "sd_threshold": 2}
  assert (tmp_path / "out" / "compare.png").exists()
