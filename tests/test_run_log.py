"""Run files on resume: one row per step (or per response), partial lines and duplicates
dropped with a warning, atomic rewrites."""

import json
import logging

from tlt_jax.run_log import (RunLog, append_jsonl, read_jsonl, response_key, resume_jsonl,
                             write_jsonl)


def _lines(path):
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_resume_keeps_the_first_row_of_each_step_up_to_the_checkpoint(tmp_path, caplog):
  path = tmp_path / "metrics.jsonl"
  rows = [{"step": 1, "r": "a"}, {"step": 2, "r": "b"}, {"step": 2, "r": "b-again"},
          {"step": 3, "r": "c"}, {"step": 1, "r": "a-again"}]
  with open(path, "w") as f:
    append_jsonl(f, rows)
    f.write('{"step": 4, "r": "cut sh')  # a crash mid-write
  with caplog.at_level(logging.WARNING):
    kept = resume_jsonl(str(path), up_to=2)
  assert kept == [{"step": 1, "r": "a"}, {"step": 2, "r": "b"}] == _lines(path)
  warning = " ".join(r.getMessage() for r in caplog.records)
  assert "1 unreadable line" in warning and "2 duplicate" in warning


def test_resume_of_responses_keys_by_step_prompt_and_sample(tmp_path):
  path = tmp_path / "rollouts.jsonl"
  rows = [{"step": 1, "prompt": 0, "sample": 0}, {"step": 1, "prompt": 0, "sample": 1},
          {"step": 1, "prompt": 0, "sample": 0}, {"step": 2, "prompt": 0, "sample": 0}]
  write_jsonl(str(path), rows)
  assert resume_jsonl(str(path), up_to=1, key=response_key) == rows[:2]


def test_missing_and_clean_files(tmp_path, caplog):
  assert resume_jsonl(str(tmp_path / "none.jsonl"), up_to=3) == []
  assert not (tmp_path / "none.jsonl").exists()
  path = tmp_path / "eval.jsonl"
  write_jsonl(str(path), [{"step": 0}, {"step": 2}])
  with caplog.at_level(logging.WARNING):
    assert resume_jsonl(str(path), up_to=5) == [{"step": 0}, {"step": 2}]
  assert not caplog.records  # nothing dropped, nothing said
  (tmp_path / "junk.jsonl").write_text('[1, 2]\n{"no_step": 1}\n')
  assert read_jsonl(str(tmp_path / "junk.jsonl")) == ([], 2)


def test_run_log_cuts_every_file_back_to_the_resume_step(tmp_path):
  for name in ("metrics.jsonl", "eval.jsonl"):
    write_jsonl(str(tmp_path / name), [{"step": s} for s in (0, 1, 2, 3)])
  write_jsonl(str(tmp_path / "rollouts.jsonl"),
              [{"step": s, "prompt": 0, "sample": 0} for s in (1, 2, 3)])
  with RunLog(str(tmp_path), resume_step=2) as log:
    assert [r["step"] for r in log.rows["metrics"]] == [0, 1, 2]
    assert [r["step"] for r in log.rows["eval"]] == [0, 1, 2]
    log.write("metrics", [{"step": 3, "loss": 0.5}])
    log.write("rollouts", [{"step": 3, "prompt": 0, "sample": 1}])
  assert [r["step"] for r in _lines(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
  assert _lines(tmp_path / "metrics.jsonl")[-1]["loss"] == 0.5
  assert [(r["step"], r["sample"]) for r in _lines(tmp_path / "rollouts.jsonl")] == [
      (1, 0), (2, 0), (3, 1)]


def test_run_log_of_another_process_writes_nothing(tmp_path):
  with RunLog(str(tmp_path), resume_step=0, write=False) as log:
    log.write("metrics", [{"step": 1}])
    assert log.rows["metrics"] == [{"step": 1}]
  assert not list(tmp_path.iterdir())
