"""A job's metrics in the tools researchers watch runs with: TensorBoard event files
(tensorboardX) in WORKDIR/tensorboard, and Weights & Biases, each switched on by a knob
(logging.tensorboard, logging.wandb). They mirror the rows that `tlt_jax.run_log.RunLog`
writes to metrics.jsonl and eval.jsonl, which stay the source of truth: every number a mirror
holds is in those files under the same key (tag 'metrics/reward_mean' is metrics.jsonl's
reward_mean), except the histograms (the rollout's response lengths), which no file holds.

A writer has `scalars(step, {tag: float})`, `histogram(tag, step, values)`, `flush()` and
`close()`; only the writing process (process 0) makes them.
"""

from __future__ import annotations

import glob
import importlib.util
import math
import os
from collections.abc import Mapping

import ml_collections
import numpy as np

# knob -> (the module it needs, how to install it)
PACKAGES = {"tensorboard": ("tensorboardX", 'pip install tensorboardX (or pip install -e '
                                            '".[tensorboard]")'),
            "wandb": ("wandb", 'pip install wandb (or pip install -e ".[wandb]")')}
TENSORBOARD_DIR = "tensorboard"


def missing_package(knob: str) -> str | None:
  """The one-line error for logging.<knob>=True when its package is not installed (None if
  it is)."""
  module, pip = PACKAGES[knob]
  if importlib.util.find_spec(module) is not None:
    return None
  return f"logging.{knob}=True needs the {module} package, which is not installed: {pip}"


def scalar_values(prefix: str, row: Mapping) -> dict[str, float]:
  """{prefix/key: float} of a JSONL row's numbers and booleans (not its step; None, text,
  lists and dicts are left out)."""
  return {f"{prefix}/{k}": float(v) for k, v in row.items()
          if k != "step" and isinstance(v, (int, float, bool, np.number, np.bool_))}


class TensorBoardWriter:
  """Event files in `logdir`. purge_step: TensorBoard hides the events an earlier run of the
  same folder wrote from this step on (a resumed run writes them again)."""

  def __init__(self, logdir: str, purge_step: int | None = None):
    from tensorboardX import SummaryWriter
    # Event files are named by the second they were opened in, then read in name order: a
    # count makes a rerun's name new (it would overwrite the earlier file within a second)
    # and later in that order.
    earlier = len(glob.glob(os.path.join(logdir, "*tfevents*")))
    self._writer = SummaryWriter(logdir, purge_step=purge_step,
                                 filename_suffix=f".{earlier:04d}")

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for tag, value in values.items():
      self._writer.add_scalar(tag, value, step)

  def histogram(self, tag: str, step: int, values) -> None:
    self._writer.add_histogram(tag, np.asarray(values, np.float64), step)

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


class WandbWriter:
  """A W&B run named after the workdir, its files in WORKDIR/wandb, with the job's settings
  as its config (W&B's own environment applies, e.g. WANDB_MODE=offline)."""

  def __init__(self, project: str, workdir: str, settings: Mapping):
    import wandb
    self._wandb = wandb
    self._run = wandb.init(project=project, name=os.path.basename(os.path.abspath(workdir)),
                           dir=workdir, config=dict(settings))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    self._run.log({k: v for k, v in values.items() if math.isfinite(v)}, step=step)

  def histogram(self, tag: str, step: int, values) -> None:
    self._run.log({tag: self._wandb.Histogram(np.asarray(values))}, step=step)

  def flush(self) -> None:
    pass  # W&B streams on its own

  def close(self) -> None:
    self._run.finish()


def writable_folder(path: str, knob: str) -> str:
  """`path`, made if need be, for the writer that logging.<knob> asks for; ValueError (one
  line, naming the folder, the knob and the fix) when it is a file or cannot be written."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    why = (e.strerror or str(e)).lower()
  else:
    if os.access(path, os.W_OK):
      return path
    why = "not writable"
  raise ValueError(f"logging.{knob}=True writes to {path}, which cannot be a writable folder "
                   f"({why}); move what is there away, or set logging.{knob}=False")


def writers_from_config(knobs: ml_collections.ConfigDict, workdir: str, resume_step: int,
                        settings: Mapping) -> list:
  """The writers that knobs (a config's `logging` section) ask for, over `workdir`, for a
  job that resumes at resume_step (0: from the start); settings: the job's flat settings
  (`tlt_jax.config.flat_settings`), W&B's run config. ValueError (one line) when a writer's
  folder cannot be written."""
  writers = []
  if knobs.tensorboard:
    writers.append(TensorBoardWriter(writable_folder(os.path.join(workdir, TENSORBOARD_DIR),
                                                     "tensorboard"),
                                     purge_step=resume_step + 1))
  if knobs.wandb:
    writers.append(WandbWriter(knobs.wandb_project, workdir, settings))
  return writers
