"""What the experiments share: the repository root, a run's record, JSON written whole and read
back, folders a script may replace (its own, marked), the command that runs a sibling, the
--config/--set and --strategies flags, a median timer, and figures written to files."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time

import numpy as np

from tlt_jax import run_log
from tlt_jax.config import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]


def _git(repo: pathlib.Path, *args) -> str | None:
  try:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                         timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout if out.returncode == 0 else None


def git_commit(repo: pathlib.Path = REPO) -> str | None:
  """The checkout's HEAD, or None where there is no git or no checkout (a copied tree)."""
  return (_git(repo, "rev-parse", "HEAD") or "").strip() or None


def uncommitted_files(repo: pathlib.Path = REPO) -> list[str] | None:
  """The tracked files whose content differs from HEAD's (staged or not), sorted: a record
  made from such a tree was not made by its commit alone. None where git_commit is None."""
  if git_commit(repo) is None:
    return None
  out = _git(repo, "status", "--porcelain", "--untracked-files=no", "--no-renames")
  # Porcelain v1: two status letters, a space, the path.
  return None if out is None else sorted(line[3:] for line in out.splitlines() if line.strip())


def run_metadata(device=None) -> dict:
  """Where and how this run was made: device (default: JAX's first), jax version, UTC date,
  commit, the tracked files changed since it (`uncommitted_files`), command line."""
  import jax
  device = device or jax.devices()[0]
  return {"device": {"platform": device.platform, "device_kind": device.device_kind},
          "jax_version": jax.__version__,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "git_commit": git_commit(), "uncommitted": uncommitted_files(),
          "command": shlex.join(sys.argv)}


def run_stamp() -> dict:
  """When and from what a record was made, as the GPU headline's records write it: the date,
  the commit, the tracked files changed since it (`uncommitted_files`) and the command line."""
  return {"date": datetime.date.today().isoformat(), "commit": git_commit(),
          "uncommitted": uncommitted_files(), "command": " ".join(sys.argv)}


def write_json(path, doc) -> None:
  """Replaces path with doc as indented JSON in one step (a run killed mid-write keeps the
  previous version)."""
  run_log.write_json(str(path), doc)


def read_json(path: pathlib.Path) -> dict:
  """The JSON object at path, or {} where there is no such file (a stage that has not run)."""
  return json.loads(path.read_text()) if path.is_file() else {}


def module_command(name: str, *args) -> list[str]:
  """argv that runs experiments/<name>.py (or tools/<name>.py for 'tools.<name>') as a module;
  run it with cwd=REPO."""
  module = name if "." in name else f"experiments.{name}"
  return [sys.executable, "-m", module, *map(str, args)]


def check_own_folder(path: pathlib.Path, script: str) -> pathlib.Path:
  """The mark file of `script`'s own folder `path`; ConfigError (one line, naming the folder
  and the fix) when `path` is a file, or a folder that holds anything without that mark."""
  mark = path / f".made_by_{script}"
  if path.exists() and not mark.is_file() and (not path.is_dir() or any(path.iterdir())):
    what = "is a file" if not path.is_dir() else f"holds files that {script} did not write"
    raise ConfigError(f"{path} {what}; nothing was changed: move it away, or give {script} "
                      f"another output folder")
  return mark


def own_folder(path: pathlib.Path, script: str, replace: bool = True) -> pathlib.Path:
  """`path` as a folder of `script`'s own (a mark file in it says so): one it marked earlier
  is emptied first (kept as it is with replace=False); a new or empty one is made and marked;
  one that holds anything else is refused, untouched (`check_own_folder`): no script deletes
  what it did not make."""
  mark = check_own_folder(path, script)
  if replace and mark.is_file():
    shutil.rmtree(path)
  path.mkdir(parents=True, exist_ok=True)
  mark.write_text(f"made by experiments/{script}.py, which may replace this folder\n")
  return path


def add_config_flags(parser, default: str = str(REPO / "configs" / "default.py")) -> None:
  """--config FILE[:variant] and --set KEY=VALUE (repeatable), as the jobs take them."""
  parser.add_argument("--config", default=default, metavar="FILE[:variant]",
                      help="config file (default: %(default)s)")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="config override, e.g. --set drafter.eagle.path=DIR (repeatable)")


def config_or_exit(spec: str, sets=()):
  """The config file's get_config(variant) with the overrides, or exit with one line that
  names the problem."""
  from tlt_jax.cli import config_from_file
  try:
    return config_from_file(spec, sets)
  except (ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")


def strategies_or_exit(texts, config) -> list:
  """The Strategy of each 'depth,topk,verify[,drafts]' in `texts` (none given: the config's
  arms), each once, or exit with one line naming a bad one."""
  from tlt_jax.speculative.strategy import Strategy
  try:
    return [Strategy.parse(s) for s in dict.fromkeys(texts or config.rollout.speculative.arms)]
  except ValueError as e:
    sys.exit(f"--strategies: {e}")


def strategy_label(strategy) -> str:
  """'depth,topk,verify[,drafts]' of a Strategy, as the command line and the configs write it."""
  return ",".join(map(str, strategy.as_tuple()))


def usable_cpus() -> int:
  """The CPUs this process may run on (its affinity mask; os.cpu_count() counts the machine's,
  and threads beyond the process's share of them wait on each other)."""
  return len(os.sched_getaffinity(0))


def pyplot():
  """matplotlib.pyplot on the Agg backend: figures go to files, no display is needed."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def save_figure(fig, path, dpi=None, step_axes=()) -> None:
  """Lays fig out, writes it to path in one step (a killed run keeps the previous file) and
  closes it; `step_axes` get integer ticks on x (RL steps, K)."""
  import matplotlib.pyplot as plt
  for ax in step_axes:
    ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
  path = pathlib.Path(path)
  tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
  fig.tight_layout()
  fig.savefig(tmp, dpi=dpi)
  plt.close(fig)
  tmp.replace(path)


def median_ms(fn, iters: int, warmup: int = 2) -> float:
  """Median wall milliseconds of fn() (which blocks on its result) after warm-up calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times) * 1e3)
