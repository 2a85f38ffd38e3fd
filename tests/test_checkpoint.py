"""Checkpoints: a round trip; a broken checkpoint falls back to the previous one, is moved
aside for inspection and written again when the run gets there."""

import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np

from tlt_jax.checkpoint import Checkpointer


def _state(x):
  return {"w": jnp.full((4, 3), x, jnp.float32), "n": jnp.asarray(int(x), jnp.int32)}


def test_round_trip_and_fallback_from_a_corrupt_latest(tmp_path, caplog):
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  for step in (1, 2, 3):
    ckpt.save(step, _state(step), {"step": step, "iterator": {"epoch": 0, "index": step}})
  ckpt.close()

  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  step, state, meta = ckpt.restore_latest(_state(0))
  assert step == 3 and meta["iterator"]["index"] == 3
  np.testing.assert_array_equal(np.asarray(state["w"]), np.full((4, 3), 3.0))

  # Break step 3 (its array data gone, as after a crash mid-write) and cut step 2 to nothing.
  for root, _, files in os.walk(tmp_path / "ckpt" / "3"):
    for f in files:
      if "state" in root:
        os.remove(os.path.join(root, f))
  shutil.rmtree(tmp_path / "ckpt" / "2" / "state")
  with caplog.at_level(logging.WARNING):
    step, state, meta = ckpt.restore_latest(_state(0))
  assert step == 1 and int(state["n"]) == 1
  warned = [r.getMessage() for r in caplog.records if "falling back" in r.getMessage()]
  assert len(warned) == 2 and "step 3" in warned[0] and "step 2" in warned[1]
  # The broken ones are kept for inspection, out of the way of retention and of new saves.
  assert [s for s, _ in ckpt.failures] == [3, 2]
  assert sorted(os.listdir(tmp_path / "failed_checkpoints")) == ["2", "3"]
  assert ckpt.manager.all_steps() == [1]
  # The run redoes steps 2 and 3 and writes them again: healed, and step 1 is retained too.
  for step in (2, 3):
    ckpt.save(step, _state(step + 10), {"step": step})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  step, state, _ = ckpt.restore_latest(_state(0))
  assert step == 3 and int(state["n"]) == 13 and ckpt.failures == []
  assert sorted(ckpt.manager.all_steps()) == [1, 2, 3]
  ckpt.close()


def test_retention_keeps_loadable_checkpoints(tmp_path):
  """keep=2 with a broken newest checkpoint: restoring moves it aside, so saving the next
  steps never deletes the newest good one first."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  for step in (3, 4):
    ckpt.save(step, _state(step), {"step": step})
  ckpt.close()
  shutil.rmtree(tmp_path / "ckpt" / "4" / "state")
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  assert ckpt.restore_latest(_state(0))[0] == 3
  ckpt.save(4, _state(4), {"step": 4})
  ckpt.save(5, _state(5), {"step": 5})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
  assert sorted(ckpt.manager.all_steps()) == [4, 5]
  assert ckpt.restore_latest(_state(0))[0] == 5 and ckpt.failures == []
  ckpt.close()


def test_no_checkpoint_means_a_fresh_start(tmp_path):
  ckpt = Checkpointer(str(tmp_path / "empty"))
  assert ckpt.restore_latest(_state(0)) is None and ckpt.latest_step is None
  ckpt.close()
