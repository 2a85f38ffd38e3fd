"""The main job end to end (python -m tlt_jax.train on configs/default.py:runlocal): outputs,
clean stop on SIGTERM and exact resume, healing damaged runs, config errors."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.train_report import METRIC_KEYS
from tlt_jax.workdir import lock_workdir

RUNLOCAL = ["--config", "configs/default.py:runlocal"]
# .ci/run's smoke run adds the same
MAIN_RUN_FLAGS = ["--config.rl.save_rollouts=True", "--config.rl.paired_control=True"]
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
def test_the_main_job_writes_its_outputs(tmp_path):
  """A TLT run (SD with the timing-driven tuner, spot training): metrics, rollouts,
  checkpoints, evaluations, summary and exports. (The campaign's quick run in
  tests/test_experiments.py checks that the baseline and TLT sample the same responses.)

  `.ci/run`'s smoke run of the quick start is this same command; it passes that run's workdir
  in TLT_JAX_MAIN_RUN, which is checked instead of running the job a second time."""
  if os.environ.get("TLT_JAX_MAIN_RUN"):
    run = pathlib.Path(os.environ["TLT_JAX_MAIN_RUN"])
  else:
    run = tmp_path / "tlt"
    _train(run, *MAIN_RUN_FLAGS)
  metrics = _metrics(run)
  assert [m["step"] for m in metrics] == [1, 2]
  for m in metrics:
    assert set(METRIC_KEYS) <= set(m) and m["sd_enabled"]
  # The shipped drafter drafts well (the tuner tries every arm in the first step; it may
  # later decode plainly in a step, and then reports no accept length).
  assert metrics[0]["sd_accept_len_mean"] > 1.5
  # The paired control: before any update the initial policy samples the same responses.
  assert metrics[0]["reward_vs_initial"] == 0 and metrics[0]["accuracy_vs_initial"] == 0
  assert metrics[0]["reward_initial"] == metrics[0]["reward_mean"]
  assert metrics[1]["reward_initial"] + metrics[1]["reward_vs_initial"] == pytest.approx(
      metrics[1]["reward_mean"])
  assert all(m["control_s"] > 0 for m in metrics)
  rollouts = _rollouts(run)
  assert [r["step"] for r in rollouts] == [1] * 8 + [2] * 8  # 2 prompts x 4 samples
  assert len({r["completion"] for r in rollouts}) > len(rollouts) // 2  # sampled
  assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps_done"] == 2 and summary["rollout_share"] > 0
  assert summary["reward_vs_initial_mean"] == metrics[1]["reward_vs_initial"]
  # The control decodes plainly down to the last row: at the runlocal ladder's two batch
  # sizes, 8 and 4 (the slices share programs).
  assert summary["compile_bill_control"]["rollout_decode"]["programs"] == 2
  assert (run / "summary.png").stat().st_size > 10_000
  evals = [json.loads(line) for line in open(run / "eval.jsonl")]
  assert [e["step"] for e in evals] == [0, 2] and summary["eval_step_last"] == 2
  assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(
      os.listdir(run / "export" / "policy"))
  assert {"config.json", "model.safetensors"} == set(os.listdir(run / "export" / "eagle"))

  # The programs the run built, per kind (summary's compile_bill, evaluation included), pinned
  # at what this config builds: a change that compiles more fails here (raise a count only on
  # purpose). The evaluations run the rollout's programs (the temperature is an argument of
  # every program, not part of its key). SD programs: one per slice at the one batch size at
  # or below the SD threshold (the runlocal ladder is 8, 4), in which every arm draws its tree
  # (rollout.speculative.shared_max_batch). Plain decoding:
  # batch 8 on each slice, and batch 4 where a tail found its SD programs still compiling
  # ahead (a run built 4). Row moves (take, harvest) depend on when rows finish: a run built
  # 2 and 5. Prefill: one width (rollout.prompt_widths), one program per batch size and
  # number of distinct prompts. One update program: rl.update_widths gives every step one
  # shape.
  bill = {kind: line["programs"] for kind, line in summary["compile_bill"].items()}
  assert 1 <= bill.pop("rollout_decode_sd") <= 1 * 1 * 2
  assert 2 <= bill.pop("rollout_decode") <= 2 * 2
  assert bill.pop("rollout_take") <= 7 and bill.pop("rollout_harvest") <= 9
  assert bill == {"drafter_update": 2, "policy_update": 1, "rollout_caches": 4,
                  "rollout_prefill": 4, "rollout_store": 2}


# The runs that the two tests below stop, kill, damage and resume: 3 steps (a checkpoint after
# each, the newest 2 kept) and a greedy evaluation of 2 problems at steps 0 and 3.
ARGS = ["--config.rl.steps=3", "--config.rl.num_eval_examples=2", "--config.rl.eval_samples=0"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory):
  """A run of ARGS, uninterrupted: the trajectory every interrupted or damaged run must come
  back to; it also writes TensorBoard event files. Read only (a test that changes it works on
  a copy)."""
  run = tmp_path_factory.mktemp("whole") / "run"
  _train(run, *ARGS, "--config.logging.tensorboard=True")
  return run


@pytest.mark.slow
def test_tensorboard_holds_every_metric_evaluation_and_the_rollout_lengths(whole_run):
  """TensorBoard's own reader finds each number of metrics.jsonl and eval.jsonl at its step,
  tagged by file and key, and a histogram of each step's response lengths."""
  from tests.test_metric_writers import read_events
  scalars, histograms = read_events(whole_run)
  for name in ("metrics", "eval"):
    rows = [json.loads(line) for line in open(whole_run / f"{name}.jsonl")]
    want: dict = {}
    for row in rows:
      for key, value in row.items():
        if key != "step" and isinstance(value, (int, float)):
          want.setdefault(f"{name}/{key}", []).append((row["step"], float(value)))
    got = {tag: v for tag, v in scalars.items() if tag.startswith(name + "/")}
    assert got.keys() == want.keys()
    for tag, points in want.items():
      assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
      np.testing.assert_allclose([v for _, v in got[tag]], [v for _, v in points], rtol=1e-6)
  assert {f"metrics/{k}" for k in METRIC_KEYS if k not in ("step", "drafter_loss",
                                                            "sd_accept_len_mean")} <= set(scalars)
  assert [s for s, _ in scalars["eval/greedy_accuracy"]] == [0, 3]
  assert histograms == {"rollout/response_len": [(1, 8.0), (2, 8.0), (3, 8.0)]}  # 2 x 4


def _wait_for_checkpoint(proc, workdir, step, timeout=600):
  """Waits until the run's checkpoint of `step` is committed (orbax renames it into place)."""
  deadline = time.time() + timeout
  while not (workdir / "checkpoints" / str(step)).is_dir() and time.time() < deadline:
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    time.sleep(0.2)


@pytest.mark.slow
def test_stopped_and_killed_runs_resume_the_same_trajectory(tmp_path, whole_run):
  """SIGTERM stops cleanly after the step; SIGKILL mid-step loses only that step; either
  rerun continues to exactly the metrics of an uninterrupted run (timings aside). (A rerun
  from scratch compiling nothing new: test_damaged_runs_heal_or_stop_in_one_line.)"""
  whole = _metrics(whole_run)
  # The two interrupted runs go side by side: the first run's programs are in the cache now.
  term = _train(tmp_path / "term", *ARGS, wait=False)
  kill = _train(tmp_path / "kill", *ARGS, wait=False)

  _wait_for_checkpoint(term, tmp_path / "term", 1)
  term.send_signal(signal.SIGTERM)
  _wait_for_checkpoint(kill, tmp_path / "kill", 1)
  kill.kill()
  out, _ = term.communicate(timeout=600)
  assert term.returncode == 75, out[-3000:]  # stopped, not finished: a scheduler can tell
  assert "received SIGTERM" in out and "rerun the same command to resume" in out
  done = _metrics(tmp_path / "term")
  assert 1 <= len(done) < 3
  assert sorted(os.listdir(tmp_path / "term" / "checkpoints"))[-1] == str(len(done))
  kill.communicate(timeout=60)

  for name in ("term", "kill"):
    out = _train(tmp_path / name, *ARGS)
    assert "resumed from the checkpoint of step" in out
    resumed = _metrics(tmp_path / name)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(resumed, whole):
      assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}, name


def _broken_policy(tmp_path, damage):
  """A copy of the shipped tiny policy with one kind of damage."""
  folder = tmp_path / f"policy-{damage}"
  shutil.copytree(os.path.join(REPO, "assets", "tiny-policy"), folder)
  if damage == "config-not-json":
    (folder / "config.json").write_text('{"model_type": "qwen2",')
  elif damage == "no-model-type":
    config = json.loads((folder / "config.json").read_text())
    del config["model_type"]
    (folder / "config.json").write_text(json.dumps(config))
  elif damage == "truncated-weights":
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
  elif damage == "no-weights":
    os.remove(folder / "model.safetensors")
  return str(folder)


@pytest.mark.parametrize("args,message", [
    (["--config.rl.stesp=3"], "unknown config key 'stesp'"),
    (["--config.model.path=/no/such/folder"], "model.path='/no/such/folder' does not exist"),
    (["--config.mesh.axes.replica=4"], "config error: mesh.axes="),
    (["--config.rl.num_samples=1"], "needs at least 2"),
    ("config-not-json", "config.json is not valid JSON"),
    ("no-model-type", "config.json has no model_type"),
    ("truncated-weights", "model.safetensors is truncated or corrupt"),
    ("no-weights", "has no weights: neither model.safetensors"),
    ("workdir-under-a-file", "cannot be a folder"),
    ("workdir-in-use", "is in use by another run"),
    (["--config.rollout.max_prompt_len=64"],
     "rollout.max_prompt_len=64 is below the arithmetic task's longest prompt, 119 tokens"),
    ("long-prompt-file", "train.jsonl:2: the prompt has 310 tokens, more than "
                         "rollout.max_prompt_len=128"),
    ([f"--config.drafter.eagle.path={os.path.join(REPO, 'assets', 'tiny-policy')}"],
     "not a drafter export"),
    (["--config.rollout.speculative.arms=('4,2,8,medusa',)"],
     "unknown drafter 'medusa' in a strategy; the registered drafters are"),
    (["--config.drafter.names=('eagle','nope')"], "drafter.names=('eagle', 'nope'): unknown "
                                                   "drafter 'nope'; the registered drafters are"),
    (["--config.drafter.mtp.num_heads=2"], "drafter.mtp.num_heads=2 is set but the run does not "
                                           "use drafter 'mtp'"),
])
def test_bad_inputs_fail_in_one_line_before_any_compile(tmp_path, args, message):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  workdir = tmp_path / "run"
  lock = None
  if args == "workdir-under-a-file":
    (tmp_path / "a-file").write_text("")
    workdir, args = tmp_path / "a-file" / "run", []
  elif args == "workdir-in-use":
    lock, args = lock_workdir(str(workdir)), []  # a live run holds it
  elif args == "long-prompt-file":
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n"
                            for q in ("What is 0+1?", "Add one. " * 50)))
    args = [f"--config.task.data_path={data}", "--config.rl.num_eval_examples=0"]
  elif isinstance(args, str):
    args = [f"--config.model.path={_broken_policy(tmp_path, args)}"]
  t = time.perf_counter()
  r = subprocess.run([sys.executable, "-m", "tlt_jax.train", *RUNLOCAL, "--workdir",
                      str(workdir), *args], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=120)
  if lock is not None:
    lock.release()
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
  assert len([line for line in r.stderr.splitlines() if "error" in line]) == 1, r.stderr
  assert not (tmp_path / "run" / "metrics.jsonl").exists()
  assert time.perf_counter() - t < 60


@pytest.mark.parametrize("job", ["tlt_jax.sft", "tlt_jax.warmup_drafter", "tlt_jax.generate"])
def test_every_job_takes_the_workdir_lock(tmp_path, job):
  """Two runs of one job on one folder would interleave their files: the second stops."""
  lock = lock_workdir(str(tmp_path / "run"))
  try:
    r = subprocess.run([sys.executable, "-m", job, *RUNLOCAL, "--workdir",
                        str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
  finally:
    lock.release()
  assert r.returncode != 0 and "is in use by another run" in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr


def _break_checkpoint(workdir, step):
  """Removes a checkpoint's array data, as a crash mid-write or a bad disk leaves it."""
  shutil.rmtree(workdir / "checkpoints" / str(step) / "state")


@pytest.mark.slow
def test_damaged_runs_heal_or_stop_in_one_line(tmp_path, whole_run):
  """Nothing lost: broken checkpoints are moved aside and rewritten, run files keep one row
  per step, a run with no loadable checkpoint refuses to overwrite earlier results unless
  asked (--start_over, which keeps them and compiles nothing new), and a stop during the
  step-0 evaluation does not repeat its row."""
  run = tmp_path / "run"
  shutil.copytree(whole_run, run)
  original, evals = _metrics(run), (run / "eval.jsonl").read_text()
  assert [m["step"] for m in original] == [1, 2, 3] and sorted(os.listdir(run / "checkpoints")) \
      == ["2", "3"]

  # Damage: the newest checkpoint broken, a duplicate row and a partial last line in the
  # metrics, a second step-0 row in eval.jsonl.
  _break_checkpoint(run, 3)
  with open(run / "metrics.jsonl", "a") as f:
    f.write(json.dumps(original[0]) + "\n" + '{"step": 4, "reward_me')
  with open(run / "eval.jsonl", "a") as f:
    f.write(evals.splitlines()[0] + "\n")
  out = _train(run, *ARGS)
  assert "resumed from the checkpoint of step 2" in out
  healed = _metrics(run)
  assert [m["step"] for m in healed] == [1, 2, 3]
  for a, b in zip(healed, original):
    assert {k: a[k] for k in SAME} == {k: b[k] for k in SAME}
  assert [json.loads(line)["step"] for line in open(run / "eval.jsonl")] == [0, 3]
  assert os.listdir(run / "failed_checkpoints") == ["3"]
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "3"]  # step 3 written again
  summary = json.loads((run / "summary.json").read_text())
  assert summary["steps_done"] == 3

  # Settings that change what a checkpoint holds (no drafter state without spot training):
  # the checkpoints are not corrupt, so nothing is moved; the run stops naming the change.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "tlt_jax.train", *RUNLOCAL, "--workdir", str(run), *ARGS]
  r = subprocess.run(cmd + ["--config.drafter.spot_training=False", "--config.rl.steps=4"],
                     cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "config error: the checkpoint of step 3" in r.stderr
  # rl.steps may change alone on a rerun: the refusal names only what blocks the restore.
  assert "drafter.spot_training: True -> False" in r.stderr and "rl.steps" not in r.stderr
  assert sorted(os.listdir(run / "checkpoints")) == ["2", "3"]
  assert os.listdir(run / "failed_checkpoints") == ["3"]  # only the earlier damage

  # No checkpoint loads: stop in one line, naming what failed and the way out.
  for step in (2, 3):
    _break_checkpoint(run, step)
  r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
  assert "holds an earlier run (metrics of steps 1-3)" in r.stderr
  assert "step 3: " in r.stderr and "--start_over" in r.stderr
  assert _metrics(run) == healed  # untouched
  # --start_over keeps the earlier run aside and starts step 1 again from scratch: the same
  # responses, and every program loads from the persistent compilation cache. Its time limit
  # (0.001 minutes) makes step 1 the last: evaluated and exported, and it exits 75 like a
  # stopped run, since its rerun goes on to rl.steps.
  again = _train(run, *ARGS, "--start_over", "--config.rl.max_minutes=0.001", wait=False)
  out, _ = again.communicate(timeout=900)
  assert again.returncode == 75, out[-3000:]
  previous = [d for d in os.listdir(run) if d.startswith("previous-")]
  assert len(previous) == 1
  assert [json.loads(line) for line in open(run / previous[0] / "metrics.jsonl")] == healed
  assert "rl.max_minutes=0.001 reached: step 1 is the last" in out
  assert ("rl.max_minutes=0.001 ended the job after step 1 of 3 with a checkpoint; rerun the "
          "same command to resume (exit status 75)") in out
  (first,) = _metrics(run)
  assert {k: first[k] for k in SAME} == {k: original[0][k] for k in SAME}
  summary = json.loads((run / "summary.json").read_text())
  # (Only the programs kept out of the cache compile again: tlt_jax.compile_cache.
  # guard_cpu_collectives.)
  assert summary["xla_compiles"] == summary["xla_kept_out_of_cache"]
  assert summary["xla_cache_hits"] > 0
  assert summary["time_limited"] is True and summary["stopped_early"] is False
  assert (run / "export" / "policy" / "model.safetensors").exists()

  # Problems from JSON-lines files, in a folder where a run was stopped during its step-0
  # evaluation (eval.jsonl holds that row, nothing else exists). Every answer is -1, which the
  # policy never writes: accuracy 0 shows the file's answers are the ones scored.
  fresh = tmp_path / "fresh"
  fresh.mkdir()
  for name, seed in (("train.jsonl", 5), ("heldout.jsonl", 6)):
    problems = ArithmeticTask(seed=seed, max_ops=3).examples(8)
    (tmp_path / name).write_text("".join(json.dumps({"question": ex.prompt, "answer": "-1"})
                                         + "\n" for ex in problems))
  (fresh / "eval.jsonl").write_text(json.dumps({"step": 0, "accuracy": 0.0}) + "\n")
  _train(fresh, *ARGS, "--config.rl.steps=1", "--config.rl.reward=answer",
         f"--config.task.data_path={tmp_path / 'train.jsonl'}",
         f"--config.task.eval_data_path={tmp_path / 'heldout.jsonl'}")
  assert [json.loads(line)["step"] for line in open(fresh / "eval.jsonl")] == [0, 1]
  (row,) = _metrics(fresh)
  assert row["accuracy"] == 0.0 and row["reward_mean"] == 0.0
  assert json.loads((fresh / "eval.jsonl").read_text().splitlines()[1])["accuracy"] == 0.0
