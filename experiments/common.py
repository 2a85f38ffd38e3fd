"""What the experiments share: the repository root, a run's record (device, jax version, date,
commit, command line), JSON written whole, and the command that runs a sibling as a module."""

from __future__ import annotations

import datetime
import pathlib
import shlex
import subprocess
import sys

from tlt_jax import run_log

REPO = pathlib.Path(__file__).resolve().parents[1]


def git_commit(repo: pathlib.Path = REPO) -> str | None:
  """The checkout's HEAD, or None where there is no git or no checkout (a copied tree)."""
  try:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                          text=True, timeout=10).stdout.strip() or None
  except (OSError, subprocess.SubprocessError):
    return None


def run_metadata(device=None) -> dict:
  """Where and how this run was made: device (default: JAX's first), jax version, UTC date,
  commit, command line."""
  import jax
  device = device or jax.devices()[0]
  return {"device": {"platform": device.platform, "device_kind": device.device_kind},
          "jax_version": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "git_commit": git_commit(), "command": shlex.join(sys.argv)}


def write_json(path, doc) -> None:
  """Replaces path with doc as indented JSON in one step (a run killed mid-write keeps the
  previous version)."""
  run_log.write_json(str(path), doc)


def module_command(name: str, *args) -> list[str]:
  """argv that runs experiments/<name>.py (or tools/<name>.py for 'tools.<name>') as a module;
  run it with cwd=REPO."""
  module = name if "." in name else f"experiments.{name}"
  return [sys.executable, "-m", module, *map(str, args)]
