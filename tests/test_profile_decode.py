"""experiments/profile_decode.py: its quick run (what CI runs, and what a GPU lease runs at
full size) and the pieces it reduces traces and targets with."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.experiment_modules import load_experiment
from tlt_jax import profiling

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_run_writes_timings_traces_counts_targets_and_the_table(tmp_path):
  peer = importlib.util.find_spec("torch") is not None
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "experiments.profile_decode", "--quick",
                      "--out", str(tmp_path), *(["--peer"] if peer else [])], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  data = json.loads((tmp_path / "profile_decode.json").read_text())
  assert (tmp_path / "profile_decode.png").is_file()
  assert (tmp_path / "trace_plain_1.xplane.pb").is_file()
  assert not (tmp_path / ".traces").exists()
  assert data["device"]["platform"] == "cpu" and "profile_decode" in data["command"]
  assert [row["batch"] for row in data["rows"]] == [1, 4] and data["sd_batches"] == [1, 4]
  for row in data["rows"]:
    programs = [row["plain"], *row["sd"].values()]
    assert len(programs) == 2  # plain and the config's first arm
    for p in programs:
      t = p["timing"]
      assert t["call_1_ms"] > 0 and t["call_n_ms"] > 0 and t["exe_call_n_ms"] > 0
      assert t["min_iterations_run"] == t["iterations"] == 4  # no row finished
      assert t["iteration_ms"] == pytest.approx((t["call_n_ms"] - t["call_1_ms"]) / 3)
      tr = p["trace"]
      assert tr["source"] == "host" and tr["iterations"] == 4 and tr["launches"] > 0
      assert 0 <= tr["idle_share"] <= 1 and tr["top"] and tr["busy_ms"] <= tr["span_ms"]
      c = p["op_counts"]
      assert c["loop_found"] and c["per_iteration"]["ops"] > 0
      assert c["per_iteration"]["kv_cache_copies"] == 0
    assert row["plain"]["tokens_per_s"] > 0
  for v in data["variants"].values():  # the default sets are GPU-only
    assert v["status"] == "skipped: GPU-only flags on cpu"
  if peer:
    assert data["peer"]["compiled"].startswith("skipped: torch.compile off on cpu")
    assert set(data["peer"]["rows"]) == {"1", "4"}
    assert all(row["eager"]["status"] != "skipped: time budget spent"
               for row in data["peer"]["rows"].values())
  names = [t["name"] for t in data["targets"]]
  assert names[0] == "plain_128_vs_1" and any(n.startswith("sd_1_vs_plain_1") for n in names)
  assert all(t["pass"] is None for t in data["targets"])  # checked on a GPU only
  out = r.stdout
  assert "launch/it" in out and "top ops, plain at 1 rows" in out and "target " in out


def test_call_table_separates_busy_idle_and_launches():
  # Three ops on one line: 0-10 µs, 5-20 µs (overlapping), 50-60 µs; a 30 µs gap.
  events = {"source": "device", "containers": 0,
            "events": [(("p", "s"), 0, 10_000, "fusion.1"), (("p", "s"), 5_000, 15_000, "gemm.2"),
                       (("p", "s"), 50_000, 10_000, "fusion.3")]}
  t = profiling.call_table(events, iterations=2, gap_ns=5_000)
  assert t["launches"] == 3 and t["launches_per_iteration"] == 1.5
  assert t["span_ms"] == pytest.approx(0.060) and t["busy_ms"] == pytest.approx(0.030)
  assert t["idle_ms"] == pytest.approx(0.030) and t["idle_share"] == pytest.approx(0.5)
  assert t["long_gaps"] == 1 and t["longest_gaps_us"] == [30.0]
  assert [o["op"] for o in t["top"]] == ["fusion", "gemm"] and t["top"][0]["calls"] == 2


def test_targets_are_checked_on_a_gpu_only():
  profile = load_experiment("profile_decode")
  rows = [{"batch": 1, "plain": {"timing": {"iteration_ms": 2.0}, "tokens_per_s": 500.0},
           "sd": {"4,2,8": {"timing": {"iteration_ms": 2.4}}}},
          {"batch": 128, "plain": {"timing": {"iteration_ms": 5.0}, "tokens_per_s": 25600.0},
           "sd": {}}]
  peer = {"rows": {"1": {"compiled": {"tokens_per_s": 400.0}},
                   "128": {"compiled": {"tokens_per_s": 30000.0}}}}
  result = {"device": {"platform": "gpu"}, "rows": rows, "peer": peer}
  verdict = {t["name"]: t["pass"] for t in profile.check_targets(result)}
  assert verdict == {"plain_128_vs_1": False, "sd_1_vs_plain_1 4,2,8": True,
                     "plain_vs_peer_compiled 1": True, "plain_vs_peer_compiled 128": False}
  result["device"]["platform"] = "cpu"
  assert all(t["pass"] is None for t in profile.check_targets(result))
