"""The campaign runner: a campaign is {stage name: command}, each run in its own process from
the repository root, its output streamed to the console and OUT/logs/STAGE.log, and recorded
after every stage in one JSON file (docs/reproducing.md); a rerun resumes at the stage it was
in."""

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
# The files a stage's record lists: what people read, not checkpoints or caches.
RESULT_SUFFIXES = (".json", ".csv", ".png")


def run_stage(name: str, cmd: list[str], log_path: pathlib.Path) -> tuple[int, float]:
  """Runs one stage, echoing its output to the console and the log: its exit status (0 for
  a stage that its time limit ended) and the seconds it took."""
  log_path.parent.mkdir(parents=True, exist_ok=True)
  print(f"=== {name}: {' '.join(map(str, cmd))}", flush=True)
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
  return (0 if rc == 75 and time_limited else rc), time.perf_counter() - t0


def _written_since(out: pathlib.Path, t0: float, record_path: pathlib.Path) -> list[str]:
  return sorted(str(p.relative_to(out)) for p in out.rglob("*")
                if p.suffix in RESULT_SUFFIXES and p.is_file() and p != record_path
                and p.stat().st_mtime >= t0)


def run_stages(out: pathlib.Path, commands: dict[str, list[str]], selected, quick: bool,
               record_name: str = "stages.json", resume: bool = True,
               keep_going: bool = False) -> dict:
  """Runs the `selected` stages of `commands` ({name: command}, in order) and records them in
  OUT/record_name ({quick, stages: {name: {command, returncode, seconds, files}}}); returns
  that record's stages. A failed stage ends the campaign (exit with one line naming its log)
  unless `keep_going`."""
  out.mkdir(parents=True, exist_ok=True)
  record_path = out / record_name
  record = read_json(record_path) if resume else {}
  if record and record.get("quick") != quick:
    sys.exit(f"{out} holds a {'quick' if record.get('quick') else 'full'} run; give another "
             f"--out or delete it")
  record["quick"] = quick
  stages = record.setdefault("stages", {})
  for name, cmd in commands.items():
    if name not in selected:
      continue
    if resume and name in stages and stages[name].get("returncode", 0) == 0:
      print(f"=== {name}: done in an earlier run ({stages[name]['seconds']:.0f} s), skipped")
      continue
    t0 = time.time()
    log_path = out / "logs" / f"{name}.log"
    rc, seconds = run_stage(name, cmd, log_path)
    stages[name] = {"command": cmd, "returncode": rc, "seconds": seconds,
                    "files": _written_since(out, t0, record_path)}
    write_json(record_path, record)  # after every stage: nothing lost on a crash
    if rc != 0:
      message = f"stage {name!r} failed (exit {rc}); its output is in {log_path}"
      if not keep_going:
        sys.exit(f"{message}. Run the same command again to resume from this stage.")
      print(f"=== {message}", flush=True)
  return stages
