"""A job's working folder: made (or refused) with a one-line reason, and held by one run at a
time.

Two runs writing one folder would interleave their metrics and checkpoints; the lock (an
advisory `flock` on WORKDIR/.lock, released by the kernel when the process ends, however it
ends) makes the second one stop before it loads anything.
"""

from __future__ import annotations

import fcntl
import os

import jax

from tlt_jax.config import ConfigError

LOCK_FILE = ".lock"


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


def claim_workdir(path: str) -> WorkdirLock | None:
  """What every job does with its --workdir first: makes it, and on process 0 (the process
  that writes files) takes its lock. Returns the lock to hold until the job ends (None on
  other processes)."""
  if jax.process_index() != 0:
    make_workdir(path)
    return None
  return lock_workdir(path)
