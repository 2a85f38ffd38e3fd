"""The main job end to end (python -m tlt_jax.train on configs/default.py:runlocal): outputs,
TLT vs baseline equivalence, clean stop on SIGTERM and exact resume, config errors."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from scipy import stats

from tests.conftest import REPO
from tlt_jax.train_report import METRIC_KEYS

RUNLOCAL = ["--config", "configs/default.py:runlocal"]
BASELINE = ["--config.rollout.speculative.enable=False", "--config.drafter.spot_training=False"]
SAME = ("reward_mean", "accuracy", "response_len_mean", "response_len_max", "rollout_tokens")


def _train(workdir, *args, wait=True):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "tlt_jax.train", *RUNLOCAL, "--workdir", str(workdir), *args]
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  if not wait:
    return proc
  out, _ = proc.communicate(timeout=900)
  assert proc.returncode == 0, out[-3000:]
  return out


def _metrics(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]


def _rollouts(workdir):
  return [json.loads(line) for line in open(os.path.join(workdir, "rollouts.jsonl"))]


@pytest.mark.slow
def test_greedy_tlt_and_baseline_runs_give_the_same_responses(tmp_path):
  greedy = ["--config.rollout.temperature=0.0", "--config.rl.save_rollouts=True"]
  _train(tmp_path / "tlt", *greedy)
  _train(tmp_path / "base", *greedy, *BASELINE)
  tlt, base = _metrics(tmp_path / "tlt"), _metrics(tmp_path / "base")
  assert [m["step"] for m in tlt] == [1, 2] == [m["step"] for m in base]
  for m in tlt + base:
    assert set(METRIC_KEYS) <= set(m)
  assert all(m["sd_enabled"] for m in tlt) and not any(m["sd_enabled"] for m in base)
  assert all(m["sd_accept_len_mean"] > 1.0 for m in tlt)  # the shipped drafter drafts well
  for a, b in zip(tlt, base):
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
  assert [r["completion"] for r in _rollouts(tmp_path / "tlt")] == \
      [r["completion"] for r in _rollouts(tmp_path / "base")]

  # The TLT run's outputs: checkpoints, summary, plot, exports.
  run = tmp_path / "tlt"
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps_done"] == 2 and summary["rollout_share"] > 0
  assert (run / "summary.png").stat().st_size > 10_000
  evals = [json.loads(line) for line in open(run / "eval.jsonl")]
  assert [e["step"] for e in evals] == [0, 2] and summary["eval_step_last"] == 2
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(
      os.listdir(run / "export" / "policy"))
  assert {"config.json", "model.safetensors"} == set(os.listdir(run / "export" / "drafter"))


@pytest.mark.slow
def test_sampled_tlt_and_baseline_runs_have_the_same_reward_statistics(tmp_path):
  bigger = ["--config.rl.steps=1", "--config.rl.prompts_per_step=12",
            "--config.rl.num_samples=8", "--config.rl.micro_batch_rows=32",
            "--config.rl.save_rollouts=True", "--config.rollout.max_batch=32",
            "--config.rollout.sd_threshold=24"]  # SD samples a good share of the tokens
  _train(tmp_path / "tlt", *bigger)
  _train(tmp_path / "base", *bigger, *BASELINE)
  tlt, base = _rollouts(tmp_path / "tlt"), _rollouts(tmp_path / "base")
  assert len(tlt) == len(base) == 96
  assert _metrics(tmp_path / "tlt")[0]["sd_accept_len_mean"] > 1.0
  assert [r["completion"] for r in tlt] != [r["completion"] for r in base]  # other draws
  # Same prompts and policy, so the same distributions (SD is exact at any temperature).
  lengths = stats.ks_2samp([r["tokens"] for r in tlt], [r["tokens"] for r in base])
  assert lengths.pvalue > 1e-3, lengths
  correct = np.array([[sum(r["correct"] for r in run), len(run)] for run in (tlt, base)])
  table = np.array([correct[:, 0], correct[:, 1] - correct[:, 0]]).T
  assert stats.fisher_exact(table).pvalue > 1e-3, table


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_a_rerun_resumes_the_same_trajectory(tmp_path):
  args = ["--config.rl.steps=3", *BASELINE]
  _train(tmp_path / "whole", *args)

  proc = _train(tmp_path / "cut", *args, wait=False)
  metrics = tmp_path / "cut" / "metrics.jsonl"
  deadline = time.time() + 600
  while not (metrics.exists() and metrics.read_text().strip()) and time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert "received SIGTERM" in out
  done = _metrics(tmp_path / "cut")
  assert 1 <= len(done) < 3
  assert sorted(os.listdir(tmp_path / "cut" / "checkpoints"))[-1] == str(len(done))

  out = _train(tmp_path / "cut", *args)
  assert f"resumed from the checkpoint of step {len(done)}" in out
  resumed, whole = _metrics(tmp_path / "cut"), _metrics(tmp_path / "whole")
  assert [m["step"] for m in resumed] == [1, 2, 3]
  for a, b in zip(resumed, whole):
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}


@pytest.mark.parametrize("args,message", [
    (["--config.rl.stesp=3"], "unknown config key 'stesp'"),
    (["--config.model.path=/no/such/folder"], "model.path='/no/such/folder' does not exist"),
    (["--config.mesh.axes.replica=4"], "config error: mesh.axes="),
    (["--config.rl.num_samples=1"], "needs at least 2"),
])
def test_bad_configs_fail_before_any_compile(tmp_path, args, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  t = time.perf_counter()
  r = subprocess.run([sys.executable, "-m", "tlt_jax.train", *RUNLOCAL, "--workdir",
                      str(tmp_path), *args], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=120)
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  assert not (tmp_path / "metrics.jsonl").exists()
  assert time.perf_counter() - t < 60
