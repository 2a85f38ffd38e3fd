"""A run's JSONL files (metrics.jsonl, eval.jsonl, rollouts.jsonl, timeline.jsonl): appended
line by line as the run goes, made whole again when a run resumes. `RunLog` is the one way
jobs write them, and it mirrors the metrics and eval rows to TensorBoard / W&B when asked
(`tlt_jax.metric_writers`).

A crash can leave a partial last line; a crash between writing a step's rows and its
checkpoint leaves rows of a step that will run again; older runs may have left duplicates.
`resume_jsonl` rewrites a file to exactly one row per key (the first written: the trajectory
the checkpoint continues) up to the step the run resumes from, and says what it dropped.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable

from tlt_jax.metric_writers import scalar_values


def step_key(row: dict):
  """One row per RL step (metrics.jsonl, eval.jsonl)."""
  return row["step"]


def response_key(row: dict):
  """One row per response of a step (rollouts.jsonl)."""
  return row["step"], row["prompt"], row["sample"]


def read_jsonl(path: str) -> tuple[list[dict], int]:
  """The readable rows of a JSONL file (none if it does not exist) and how many lines were
  not (partial or malformed JSON, or not an object with a step)."""
  if not os.path.isfile(path):
    return [], 0
  rows, bad = [], 0
  with open(path, errors="replace") as f:
    for line in f:
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict) and "step" in row:
        rows.append(row)
      else:
        bad += 1
  return rows, bad


def steps_done(workdir: str) -> list[int]:
  """The steps (from 1, sorted) that WORKDIR/metrics.jsonl records: an earlier run's work."""
  rows, _ = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  return sorted({r["step"] for r in rows if r["step"] >= 1})


def resume_jsonl(path: str, up_to: int, key: Callable[[dict], object] = step_key) -> list[dict]:
  """Rewrites `path` (atomically) to the rows with step <= up_to, one per key, in order;
  returns them. Logs a warning naming what was dropped (unreadable lines, duplicates)."""
  rows, bad = read_jsonl(path)
  if not rows and not bad:
    return []
  first: dict = {}  # key -> the first row written with it
  for row in rows:
    if row["step"] <= up_to:
      first.setdefault(key(row), row)
  kept = list(first.values())
  duplicates = sum(row["step"] <= up_to for row in rows) - len(kept)
  if bad or duplicates:
    logging.warning("%s: dropped %d unreadable line(s) (a crash mid-write) and %d duplicate "
                    "row(s); kept %d row(s) up to step %d", path, bad, duplicates, len(kept),
                    up_to)
  write_jsonl(path, kept)
  return kept


def write_json(path: str, obj) -> None:
  """Replaces `path` with obj as indented JSON, atomically (a crash leaves the old or the new
  file, never half of one)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=2)
  os.replace(tmp, path)


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
  """Replaces `path` with these rows, atomically (a crash leaves the old or the new file)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  os.replace(tmp, path)


def replace_folder(staging: str, folder: str) -> None:
  """Puts the complete folder `staging` (written beside `folder`, on its file system) in
  `folder`'s place: renamed onto a missing or empty `folder`; else the old `folder` is renamed
  aside first (put back if the second rename fails) and deleted once the new one is in."""
  if not (os.path.isdir(folder) and os.listdir(folder)):
    os.replace(staging, folder)  # rename(2) replaces an empty folder
    return
  previous = staging + ".previous"
  os.replace(folder, previous)
  try:
    os.replace(staging, folder)
  except OSError:
    os.replace(previous, folder)
    raise
  shutil.rmtree(previous)


def append_jsonl(f, rows: Iterable[dict]) -> None:
  """Appends rows to an open file and flushes them to the OS, so a killed run loses at most
  the line being written."""
  f.writelines(json.dumps(r) + "\n" for r in rows)
  f.flush()


def call_key(row: dict):
  """One row per compiled call of a step's rollout (timeline.jsonl)."""
  return row["step"], row["call"]


# name -> (file, what makes a row unique)
LOG_FILES = {"metrics": ("metrics.jsonl", step_key), "eval": ("eval.jsonl", step_key),
             "rollouts": ("rollouts.jsonl", response_key),
             "timeline": ("timeline.jsonl", call_key)}
MIRRORED = ("metrics", "eval")  # one row per step: the files metric writers mirror


class RunLog:
  """The JSONL logs of a job in `workdir`: `write(name, rows)` appends rows to
  LOG_FILES[name] and flushes them. Opened at `resume_step`, each file is first cut back to
  the rows up to that step (see `resume_jsonl`); `rows[name]` holds the metrics and eval rows
  so far (rollouts are only written). With write=False (processes other than 0 of a
  multi-host run) nothing touches the files.
  mirrors: metric writers (`tlt_jax.metric_writers`) that get every metrics and eval row's
  numbers as scalars tagged '<name>/<key>', and `histogram`s; closed with the log."""

  def __init__(self, workdir: str, resume_step: int, write: bool = True,
               mirrors: Iterable = ()):
    self.workdir, self.enabled, self.mirrors = workdir, write, list(mirrors)
    self.rows: dict[str, list[dict]] = {"metrics": [], "eval": []}
    self._files: dict[str, object] = {}
    if write:
      for name, (filename, key) in LOG_FILES.items():
        kept = resume_jsonl(os.path.join(workdir, filename), up_to=resume_step, key=key)
        if name in self.rows:
          self.rows[name] = kept

  def write(self, name: str, rows: list[dict]) -> None:
    if name in self.rows:
      self.rows[name].extend(rows)
    if not self.enabled:
      return
    if name not in self._files:
      self._files[name] = open(os.path.join(self.workdir, LOG_FILES[name][0]), "a")
    append_jsonl(self._files[name], rows)
    if name in MIRRORED and self.mirrors:
      for row in rows:
        values = scalar_values(name, row)
        for mirror in self.mirrors:
          mirror.scalars(row["step"], values)
      for mirror in self.mirrors:
        mirror.flush()

  def histogram(self, tag: str, step: int, values) -> None:
    """A histogram of values [N] at `step` for the mirrors (no JSONL file holds it)."""
    for mirror in self.mirrors:
      mirror.histogram(tag, step, values)

  def close(self) -> None:
    for f in self._files.values():
      f.close()
    self._files = {}
    for mirror in self.mirrors:
      mirror.close()
    self.mirrors = []

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
