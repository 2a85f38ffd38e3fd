"""The jobs' skeleton (tlt_jax.job.Job): the lock and the files on the writing process only,
a clean stop on SIGTERM, JSON written whole, the compile account."""

import json
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.config import ConfigError
from tlt_jax.job import Job
from tlt_jax.profiling import latest_trace


def test_only_the_writing_process_locks_writes_and_speaks(tmp_path, monkeypatch, capsys):
  workdir = str(tmp_path / "run")
  with Job(workdir) as writer:
    assert writer.writer
    with pytest.raises(ConfigError, match="is in use by another run"):
      Job(workdir).__enter__()  # a second run on the folder stops
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with Job(workdir) as other:  # another process of the same run: no lock, no files
      assert not other.writer
      other.write_json("summary.json", {"a": 1})
      other.say("from process 1")
      with other.run_log() as log:
        log.write("metrics", [{"step": 1}])
      assert other.progress(total=3).disable
    assert sorted(os.listdir(workdir)) == [".lock"]
    assert "from process 1" not in capsys.readouterr().out
    monkeypatch.undo()
    writer.write_json("summary.json", {"a": 1})
    writer.say("from process 0")
  assert json.load(open(os.path.join(workdir, "summary.json"))) == {"a": 1}
  assert not os.path.exists(os.path.join(workdir, "summary.json.tmp"))
  assert "from process 0" in capsys.readouterr().out
  with Job(workdir):  # released at the end
    pass


def test_sigterm_asks_for_a_stop_and_the_handlers_come_back(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  with Job(str(tmp_path)) as job:
    assert not job.stop.requested
    os.kill(os.getpid(), signal.SIGTERM)
    assert job.stop.requested
  assert signal.getsignal(signal.SIGTERM) is before


def test_after_the_first_signal_the_next_one_ends_the_process_in_the_kernel(tmp_path):
  """A Python handler runs only between bytecodes, not in a compile's C++: the first signal
  leaves the default actions in place, so that a second stops the process at once."""
  before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
  with Job(str(tmp_path)):
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, before[signal.SIGTERM])
    os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == signal.SIG_DFL
  assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_phase_says_what_the_job_does_beats_while_silent_and_ends_a_stopped_job(tmp_path,
                                                                                 capsys):
  from tlt_jax.job import EXIT_STOPPED
  with pytest.raises(SystemExit) as stopped:
    with Job(str(tmp_path), heartbeat_s=0.5) as job:
      job.phase("compiling the rollout")
      time.sleep(2.5)  # silent: the heartbeat says the phase still runs
      out = capsys.readouterr().out
      assert out.startswith("[     0 s] compiling the rollout\n")
      assert "s] still compiling the rollout (0 programs compiled so far)" in out
      os.kill(os.getpid(), signal.SIGTERM)
      job.phase("the policy update")
  assert stopped.value.code == EXIT_STOPPED
  err = capsys.readouterr().err
  assert err.endswith("stopped by a signal before the policy update; rerun the same command to "
                      "go on (exit status 75)\n")
  with Job(str(tmp_path)):  # the lock was released before the exit
    pass


@pytest.mark.parametrize("problem", ["a file", "not writable"])
def test_a_tensorboard_folder_that_cannot_be_written_is_one_line(tmp_path, monkeypatch, problem):
  from tlt_jax.config import base_config
  config = base_config()
  config.logging.tensorboard = True
  folder = tmp_path / "tensorboard"
  if problem == "a file":
    folder.write_text("")
    why = "file exists"
  else:  # as root any folder is writable: the check asks os.access
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: p != str(folder) and real(p, mode))
    why = "not writable"
  with Job(str(tmp_path)) as job:
    with pytest.raises(ConfigError) as e:
      job.run_log(config=config)
  assert str(e.value) == (f"logging.tensorboard=True writes to {folder}, which cannot be a "
                          f"writable folder ({why}); move what is there away, or set "
                          f"logging.tensorboard=False")


@pytest.mark.slow
def test_a_job_says_what_it_does_at_once_stops_on_a_signal_in_setup_and_at_once_on_two(
    tmp_path):
  """The warm-up job (once silent for minutes, then deaf to a second SIGTERM): its
  first line, at its start, names the mesh; a signal during setup ends it at the next phase
  (exit 75), two end it at once; the same command then runs to the end and names the folder
  to pass as drafter.eagle.path."""
  import subprocess
  import sys
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "-m", "tlt_jax.warmup_drafter", "--config", "configs/default.py:runlocal",
         "--workdir", str(tmp_path / "w")]
  for signals, returncode in ((1, 75), (2, -signal.SIGTERM)):
    proc = subprocess.Popen(cmd, cwd=repo, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stdout.readline()
    assert first.startswith("[     0 s] mesh {'replica': 2, 'fsdp': 1, 'tensor': 1} on 2 "
                            "devices; loading"), first + proc.stderr.read()[-2000:]
    for _ in range(signals):
      proc.send_signal(signal.SIGTERM)
      time.sleep(0.1)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == returncode, err[-2000:]
    assert "received SIGTERM: stopping after this step" in out + err
    assert ("stopped by a signal before " in err) == (signals == 1)
  done = subprocess.run(cmd, cwd=repo, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  assert f"--config.drafter.eagle.path={tmp_path / 'w' / 'export' / 'eagle'}" in done.stdout
  assert "s] training eagle for 6 steps" in done.stdout


def test_the_compile_account_counts_the_job_s_compiles(tmp_path):
  with Job(str(tmp_path)) as job:
    assert job.compiles()["xla_compiles"] == 0
    jax.jit(lambda x: jnp.sin(x) * 3.25 + 0.125)(jnp.arange(7.0)).block_until_ready()
    counted = job.compiles()
    assert counted["xla_compiles"] + counted["xla_cache_hits"] >= 1
    assert job.wall_s > 0


def test_time_up_turns_true_after_max_minutes_and_never_without_a_limit(tmp_path, monkeypatch):
  with Job(str(tmp_path / "a")) as unlimited:
    assert not unlimited.time_up()
  with Job(str(tmp_path / "b"), max_minutes=1.0) as job:
    assert not job.time_up()  # it has just begun
    job.started -= 59.0
    assert not job.time_up()
    job.started -= 2.0
    assert job.time_up()
    # Several processes take process 0's answer (which here says: not yet).
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    from jax.experimental import multihost_utils
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", lambda x: x & False)
    assert not job.time_up()


def test_the_profile_window_traces_those_steps_and_says_where_the_time_went(tmp_path, capsys):
  """Steps 2 and 3 of 4 traced (1-based, as in metrics.jsonl); the summary names the program
  and its ops; a loop that ends inside the window (4 of steps 3..7) still ends its trace."""
  @jax.jit
  def double(x):
    return jnp.tanh(x @ x) * 2.0
  x = jnp.ones((64, 64))
  workdir = str(tmp_path / "run")
  with Job(workdir, show_progress=False, profile=(2, 2)) as job:
    for step in range(4):
      with job.traced(step + 1, lambda: y):
        y = double(x)
  summary = json.load(open(os.path.join(workdir, "profile", "summary.json")))
  assert summary["steps"] == [2, 3] and summary["source"] == "host"  # XLA:CPU runs ops on host
  assert summary["op_s"] > 0 and summary["programs"][0]["program"] == "jit_double"
  assert sum(op["calls"] for op in summary["ops"]) >= 2 and summary["kinds"]
  assert abs(sum(p["share"] for p in summary["programs"]) - 1.0) < 1e-9
  assert os.path.getsize(os.path.join(workdir, "profile", "top_ops.png")) > 0
  assert "profile of steps [2, 3]" in capsys.readouterr().out

  with Job(str(tmp_path / "short"), show_progress=False, profile=(3, 5)) as job:
    for step in range(4):
      with job.traced(step + 1, lambda: y):
        y = double(x)
  assert json.load(open(tmp_path / "short" / "profile" / "summary.json"))["steps"] == [3, 4]
  with Job(str(tmp_path / "none"), show_progress=False) as job:  # no window: no trace
    with job.traced(1):
      double(x)
  assert not os.path.exists(tmp_path / "none" / "profile")
  with pytest.raises(FileNotFoundError, match="no jax.profiler trace .* under .*none"):
    latest_trace(str(tmp_path / "none"))


def test_a_profiler_that_cannot_start_leaves_the_job_running(tmp_path, monkeypatch, capsys):
  def refuse(folder):
    raise RuntimeError("no profiling library\nsecond line")
  monkeypatch.setattr(jax.profiler, "start_trace", refuse)
  with Job(str(tmp_path / "run"), show_progress=False, profile=(1, 2)) as job:
    for step in range(3):
      with job.traced(step + 1):
        pass
  out = capsys.readouterr().out
  assert out.count("jax.profiler could not start (no profiling library); no trace") == 1
  assert not os.path.exists(tmp_path / "run" / "profile")


def test_a_workdir_is_refused_by_every_job_but_the_one_that_made_it(tmp_path):
  """WORKDIR/workdir.json records the job and its settings' fingerprint; another kind of job
  stops in one line before it writes anything there; the same job (a resume) goes on."""
  workdir = str(tmp_path / "run")
  with Job(workdir, name="train", settings={"rl.steps": 2}) as job:
    job.write_json("summary.json", {"steps_done": 2})
  with open(os.path.join(workdir, "workdir.json")) as f:
    record = json.load(f)
  assert record["job"] == "train" and len(record["settings_fingerprint"]) == 16
  before = {name: os.path.getmtime(os.path.join(workdir, name)) for name in os.listdir(workdir)}
  for other in ("warmup_drafter", "sft", "generate"):
    with pytest.raises(ConfigError, match=rf"^--workdir '.*run' holds a run of python -m "
                       rf"tlt_jax.train; python -m tlt_jax.{other} would overwrite its files: "
                       rf"give it another --workdir$"):
      Job(workdir, name=other, settings={}).__enter__()
  after = {name: os.path.getmtime(os.path.join(workdir, name)) for name in os.listdir(workdir)}
  assert after == before
  with Job(workdir, name="train", settings={"rl.steps": 4}):  # a resume with more steps
    pass
  with open(os.path.join(workdir, "workdir.json")) as f:
    assert json.load(f) == record  # it still says what made the folder


def test_a_workdir_from_before_the_record_is_known_by_its_files(tmp_path):
  rows = {"train": {"step": 1, "reward_mean": 0.5}, "sft": {"step": 1, "loss": 2.0,
                                                           "target_tokens": 9.0},
          "warmup_drafter": {"step": 1, "loss": 1.0, "top1": 0.2}}
  for job, row in rows.items():
    workdir = tmp_path / job
    workdir.mkdir()
    (workdir / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    others = [name for name in (*rows, "generate") if name != job]
    with pytest.raises(ConfigError, match=f"holds a run of python -m tlt_jax.{job};"):
      Job(str(workdir), name=others[0]).__enter__()
    with Job(str(workdir), name=job):
      pass
  (tmp_path / "gen").mkdir()
  (tmp_path / "gen" / "generations.jsonl").write_text("")
  with pytest.raises(ConfigError, match="holds a run of python -m tlt_jax.generate;"):
    Job(str(tmp_path / "gen"), name="train").__enter__()


def test_the_warmup_job_refuses_a_train_run_s_workdir_in_one_line(tmp_path):
  """The case that failed once: python -m tlt_jax.warmup_drafter over a train run's workdir moved its
  checkpoints aside and overwrote its metrics; now it exits at once and touches nothing."""
  import subprocess
  import sys

  workdir = tmp_path / "train_run"
  with Job(str(workdir), name="train", settings={}):
    pass
  (workdir / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
  (workdir / "checkpoints").mkdir()
  listing = sorted(os.listdir(workdir))
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, "-m", "tlt_jax.warmup_drafter", "--config",
                         "configs/default.py:runlocal", f"--workdir={workdir}"], cwd=repo,
                        capture_output=True, text=True, timeout=300,
                        env=dict(os.environ, PYTHONPATH=repo))
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines() == [
      f"config error: --workdir '{workdir}' holds a run of python -m tlt_jax.train; python -m "
      f"tlt_jax.warmup_drafter would overwrite its files: give it another --workdir"]
  assert sorted(os.listdir(workdir)) == listing
  assert (workdir / "metrics.jsonl").read_text() == '{"step": 1, "reward_mean": 0.5}\n'


def test_a_time_limit_ends_the_job_with_the_status_of_a_stopped_one(tmp_path, capsys):
  """A job its time limit cut short exits 75 like a stopped one (the same command resumes
  it); a job that reached its last step is not marked."""
  from tlt_jax.job import EXIT_STOPPED, exit_stopped

  with Job(str(tmp_path), max_minutes=1.0) as job:
    assert job.last_step(3, 10, "sft.max_minutes") == 10 and job.time_limited is None
    job.started -= 61.0
    assert job.last_step(10, 10, "sft.max_minutes") == 10 and job.time_limited is None
    assert job.last_step(4, 10, "sft.max_minutes") == 4
  what, where = job.time_limited
  with pytest.raises(SystemExit) as stopped:
    exit_stopped(where, what)
  assert stopped.value.code == EXIT_STOPPED == 75
  assert capsys.readouterr().err == (
      "sft.max_minutes=1.0 ended the job after step 4 of 10 with a checkpoint; rerun the same "
      "command to resume (exit status 75)\n")


def test_a_profile_window_past_the_last_step_is_one_line():
  """profile.first_step past the job's last step traced nothing and said nothing."""
  from tlt_jax.config import base_config
  from tlt_jax.job import check_profile_window

  config = base_config()
  config.profile.update(first_step=21, num_steps=2)
  with pytest.raises(ConfigError, match=r"^profile.first_step=21 is past the job's last step "
                     r"\(rl.steps=20\): nothing would be traced; set profile.first_step "
                     r"between 1 and 20, or profile.num_steps=0$"):
    check_profile_window(config, config.rl.steps, "rl.steps")
  config.profile.first_step = 20
  check_profile_window(config, config.rl.steps, "rl.steps")  # the last step is traced
  config.profile.update(first_step=500, num_steps=0)
  check_profile_window(config, config.rl.steps, "rl.steps")  # no trace asked for


def test_an_export_is_written_whole_or_not_at_all(tmp_path):
  """An export goes to a folder beside its place and is renamed in: a full disk mid-export
  stops the job in one line naming the folder and the space it needs, leaving the earlier
  export as it was and no half-written folder (it left config.json without weights)."""
  from tlt_jax.config import RunStopped

  def save(folder, tree, label):
    with open(os.path.join(folder, "config.json"), "w") as f:
      f.write(label)
    if label == "full disk":
      raise OSError(28, "No space left on device", os.path.join(folder, "model.safetensors"))
    if label == "safetensors":  # how safetensors reports it: not an OSError
      raise RuntimeError("Error while serializing: I/O error: No space left on device (os "
                         "error 28)")
    np.save(os.path.join(folder, "w.npy"), tree["w"])

  tree = {"w": jnp.zeros((1024, 256), jnp.float32)}  # 1 MB
  with Job(str(tmp_path / "run")) as job:
    policy = job.path("export", "policy")
    job.export(save, policy, tree, "first")
    job.export(save, policy, tree, "second")  # replaces the earlier export whole
    assert sorted(os.listdir(policy)) == ["config.json", "w.npy"]
    with pytest.raises(RunStopped, match=r"^the export to .*export/policy could not be "
                       r"written: no space left on device \(.*model.safetensors\); it needs "
                       r"about 1 MB; no half-written export is left"):
      job.export(save, policy, tree, "full disk")
    with pytest.raises(RunStopped, match=r"^the export to .*export/policy could not be "
                       r"written: no space left on device \(.*export\); it needs about 1 MB"):
      job.export(save, policy, tree, "safetensors")
  assert open(os.path.join(policy, "config.json")).read() == "second"
  assert os.listdir(job.path("export")) == ["policy"]


def test_a_job_that_loaded_no_checkpoint_refuses_to_overwrite_an_earlier_runs_metrics(tmp_path):
  """The warm-up over its own earlier run whose checkpoints an earlier version wrote (none
  loads) started from step 0 and overwrote 500 steps of metrics and evaluations; now the run
  log refuses before writing, and a resumed run (or a fresh folder) goes on as before."""
  workdir = tmp_path / "warm"
  rows = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3))
  workdir.mkdir()
  (workdir / "metrics.jsonl").write_text(rows)
  (workdir / "eval.jsonl").write_text('{"step": 3, "accept_len": 2.4}\n')
  with Job(str(workdir), name="warmup_drafter", settings={}) as job:
    with pytest.raises(ConfigError, match=r"holds an earlier run of python -m "
                       r"tlt_jax.warmup_drafter \(metrics of steps 1-3\) but none of its "
                       r"checkpoints loaded"):
      job.run_log(resume_step=0)
    assert (workdir / "metrics.jsonl").read_text() == rows
    assert (workdir / "eval.jsonl").read_text() == '{"step": 3, "accept_len": 2.4}\n'
    with job.run_log(resume_step=3) as log:  # resumed from its checkpoint of step 3
      log.write("metrics", [{"step": 4, "loss": 0.2}])
  assert [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")] == [1, 2, 3, 4]
  with Job(str(tmp_path / "new"), name="warmup_drafter", settings={}) as job:
    with job.run_log(resume_step=0) as log:
      log.write("metrics", [{"step": 1, "loss": 1.0}])
