"""Runs a pipeline's stages, each the project's own command in a subprocess, and records them:
its output streams to the console and to a log, a stage that finished is recorded in
OUT/stages.json and skipped when the pipeline runs again (a killed run resumes at the stage it
was in)."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

from .common import REPO, read_json, write_json

# What a job prints when its time limit (sft.max_minutes, drafter.warmup.max_minutes) ended
# it, after its evaluation and export; it then exits 75, as a rerun would resume it. Here a
# stage's time limit bounds the stage: its results are the stage's (a signal's stop is not).
TIME_LIMITED = "ended the job after step"


def run_stage(name: str, cmd: list[str], log_path: pathlib.Path) -> float:
  """Runs one stage, echoing its output to the console and the log; seconds it took. A stage
  that its time limit ended counts as done."""
  log_path.parent.mkdir(parents=True, exist_ok=True)
  print(f"=== {name}: {' '.join(cmd)}", flush=True)
  t0 = time.perf_counter()
  time_limited = False
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)
    for line in proc.stdout:
      sys.stdout.write(line)
      log.write(line)
      time_limited = time_limited or TIME_LIMITED in line
    rc = proc.wait()
  if rc != 0 and not (rc == 75 and time_limited):
    sys.exit(f"stage {name!r} failed (exit {rc}); its output is in {log_path}. Run the same "
             f"command again to resume from this stage.")
  return time.perf_counter() - t0


def run_recorded_stages(out: pathlib.Path, quick: bool, commands: dict[str, list[str]],
                        selected) -> dict:
  """Runs the `selected` stages of `commands` ({name: command}, in order) that OUT/stages.json
  does not record as done, recording each as it finishes; returns {name: {command, seconds}}
  of every stage done so far."""
  out.mkdir(parents=True, exist_ok=True)
  record_path = out / "stages.json"
  record = read_json(record_path)
  if record and record.get("quick") != quick:
    sys.exit(f"{out} holds a {'quick' if record.get('quick') else 'full'} run; give another "
             f"--out or delete it")
  record["quick"] = quick
  stages = record.setdefault("stages", {})
  for name, cmd in commands.items():
    if name not in selected:
      continue
    if name in stages:
      print(f"=== {name}: done in an earlier run ({stages[name]['seconds']:.0f} s), skipped")
      continue
    seconds = run_stage(name, cmd, out / "logs" / f"{name}.log")
    stages[name] = {"command": cmd, "seconds": seconds}
    write_json(record_path, record)  # after every stage: resumable
  return stages
