"""experiments/simulate_cluster.py and the rollout cost model it evaluates
(experiments/rollout_model.py): closed-form cases, inputs and errors, the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.experiment_modules import load_experiment
from tlt_jax.rollout.scheduler import bucket

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sim = load_experiment("simulate_cluster")
model = load_experiment("rollout_model")


def flat_costs(seconds=0.01, accept=1.0, sd_seconds=None, max_batch=64, prefill_s=0.0):
  """Iteration time independent of the batch; SD costs `sd_seconds` (default: the same)."""
  b = 2.0 ** np.arange(int(np.log2(max_batch)) + 1)
  return model.make_costs(b, seconds, seconds if sd_seconds is None else sd_seconds, accept,
                        prefill_s=prefill_s)


# ---------------------------------------------------------------- closed forms

@pytest.mark.parametrize("threshold", [0, 4])
def test_equal_lengths_even_split_leaves_no_idle_time(threshold):
  # 8 slices x 40 requests of 300 tokens, batch 16 (refills), the default batch-dependent
  # costs, with and without SD: every slice does the same work, so all finish together.
  r = model.simulate_rollout(np.full(8 * 40, 300), 8, 16, sim.default_costs(16), threshold)
  idle = sim.idle_summary(r["finish_s"], devices_per_slice=4)
  assert r["rollout_s"] > 0
  assert idle["idle_device_s"] == 0.0 and idle["idle_share"] == 0.0
  assert np.all(r["finish_s"] == r["rollout_s"])


@pytest.mark.parametrize("num_slices", [2, 8, 64])
def test_one_long_response_idles_all_other_slices(num_slices):
  # One response of 1000 tokens (request 0, slice 0), every other of 1 token: the prefill
  # emits it, so those slices finish at t = 0 (free prefill). Measured: idle device-seconds
  # over the rollout's device-seconds. Exactly (R - 1) / R: all other slices idle throughout.
  lengths = np.ones(num_slices * 10, np.int64)
  lengths[0] = 1000
  r = model.simulate_rollout(lengths, num_slices, 4, flat_costs(0.01))
  assert r["rollout_s"] == pytest.approx(999 * 0.01, rel=1e-12)
  idle = sim.idle_summary(r["finish_s"], devices_per_slice=2)
  assert idle["idle_share"] == pytest.approx((num_slices - 1) / num_slices, abs=1e-12)
  assert idle["idle_device_s"] == pytest.approx((num_slices - 1) * 2 * r["rollout_s"], rel=1e-12)


def test_one_long_response_with_short_rest():
  # Rest of length S: other slices finish at (S - 1) c; the long slice at (L - 1) c.
  # idle share = (R - 1)(L - S) / (R (L - 1)) with an iteration cost independent of the batch.
  R, L, S = 16, 2001, 51
  lengths = np.full(R * 3, S)
  lengths[5] = L  # slice 5
  r = model.simulate_rollout(lengths, R, 4, flat_costs(0.02))
  idle = sim.idle_summary(r["finish_s"], devices_per_slice=1)
  assert idle["idle_share"] == pytest.approx((R - 1) * (L - S) / (R * (L - 1)), rel=1e-12)
  assert np.argmax(r["finish_s"]) == 5


@pytest.mark.parametrize("k", [4.0, 2.5])
def test_sd_with_equal_iteration_cost_shortens_a_single_row_tail_by_k(k):
  m = 40
  lengths = [1 + int(k * m)]  # k * m decode tokens: m SD iterations or k * m plain ones
  costs = flat_costs(0.01, accept=k)
  plain = model.simulate_rollout(lengths, 1, 8, costs, sd_threshold=0)
  sd = model.simulate_rollout(lengths, 1, 8, costs, sd_threshold=1)
  assert plain["rollout_s"] / sd["rollout_s"] == pytest.approx(k, rel=1e-12)
  assert sd["sd_iterations"][0] == m


def test_interleaved_schedule_serialises_the_slices():
  # Two slices with one 101-token response each, 1 s per call, free prefill. One host loop
  # alternates: slice 0's last call ends at 100 + 99 s, slice 1's at 200 s.
  r = model.simulate_rollout([101, 101], 2, 4, flat_costs(1.0), schedule="interleaved")
  np.testing.assert_allclose(r["finish_s"], [199.0, 200.0])
  par = model.simulate_rollout([101, 101], 2, 4, flat_costs(1.0))
  np.testing.assert_allclose(par["finish_s"], [100.0, 100.0])


def test_interleaved_calls_of_several_steps():
  # The same with 10 iterations per call: 10 calls of 10 s per slice; slice 0 ends after
  # its 10 calls and slice 1's first 9, slice 1 after all 20.
  r = model.simulate_rollout([101, 101], 2, 4, flat_costs(1.0), schedule="interleaved",
                           iterations_per_call=10)
  np.testing.assert_allclose(r["finish_s"], [190.0, 200.0])
  np.testing.assert_array_equal(r["calls"], [11, 11])  # the prefill and 10 decode calls


def _reference(lengths, num_slices, max_batch, costs, threshold):
  """The engine's host loop call by call: round after round, each busy slice makes one call
  (a prefill when it has free rows and queued requests, else one decode iteration).
  Returns the finish times with slices in parallel and with one loop waiting on each call."""
  queues = [[float(x) - 1 for x in lengths[s::num_slices]] for s in range(num_slices)]
  rows = [[] for _ in range(num_slices)]
  own, shared = np.zeros(num_slices), 0.0
  parallel, interleaved = np.zeros(num_slices), np.zeros(num_slices)
  while any(queues[s] or rows[s] for s in range(num_slices)):
    for s in range(num_slices):
      if not (queues[s] or rows[s]):
        continue
      if queues[s] and len(rows[s]) < max_batch:
        k = max_batch - len(rows[s])
        rows[s] += queues[s][:k]
        del queues[s][:k]
        cost = costs.prefill_s
      else:
        b = bucket(len(rows[s]), max_batch)
        sd = len(rows[s]) <= threshold
        step = costs.accept_at(b) if sd else 1.0
        cost = costs.sd_at(b) if sd else costs.plain_at(b)
        rows[s] = [x - step for x in rows[s]]
      rows[s] = [x for x in rows[s] if x > 1e-9]
      own[s] += cost
      shared += cost
      if not (queues[s] or rows[s]):
        parallel[s], interleaved[s] = own[s], shared
  return parallel, interleaved


@pytest.mark.parametrize("seed", range(4))
def test_event_jumps_match_a_call_by_call_reference(seed):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 60, int(rng.integers(5, 40)))
  num_slices, max_batch = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4, 8]))
  b = 2.0 ** np.arange(4)
  costs = model.make_costs(b, 0.01 + 0.003 * b, 0.02 + 0.005 * b, [3.0, 2.5, 2.0, 1.5],
                         prefill_s=0.007)
  threshold = int(rng.integers(0, max_batch + 1))
  parallel, interleaved = _reference(lengths, num_slices, max_batch, costs, threshold)
  for schedule, want in (("parallel", parallel), ("interleaved", interleaved)):
    got = model.simulate_rollout(lengths, num_slices, max_batch, costs, threshold, schedule)
    np.testing.assert_allclose(got["finish_s"], want, rtol=1e-9, atol=1e-12)


def test_continuous_batching_and_round_robin_split():
  # Slice 1 serves requests 1 and 3 (lengths 11 and 21) one at a time (max_batch 1): 10 + 20
  # decode iterations plus two prefill calls of 0.5 s. Slice 0 serves requests 0 and 2 (6, 6).
  r = model.simulate_rollout([6, 11, 6, 21], 2, 1, flat_costs(1.0, max_batch=1, prefill_s=0.5))
  np.testing.assert_allclose(r["finish_s"], [5 + 5 + 1.0, 10 + 20 + 1.0])
  np.testing.assert_array_equal(r["prefill_calls"], [2, 2])


def test_simulate_step_spot_training_and_speedup():
  cfg = sim.StepConfig(devices_per_slice=2, max_batch=8, sd_threshold=2,
                       drafter_steps_per_s=10.0, spot_startup_s=1.0, update_s=3.0,
                       update_s_per_token=0.0)
  lengths = np.ones(8, np.int64)
  lengths[0] = 1001
  out = sim.simulate_step(lengths, 8, cfg, flat_costs(0.01, accept=4.0))
  base, tlt = out["baseline"], out["tlt"]
  assert base["rollout_s"] == pytest.approx(10.0) and tlt["rollout_s"] == pytest.approx(2.5)
  assert base["reclaimed_device_s"] == 0.0 and base["drafter_steps"] == 0
  # 3 idle slices x (2.5 s - 1 s start-up) x 2 devices; 15 steps per slice.
  assert tlt["reclaimed_device_s"] == pytest.approx(9.0)
  assert tlt["drafter_steps"] == 45
  assert out["speedup_rollout"] == pytest.approx(4.0)
  assert out["speedup_step"] == pytest.approx(13.0 / 5.5)


def test_large_cluster_is_fast():
  rng = np.random.default_rng(0)
  lengths = sim.sample_lengths(rng, 16384, "lognormal", 32768)
  t0 = time.perf_counter()
  r = model.simulate_rollout(lengths, 1024, 64, sim.default_costs(64), sd_threshold=32)
  assert time.perf_counter() - t0 < 10.0
  assert r["finish_s"].shape == (1024,) and r["rollout_s"] > 0


def test_unmeasured_sd_costs_scale_the_nearest_measured_by_the_plain_ratio():
  """An SD cost the table lacks (NaN) is the nearest measured batch's times the plain steps'
  ratio, plain where none is measured; with_table replaces entries, and a fill follows them."""
  costs = model.make_costs([1, 8, 32, 128], [1.0, 2.0, 4.0, 12.0], [3.0, 5.0, 6.0, np.nan], 2.0)
  assert costs.sd_at(128) == pytest.approx(6.0 * 12.0 / 4.0)
  assert costs.measured("sd") == {1: 3.0, 8: 5.0, 32: 6.0}
  cheaper = costs.with_table(sd={32: 2.0}, accept={1: 4.0}, call_s=0.5)
  assert cheaper.sd_at(128) == pytest.approx(6.0) and cheaper.accept_at(1) == 4.0
  assert cheaper.accept_at(8) == 2.0 and cheaper.call_s == 0.5 and costs.call_s == 0.0
  plain_only = model.make_costs([1, 2], [1.0, 3.0], np.nan, 1.0)
  assert plain_only.sd_at(2) == 3.0 and plain_only.measured("sd") == {}
  with pytest.raises(ValueError, match="no batch 4"):
    costs.with_table(plain={4: 1.0})
  with pytest.raises(ValueError, match="no plain step at batch"):
    model.simulate_rollout([5], 1, 2, model.make_costs([1, 2], [1.0, np.nan], 1.0, 1.0))


# ---------------------------------------------------------------- inputs and errors

def test_sample_lengths_are_capped():
  rng = np.random.default_rng(1)
  x = sim.sample_lengths(rng, 5000, "lognormal", 4096)
  assert x.min() >= 1 and x.max() <= 4096
  x = sim.sample_lengths(rng, 100, "measured", 50, pool=np.array([10, 80]))
  assert set(x.tolist()) <= {10, 50}


def test_load_lengths_json_and_jsonl(tmp_path):
  (tmp_path / "lengths.json").write_text(json.dumps({"lengths": [3, 4, 5], "summary": {}}))
  np.testing.assert_array_equal(model.load_lengths(str(tmp_path / "lengths.json")), [3, 4, 5])
  (tmp_path / "r.jsonl").write_text("".join(json.dumps({"step": 1, "tokens": t}) + "\n"
                                            for t in (7, 9)))
  np.testing.assert_array_equal(model.load_lengths(str(tmp_path / "r.jsonl")), [7, 9])
  (tmp_path / "responses.jsonl").write_text("".join(json.dumps({"completion": [1] * t}) + "\n"
                                                    for t in (2, 5)))
  np.testing.assert_array_equal(model.load_lengths(str(tmp_path / "responses.jsonl")), [2, 5])
  (tmp_path / "bad.json").write_text(json.dumps({"lens": [1]}))
  with pytest.raises(ValueError, match="lengths"):
    model.load_lengths(str(tmp_path / "bad.json"))
  with pytest.raises(FileNotFoundError, match="nope.json"):
    model.load_lengths(str(tmp_path / "nope.json"))


def test_cost_file_and_bad_settings(tmp_path):
  path = tmp_path / "costs.json"
  path.write_text(json.dumps({"batch": [1, 2, 4], "plain_s": [1, 2, 3], "sd_s": [2, 3, 4],
                              "accept_len": 3.0, "prefill_s": 0.1}))
  costs = sim.load_costs(str(path))
  assert costs.plain_at(3) == pytest.approx(2.5) and costs.accept_at(4) == 3.0
  with pytest.raises(ValueError, match="max_batch=8"):
    sim.StepConfig(max_batch=8, sd_threshold=2).check(costs)
  with pytest.raises(ValueError, match="sd_threshold=8"):
    sim.StepConfig(max_batch=4, sd_threshold=8).check(costs)
  path.write_text(json.dumps({"batch": [1, 2], "plain_s": [1, 2]}))
  with pytest.raises(ValueError, match="sd_s"):
    sim.load_costs(str(path))
  with pytest.raises(ValueError, match="accept_len"):
    model.make_costs([1, 2], 1.0, 1.0, 0.5)


def test_costs_from_rollout_json(tmp_path):
  # A bench_rollout.py result made from plain = 0.01 + 0.001 b s per call, SD 2x that, accept 3:
  # 100 tail calls at 2 rows, 100 full calls at 64 rows; 50 SD tail calls at 2 rows.
  plain = dict(tokens=6600, wall_s=1.2 + 7.4, tail_tokens=200, tail_calls=100, tail_s=1.2,
               tail_s_per_call=0.012, accept_len=None)
  sd = dict(tokens=6600, wall_s=8.6, tail_tokens=300, tail_calls=50, tail_s=1.2,
            tail_s_per_call=0.024, accept_len=3.0)
  path = tmp_path / "rollout.json"
  path.write_text(json.dumps({"prompts": 96, "samples": 1, "sd_threshold": 4,
                              "best_sd_mode": "sd(4, 2, 8)",
                              "modes": {"plain": plain, "sd(4, 2, 8)": sd}}))
  costs = sim.costs_from_rollout_json(str(path), max_batch=64)
  assert costs.plain_at(1) == pytest.approx(0.011) and costs.plain_at(64) == pytest.approx(0.074)
  assert costs.sd_at(8) == pytest.approx(2 * 0.018) and costs.accept_at(1) == 3.0
  path.write_text(json.dumps({"modes": {}}))
  with pytest.raises(ValueError, match="bench_rollout"):
    sim.costs_from_rollout_json(str(path))


def test_costs_from_decode_json(tmp_path):
  """profile_decode.py's rows (and bench_decode.py's, as committed results hold them): plain
  6 + 0.1 b ms and SD 10 + 1 b ms measured at batches 1 and 8 give those lines, plus the
  per-row cache cost of long context, at every power of two; a batch without SD is left out."""
  def row(b):
    return {"batch": b, "complete": True, "tlt_plain_ms": 6 + 0.1 * b,
            "sd": {"8,4,48": {"iteration_ms": 12 + b}, "8,4,48 r=32768": {"iteration_ms": 10 + b}}}

  def profile_row(b, sd=True):
    timing = lambda ms: {"timing": {"iteration_ms": ms}}  # noqa: E731
    return {"batch": b, "plain": timing(6 + 0.1 * b),
            "sd": {"8,4,48": timing(12 + b), "8,4,48 r=32768": timing(10 + b)} if sd else {}}
  path = tmp_path / "decode.json"
  path.write_text(json.dumps({"device": {"device_kind": "H100"}, "model": "random qwen2.5-7b",
                              "rows": [profile_row(1), profile_row(8), profile_row(32, False)]}))
  for shape in ("random qwen2.5-7b", "qwen2.5-7b"):
    costs, upto = sim.costs_from_decode_json(str(path), max_batch=16, kv_s_per_row=1e-4)
    assert upto == 8 and costs.batch.tolist() == [1, 2, 4, 8, 16]
    assert costs.plain_at(16) == pytest.approx(1e-3 * (6 + 1.6) + 16e-4)
    assert costs.sd_at(4) == pytest.approx(1e-3 * (10 + 4) + 4e-4)  # the fastest strategy
    assert costs.accept_at(1) == 6.4 and f"H100, {shape}, SD 8,4,48 r=32768" in costs.source
    path.write_text(json.dumps({"device": {"device_kind": "H100"}, "shape": "qwen2.5-7b",
                                "rows": [row(1), row(8)]}))  # bench_decode.py's, next
  full, _ = sim.costs_from_decode_json(str(path), 16, sd_key="8,4,48", kv_s_per_row=0.0)
  assert full.sd_at(1) == pytest.approx(13e-3)
  with pytest.raises(ValueError, match="no SD strategy '4,2,8' at every batch"):
    sim.costs_from_decode_json(str(path), 16, sd_key="4,2,8")
  # SD measured up to batch 8 only: a higher threshold is refused, in one line.
  r = subprocess.run([sys.executable, "-m", "experiments.simulate_cluster",
                      "--out", str(tmp_path / "sim"), "--quick", "--costs-from-decode",
                      str(path), "--sd-threshold", "16"], cwd=REPO, capture_output=True,
                     text=True)
  assert r.returncode != 0 and "measured SD up to batch 8; use --sd-threshold 8" in r.stderr


# ---------------------------------------------------------------- the script

def _run_script(*args, timeout=120):
  r = subprocess.run([sys.executable, "-m", "experiments.simulate_cluster",
                      *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)
  assert r.returncode == 0, r.stderr[-3000:]
  return r


def test_quick_mode_end_to_end(tmp_path):
  t0 = time.perf_counter()
  _run_script("--quick", "--out", str(tmp_path))
  assert time.perf_counter() - t0 < 30.0  # a few seconds, most of it importing matplotlib
  data = json.loads((tmp_path / "simulation.json").read_text())
  assert [r["devices"] for r in data["results"]] == [8, 64]
  for row in data["results"]:
    assert len(row["baseline"]["finish_s"]) == row["slices"]
    assert 0.0 <= row["baseline"]["idle_share"] < 1.0
    assert row["speedup_step"] > 0
  lines = (tmp_path / "simulation.csv").read_text().strip().splitlines()
  assert len(lines) == 3 and lines[0].startswith("devices,slices,responses")
  assert (tmp_path / "simulation.png").stat().st_size > 0


def test_cli_names_bad_input(tmp_path):
  r = subprocess.run([sys.executable, "-m", "experiments.simulate_cluster",
                      "--out", str(tmp_path), "--sd-threshold", "128", "--max-batch", "64"],
                     cwd=REPO, capture_output=True, text=True, timeout=60)
  assert r.returncode != 0 and "sd_threshold=128" in r.stderr
