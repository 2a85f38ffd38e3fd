"""The second algorithm and the second task from the command line alone: DAPO on
reasoning_gym's problems, end to end (the main job on the tiny policy's runlocal settings,
without SD: the rollout is tested elsewhere). Its own file, so that it runs beside the main
job's other end-to-end tests."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tlt_jax.rl.answers import extract_hash_answer


@pytest.mark.slow
def test_dapo_on_reasoning_gym_runs_from_the_command_line(tmp_path):
  """DAPO's rounds (each step's responses are its rounds' groups of 4), its kept groups and
  length penalty in the metrics, reasoning_gym's scores in the rewards and its data sets in
  the held-out breakdown; the profile of step 2 (profile.*) names the rollout's and the
  update's programs."""
  run = tmp_path / "dapo_gym"
  r = subprocess.run(
      [sys.executable, "-m", "tlt_jax.train", "--config", "configs/default.py:runlocal",
       "--workdir", str(run), "--config.rl.algorithm=dapo", "--config.task.name=reasoning_gym",
       "--config.rollout.max_prompt_len=384", "--config.rollout.speculative.enable=False",
       "--config.drafter.spot_training=False", "--config.rl.save_rollouts=True",
       "--config.rl.export=False", "--config.rl.eval_samples=0",
       "--config.rl.checkpoint_every=0", "--config.profile.first_step=2",
       "--config.profile.num_steps=1"],
      cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
      timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  metrics = [json.loads(line) for line in open(run / "metrics.jsonl")]
  rollouts = [json.loads(line) for line in open(run / "rollouts.jsonl")]
  assert [m["step"] for m in metrics] == [1, 2]
  for m in metrics:
    assert 1 <= m["rollout_rounds"] <= 3 and 0 <= m["groups_trained"] <= 2
    assert -1 <= m["overlong_penalty_mean"] <= 0
    assert sum(row["step"] == m["step"] for row in rollouts) == 8 * m["rollout_rounds"]
  for row in rollouts:  # reasoning_gym's score in [0, 1] (1: right) + 0.1 for a '#### ' line
    score = row["reward"] - 0.1 * bool(extract_hash_answer(row["completion"]))
    assert -1e-6 <= score <= 1 + 1e-6 and row["correct"] == (score > 1 - 1e-6)
  for e in [json.loads(line) for line in open(run / "eval.jsonl")]:
    groups = e["greedy_accuracy_by"]
    assert set(groups) <= {"chain_sum", "leg_counting"}
    assert sum(total for _, total in groups.values()) == 4
  profile = json.load(open(run / "profile" / "summary.json"))
  programs = {p["program"] for p in profile["programs"]}
  assert profile["steps"] == [2]  # programs named by their kind, as in the compile bill
  assert {"jit_policy_update", "jit_rollout_decode", "jit_rollout_prefill"} <= programs, programs
