"""experiments/profile_decode.py, the decode benchmark: its quick run (what CI runs, and what a
GPU lease runs at full size), the oracle drafter's run, and the pieces it reduces traces,
targets, SD against plain and weight bytes with."""

import importlib.util
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from tests.experiment_modules import load_experiment
from tlt_jax import profiling
from tlt_jax.drafters.eagle.network import DrafterConfig
from tlt_jax.models import ModelConfig
from tlt_jax.models.shapes import MODEL_SHAPES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out, *args):
  """profile_decode's (stdout, JSON) with `args`, on the CPU."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "experiments.profile_decode", "--out", str(out),
                      *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout, json.loads((out / "profile_decode.json").read_text())


def test_quick_run_writes_timings_traces_counts_targets_and_the_table(tmp_path):
  peer = importlib.util.find_spec("torch") is not None
  out, data = _run(tmp_path, "--quick", *(["--peer"] if peer else []))
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
    assert row["plain"]["tokens_per_s"] > 0 and row["plain"]["timing"]["tokens_per_iteration"] == 1
    (sd,) = row["sd"].values()  # the default's first arm, (4,2,8) with the EAGLE drafter
    assert 1 <= sd["timing"]["tokens_per_iteration"] <= 5 and sd["weight_floor_vs_plain"] > 1
    assert sd["identical_to_plain"] is None  # sampled at T = 1: not token for token
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


@pytest.mark.slow
def test_oracle_drafter_accepts_every_draft_and_keeps_plain_tokens(tmp_path):
  """The policy itself as the EAGLE drafter of a hybrid arm (its suffix drafter has nothing to
  copy from), greedy: every SD iteration emits plain decoding's tokens, and at 1 row every draft
  is accepted (depth 2 + the bonus token); no traces or flag variants asked, none made."""
  out, data = _run(tmp_path, "--quick", "--oracle", "--set", "rollout.temperature=0", "--arms",
                   "2,2,4,eagle+suffix", "--batches", "1", "2", "--no-trace", "--flags")
  assert (tmp_path / "profile_decode.png").is_file() and data["oracle"] is True
  assert data["model"].endswith("the policy as its EAGLE drafter (oracle)")
  assert data["temperature"] == 0 and data["variants"] == {}
  assert not list(tmp_path.glob("*.xplane.pb"))
  for row in data["rows"]:
    sd = row["sd"]["2,2,4,eagle+suffix"]
    assert sd["identical_to_plain"] is True and "trace" not in sd
    assert sd["weight_floor_vs_plain"] > 2  # two passes of a drafter as large as the policy
    if "vs_plain" in sd:  # both iteration times came out above a busy host's noise
      plain = row["plain"]["timing"]["iteration_ms"]
      assert sd["decode_speedup"] == pytest.approx(
          sd["timing"]["tokens_per_iteration"] * plain / sd["timing"]["iteration_ms"])
  assert data["rows"][0]["sd"]["2,2,4,eagle+suffix"]["timing"]["tokens_per_iteration"] == 3.0
  assert "plain's tokens: yes" in out


def test_sd_against_plain_compares_tokens_only_when_greedy():
  profile = load_experiment("profile_decode")
  state = types.SimpleNamespace(out=np.array([[5, 6, 7, 0], [1, 2, 0, 0]]),
                                num_out=np.array([3, 2]))
  same = (np.array([[5, 6, 0, 0], [1, 2, 3, 0]]), np.array([2, 3]))  # as far as both go
  other = (np.array([[5, 6, 0, 0], [1, 9, 3, 0]]), np.array([2, 3]))
  plain, sd = {"timing": {"iteration_ms": 2.0}}, {"iteration_ms": 3.0, "tokens_per_iteration": 2.4}
  got = profile.against_plain(plain, sd, state, same, greedy=True)
  assert got == {"identical_to_plain": True, "vs_plain": 1.5, "decode_speedup": pytest.approx(1.6)}
  assert profile.against_plain(plain, sd, state, other, True)["identical_to_plain"] is False
  assert profile.against_plain(plain, sd, state, other, False)["identical_to_plain"] is None
  noise = profile.against_plain({"timing": {"iteration_ms": -0.1}}, sd, state, same, True)
  assert "vs_plain" not in noise and noise["identical_to_plain"] is True


def test_weight_read_floor_counts_an_sd_iterations_weight_bytes():
  """At the Qwen2.5-7B shape a policy step reads 7.07B parameters (7.62B less the 545M
  embedding table); a drafter pass reads the 1-layer drafter (259M) and the policy's head
  (545M), or with a 32k draft vocabulary its own head (117M with the rest: 376M)."""
  profile = load_experiment("profile_decode")
  cfg = ModelConfig(**MODEL_SHAPES["qwen2.5-7b"], dtype="bfloat16", param_dtype="bfloat16")
  step = 7_615_616_512 - 544_997_376
  assert profile.weight_read_floor(cfg, DrafterConfig(), 0) == 1.0
  assert profile.weight_read_floor(cfg, DrafterConfig(), 8) == pytest.approx(
      1 + 8 * (258_747_904 + 544_997_376) / step)
  assert profile.weight_read_floor(cfg, DrafterConfig(draft_vocab_size=32768), 8) == \
      pytest.approx(1 + 8 * (376_221_184 - 32768) / step)  # not its id map's 32k ints
