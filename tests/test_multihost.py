"""Multi-host: the main job as 2 processes on localhost (jax.distributed, gloo collectives),
each with 4 emulated CPU devices, against the same job as one process with 8 devices.

The mesh is replica=4 x fsdp=2, so each process drives 2 rollout slices (one can spot-train
while the other decodes), the policy update is sharded over both processes, and the updated
policy moves from the global mesh onto each process's slices before step 2.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO

MESH = ["--config.mesh.axes.replica=4", "--config.mesh.axes.fsdp=-1",
        # No evaluation: it is a rollout of other prompts (the same gather of every process's
        # rows) with programs of its own to compile.
        "--config.rl.num_eval_examples=0",
        # A fixed SD strategy: the schedule, and so every sampled token, is the same in both
        # runs (the timing-driven tuner may pick differently).
        "--config.rollout.speculative.tuner=fixed", "--config.rl.save_rollouts=True",
        "--config.rl.micro_batch_rows=8",  # a multiple of the 8 data-parallel devices
        # Step 1 gets mixed rewards in a group (reward 0.35): a non-zero update.
        "--config.seed=4"]
SAME_ON_EVERY_PROCESS = ("steps_done", "reward_first", "reward_last", "accuracy_first",
                         "accuracy_last", "drafter_steps_total")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _worker(out, workdir, *args):
  cmd = [sys.executable, "-m", "tests.multihost_worker", "--config=configs/default.py:runlocal",
         *MESH, *args, f"--out={out}", f"--workdir={workdir}"]
  return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs, timeout=900):
  outs = []
  for p in procs:
    try:
      out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      raise
    outs.append(out)
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-4000:]


def _lines(path):
  return [json.loads(line) for line in open(path)]


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
  port = _free_port()
  dist = ["--config.mesh.num_cpu_devices=4", "--config.mesh.distributed.num_processes=2",
          f"--config.mesh.distributed.coordinator_address=localhost:{port}"]
  # The one-process reference runs beside the two processes: it uses the time they spend
  # waiting for each other.
  t0 = time.perf_counter()
  _wait([_worker(tmp_path / f"p{i}.json", tmp_path / "multi", *dist,
                 f"--config.mesh.distributed.process_id={i}") for i in range(2)]
        + [_worker(tmp_path / "single.json", tmp_path / "single",
                   "--config.mesh.num_cpu_devices=8", "--config.rl.steps=1",
                   "--config.rl.export=False")])
  print(f"the 2-process run and the reference: {time.perf_counter() - t0:.0f} s")

  p0, p1 = (json.load(open(tmp_path / f"p{i}.json")) for i in range(2))
  single = json.load(open(tmp_path / "single.json"))
  assert [p0["process_index"], p1["process_index"]] == [0, 1]
  assert p0["process_count"] == p1["process_count"] == 2
  assert p0["devices"] == p1["devices"] == single["devices"] == 8
  assert p0["local_devices"] == p1["local_devices"] == 4

  # Both processes scored the same completions (each served half of them, then all-gathered)
  # and agree on the results.
  assert len(p0["steps"]) == 2
  assert p0["steps"] == p1["steps"]
  assert {k: p0["summary"].get(k) for k in SAME_ON_EVERY_PROCESS} == \
      {k: p1["summary"].get(k) for k in SAME_ON_EVERY_PROCESS}

  # Step 1 is the one-process run's step 1: the same tokens, and the same update up to the
  # order of floating-point reductions across processes.
  assert p0["steps"][0] == single["steps"][0]
  multi, one = _lines(tmp_path / "multi" / "metrics.jsonl"), \
      _lines(tmp_path / "single" / "metrics.jsonl")
  assert [m["step"] for m in multi] == [1, 2] and [m["step"] for m in one] == [1]
  for key in ("reward_mean", "rollout_tokens", "response_len_max"):
    assert multi[0][key] == one[0][key], key
  assert multi[0]["grad_norm"] > 0
  for key in ("policy_loss", "grad_norm"):
    np.testing.assert_allclose(multi[0][key], one[0][key], rtol=1e-4, atol=1e-6)

  # Process 0 alone wrote the files; orbax wrote the checkpoints from both.
  run = tmp_path / "multi"
  assert len(_lines(run / "rollouts.jsonl")) == 2 * 2 * 4  # steps x prompts x samples
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]
  for name in ("summary.json", "summary.png", "export/policy/model.safetensors",
               "export/eagle/model.safetensors"):
    assert (run / name).is_file(), name
