"""Checkpoints of a run: array state through orbax (async), small host state as JSON.

One checkpoint holds `state` (any pytree of arrays: params, optimizer states, ...) and `meta`
(JSON: step, data position, tuner state, RNG seeds). `restore_latest` walks back from the
newest step. A checkpoint that fails to load (corrupt, or cut short by a crash) is moved out
of the way, to FAILED_DIR next to the checkpoints folder, kept for inspection and no longer
counted by retention, so the run writes that step again when it gets there and retention
only ever weighs checkpoints that load; the previous one is used.
"""

from __future__ import annotations

import logging
import os
import shutil

import jax
import orbax.checkpoint as ocp

FAILED_DIR = "failed_checkpoints"


class Checkpointer:
  """orbax CheckpointManager over `directory`, keeping the newest `keep` checkpoints.

  failures: (step, reason) of every checkpoint that failed to restore, moved to
  `failed_dir` (a sibling of `directory`).
  """

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self.failed_dir = os.path.join(os.path.dirname(self.directory), FAILED_DIR)
    self.failures: list[tuple[int, str]] = []
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an async save (arrays are copied off the devices before this returns)."""
    if step in self.manager.all_steps():
      return
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest loadable checkpoint, or None if there is none.

    abstract_state: the state's structure as arrays or ShapeDtypeStructs with shardings; the
    restored arrays take those shardings.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    for step in sorted(self.manager.all_steps(), reverse=True):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        return step, restored.state, restored.meta
      except Exception as e:  # noqa: BLE001 -- any failure to load means: use an older one
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        moved = self._move_aside(step)
        self.failures.append((step, reason))
        logging.warning("checkpoint at step %d in %s could not be restored (%s); moved to %s, "
                        "falling back to the previous one", step, self.directory, reason, moved)
    return None

  def _move_aside(self, step: int) -> str:
    """Moves a checkpoint that failed to load into failed_dir (a fresh name per move)."""
    os.makedirs(self.failed_dir, exist_ok=True)
    target = os.path.join(self.failed_dir, str(step))
    n = 1
    while os.path.exists(target):
      n += 1
      target = os.path.join(self.failed_dir, f"{step}-{n}")
    shutil.move(os.path.join(self.directory, str(step)), target)
    self.manager.reload()
    return target

  @property
  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
