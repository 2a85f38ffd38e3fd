"""A job's working folder: made (or refused) with a one-line reason, held by one run at a
time, and owned by one kind of job.

Two runs writing one folder would interleave their metrics and checkpoints; the lock (an
advisory `flock` on WORKDIR/.lock, released by the kernel when the process ends, however it
ends) makes the second one stop before it loads anything. Two kinds of job in one folder
would overwrite each other's metrics, summary and export, and take each other's checkpoints
for broken ones: WORKDIR/workdir.json records the job that made the folder (and a fingerprint
of its settings), and any other job refuses the folder before it touches a file there.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os

import jax

from tlt_jax.config import ConfigError

LOCK_FILE = ".lock"
RECORD_FILE = "workdir.json"


class WorkdirLock:
  """The held lock of a working folder; `release()` (or the process ending) frees it."""

  def __init__(self, path: str, handle):
    self.path = path
    self._handle = handle

  def release(self) -> None:
    if self._handle is not None:
      fcntl.flock(self._handle, fcntl.LOCK_UN)
      self._handle.close()
      self._handle = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def make_workdir(path: str) -> str:
  """Creates `path` (and its parents) if needed; ConfigError naming the path and the reason
  when it cannot be a folder."""
  try:
    os.makedirs(path, exist_ok=True)
  except (FileExistsError, NotADirectoryError) as e:
    raise ConfigError(f"--workdir {path!r} cannot be a folder: {e.strerror.lower()} "
                      f"({e.filename or path}); choose another --workdir") from None
  except OSError as e:  # permission denied, a read-only file system, ...
    raise ConfigError(f"--workdir {path!r} cannot be created: {e.strerror.lower()} "
                      f"({e.filename or path}); choose another --workdir") from None
  if not os.access(path, os.W_OK):
    raise ConfigError(f"--workdir {path!r} is not writable; choose another --workdir")
  return path


def lock_workdir(path: str) -> WorkdirLock:
  """Creates the folder and takes its lock; ConfigError when another live run holds it."""
  make_workdir(path)
  handle = open(os.path.join(path, LOCK_FILE), "a+")
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.seek(0)
    owner = handle.read().strip() or "unknown"
    handle.close()
    raise ConfigError(f"--workdir {path!r} is in use by another run (pid {owner}); wait for "
                      f"it to finish, stop it, or choose another --workdir") from None
  handle.seek(0)
  handle.truncate()
  handle.write(f"{os.getpid()}\n")
  handle.flush()
  return WorkdirLock(path, handle)


def settings_fingerprint(settings: dict) -> str:
  """16 hex digits of a hash of a job's flat settings (`tlt_jax.config.flat_settings`)."""
  text = json.dumps(settings, sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _earlier_job(path: str) -> str | None:
  """The job that made the folder: its record, else (folders from before the record) what
  its files say, else None (a new or empty folder)."""
  record = os.path.join(path, RECORD_FILE)
  if os.path.isfile(record):
    try:
      with open(record) as f:
        return json.load(f)["job"]
    except (OSError, ValueError, KeyError, TypeError):
      return None  # unreadable: a crash while it was first written; the job rewrites it
  metrics = os.path.join(path, "metrics.jsonl")
  if os.path.isfile(metrics):
    with open(metrics, errors="replace") as f:
      first = f.readline()
    for key, job in (("reward_mean", "train"), ("target_tokens", "sft"),
                     ("top1", "warmup_drafter")):
      if f'"{key}"' in first:
        return job
  if os.path.isfile(os.path.join(path, "generations.jsonl.json")):
    return "warmup_drafter"
  if os.path.isfile(os.path.join(path, "generations.jsonl")):
    return "generate"
  return None


def check_workdir_job(path: str, job: str, settings: dict, write: bool = True) -> None:
  """ConfigError (one line) when another kind of job made the folder; else records `job` and
  its settings' fingerprint in WORKDIR/workdir.json when the folder has no record yet (and
  `write`). job: the job's module name under tlt_jax (train, sft, warmup_drafter, generate)."""
  earlier = _earlier_job(path)
  if earlier is not None and earlier != job:
    raise ConfigError(f"--workdir {path!r} holds a run of python -m tlt_jax.{earlier}; "
                      f"python -m tlt_jax.{job} would overwrite its files: give it another "
                      f"--workdir")
  record = os.path.join(path, RECORD_FILE)
  if write and not os.path.isfile(record):
    tmp = record + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"job": job, "settings_fingerprint": settings_fingerprint(settings),
                 "created": datetime.datetime.now().isoformat(timespec="seconds")}, f, indent=2)
    os.replace(tmp, record)


def claim_workdir(path: str, job: str | None = None,
                  settings: dict | None = None) -> WorkdirLock | None:
  """What every job does with its --workdir first: makes it, and on process 0 (the process
  that writes files) takes its lock; with `job`, refuses a folder another kind of job made
  (check_workdir_job; every process checks, before anything is loaded). Returns the lock to
  hold until the job ends (None on other processes)."""
  if job is not None and os.path.isdir(path):  # read only: the refusal touches nothing
    check_workdir_job(path, job, settings or {}, write=False)
  if jax.process_index() != 0:
    make_workdir(path)
    return None
  lock = lock_workdir(path)
  if job is not None:
    try:  # again under the lock, and recorded
      check_workdir_job(path, job, settings or {})
    except ConfigError:
      lock.release()
      raise
  return lock
