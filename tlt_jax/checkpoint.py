"""Checkpoints of a run: array state through orbax (async), small host state as JSON.

One checkpoint holds `state` (any pytree of arrays: params, optimizer states, ...) and `meta`
(JSON: step, data position, tuner state, RNG seeds). `restore_latest` walks back from the
newest step: a checkpoint that fails to load (corrupt, or cut short by a crash) is skipped
with a warning, and the previous one is used.
"""

from __future__ import annotations

import logging
import os

import jax
import orbax.checkpoint as ocp


class Checkpointer:
  """orbax CheckpointManager over `directory`, keeping the newest `keep` checkpoints."""

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
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
        logging.warning("checkpoint at step %d in %s could not be restored (%s: %s); "
                        "falling back to the previous one", step, self.directory,
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return None

  @property
  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
