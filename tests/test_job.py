"""The jobs' skeleton (tlt_jax.job.Job): the lock and the files on the writing process only,
a clean stop on SIGTERM, JSON written whole, the compile account."""

import json
import os
import signal

import jax
import jax.numpy as jnp
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
