"""Checkpoints: a round trip; a broken checkpoint (unreadable, or arrays that fail their
checksums) falls back to the previous one, is moved aside for inspection and written again
when the run gets there; one written under other settings stops the restore instead."""

import errno
import json
import logging
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.checkpoint import CheckpointMismatch, Checkpointer, checksums
from tlt_jax.config import RunStopped


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


def test_a_checksum_mismatch_is_a_corrupt_checkpoint(tmp_path, caplog):
  """Arrays that load but differ from what was saved (the saved checksum no longer matches)
  are treated like any other corrupt checkpoint: moved aside, the previous one used."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(step), {"step": step})
  ckpt.close()
  path = tmp_path / "ckpt" / "2" / "meta" / "metadata"  # the JSON meta, as orbax writes it
  meta = json.loads(path.read_text())
  meta["checksums"][0] ^= 1  # as if one bit of the first array had flipped
  path.write_text(json.dumps(meta))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  with caplog.at_level(logging.WARNING):
    step, state, _ = ckpt.restore_latest(_state(0))
  assert step == 1 and int(state["n"]) == 1
  assert ckpt.failures[0][0] == 2 and "checksum mismatch in ['n']" in ckpt.failures[0][1]
  assert os.listdir(tmp_path / "failed_checkpoints") == ["2"]
  ckpt.close()


def test_checksums_see_a_flipped_bit_and_swapped_elements():
  x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
  base = checksums({"x": x, "b": jnp.ones((2,), jnp.bfloat16), "m": jnp.zeros((3,), bool)})
  flipped = x.at[1, 2].set(jnp.nextafter(x[1, 2], 100.0))
  swapped = x.at[0, 0].set(x[0, 1]).at[0, 1].set(x[0, 0])
  # Signs flipped at an odd flat index, and at two (version 1's weights were even at odd
  # indices, so 2**31 * weight vanished from the uint32 sum, and two odd ones cancelled).
  negated = x.at[0, 1].set(-x[0, 1])
  negated_twice = negated.at[1, 2].set(-x[1, 2])
  for other in (flipped, swapped, negated, negated_twice):
    assert checksums({"x": other, "b": jnp.ones((2,), jnp.bfloat16),
                      "m": jnp.zeros((3,), bool)})[2] != base[2]


def test_checkpoints_of_checksum_version_1_are_checked_as_written(tmp_path):
  """A checkpoint saved before checksum_version existed carries version 1's checksums: it
  restores, and a changed one is still caught."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  for step in (1, 2):
    ckpt.save(step, _state(step), {"step": step})
  ckpt.close()
  for step in (1, 2):
    path = tmp_path / "ckpt" / str(step) / "meta" / "metadata"
    meta = json.loads(path.read_text())
    assert meta.pop("checksum_version") == 2
    meta["checksums"] = checksums(_state(step), version=1)
    if step == 2:
      meta["checksums"][0] ^= 1
    path.write_text(json.dumps(meta))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3)
  step, state, _ = ckpt.restore_latest(_state(0))
  assert step == 1 and int(state["n"]) == 1 and ckpt.failures[0][0] == 2
  ckpt.close()


def test_a_checkpoint_of_other_settings_stops_the_restore_and_is_kept(tmp_path):
  """The refusal names the settings that differ, less those a rerun may change alone
  (rl.steps: raised to extend a run)."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings={"drafter.spot_training": True,
                                                        "rl.steps": 4})
  ckpt.save(4, _state(4), {"step": 4})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings={"drafter.spot_training": False,
                                                        "rl.steps": 6})
  with pytest.raises(CheckpointMismatch, match=r"step 4 .* other settings \("
                     r"drafter.spot_training: True -> False\); nothing.*--start_over"):
    ckpt.restore_latest({"w": _state(0)["w"]})  # the state's structure changed
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings={"drafter.spot_training": True,
                                                        "rl.steps": 6})
  with pytest.raises(CheckpointMismatch, match=r"fit this run: its 2 arrays are not this run's 1"):
    ckpt.restore_latest({"w": _state(0)["w"]})  # rl.steps alone explains nothing
  assert ckpt.manager.all_steps() == [4] and not os.path.exists(tmp_path / "failed_checkpoints")
  # Settings that leave the state as it was (rl.steps) just resume.
  assert ckpt.restore_latest(_state(0))[0] == 4
  ckpt.close()


def test_a_corrupt_checkpoint_under_harmlessly_changed_settings_falls_back(tmp_path):
  """Other settings explain a failed restore only when the checkpoint's arrays no longer fit
  the state: with rl.steps changed and the newest checkpoint broken, the previous one loads."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3, settings={"rl.steps": 4})
  for step in (1, 2):
    ckpt.save(step, _state(step), {"step": step})
  ckpt.close()
  for root, _, files in os.walk(tmp_path / "ckpt" / "2"):
    for f in files:
      if "state" in root and not f.startswith("_"):  # the array data, not its metadata
        os.remove(os.path.join(root, f))
  ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=3, settings={"rl.steps": 6})
  step, state, _ = ckpt.restore_latest(_state(0))
  assert step == 1 and int(state["n"]) == 1 and [s for s, _ in ckpt.failures] == [2]
  ckpt.close()


def test_a_restore_out_of_memory_stops_and_moves_nothing(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, _state(1), {"step": 1})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"))

  def restore(*args, **kwargs):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 4.0GiB")
  monkeypatch.setattr(ckpt.manager, "restore", restore)
  with pytest.raises(RunStopped, match=r"step 1 .* ran out of memory .*nothing was moved"):
    ckpt.restore_latest(_state(0))
  assert ckpt.manager.all_steps() == [1] and not os.path.exists(tmp_path / "failed_checkpoints")


def test_a_full_disk_stops_in_one_line_naming_the_intact_checkpoint(tmp_path, monkeypatch):
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(1, _state(1), {"step": 1})
  ckpt.manager.wait_until_finished()

  def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "2"))
  monkeypatch.setattr(ckpt.manager, "save", no_space)
  with pytest.raises(RunStopped, match=r"^the checkpoint of step 2 could not be written to .*: "
                     r"no space left on device; a checkpoint needs about 0.0 MB; the "
                     r"checkpoint of step 1 is intact; free "):
    ckpt.save(2, _state(2), {"step": 2})
  monkeypatch.undo()
  ckpt.close()
  assert Checkpointer(str(tmp_path / "ckpt")).restore_latest(_state(0))[0] == 1


def test_a_full_disk_in_orbax_s_writer_threads_is_one_line_too(tmp_path, monkeypatch):
  """orbax reports a full disk from its writer threads as a ValueError (tensorstore's
  RESOURCE_EXHAUSTED), logged with its traceback by each thread: 2,303 lines and 265
  tracebacks in a train run. It is one line (naming the unfinished step, the space a checkpoint
  needs, the intact one), and orbax's logs of it are dropped."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  big = {"w": jnp.zeros((512, 1024), jnp.float32)}  # 2 MB
  ckpt.save(1, big, {"step": 1})
  ckpt.manager.wait_until_finished()
  os.makedirs(tmp_path / "ckpt" / "2.orbax-checkpoint-tmp-1")  # what orbax leaves unfinished
  error = ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local '
                     'file "ckpt/2.orbax-checkpoint-tmp": Failed to write 706744 bytes to file '
                     '4: No space left on device [os_error_code=\'28\']')
  from orbax.checkpoint._src.futures import future

  def orbax_log(e):  # what orbax's _SignalingThread.run() logs, with e's traceback
    return logging.LogRecord("absl", logging.ERROR, future.__file__, 389, "_SignalingThread"
                             ".run() raised an exception: %s", (e,), (type(e), e, None))
  assert not logging.getLogger("absl").filter(orbax_log(error))
  assert logging.getLogger("absl").filter(orbax_log(ValueError("something else")))
  # tensorstore's write callbacks then find orbax's loop closed, each printing a traceback
  # (through sys.unraisablehook, which the Checkpointer wraps) unless dropped.
  import asyncio
  import sys
  import types

  from tlt_jax.checkpoint import _quiet_closed_loops

  assert getattr(sys.unraisablehook, "_tlt_quiet", False)
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(print)
  except RuntimeError as e:
    closed = e
  printed = []
  hook = _quiet_closed_loops(printed.append)
  for e in (closed, RuntimeError("another")):
    hook(types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, exc_traceback=e.__traceback__,
                               err_msg=None, object=None))
  assert [str(u.exc_value) for u in printed] == ["another"]

  def fail(*args, **kwargs):
    raise error
  monkeypatch.setattr(ckpt.manager, "wait_until_finished", fail)
  with pytest.raises(RunStopped, match=r"^the checkpoint of step 2 could not be written to "
                     r".*ckpt: no space left on device; a checkpoint needs about 2.0 MB; the "
                     r"checkpoint of step 1 is intact; free the space"):
    ckpt.close()
  with pytest.raises(ValueError, match="something else"):  # other errors are not hidden
    with ckpt._writing(3):
      raise ValueError("something else")


def test_another_state_under_the_same_settings_is_a_mismatch_not_a_corrupt_checkpoint(tmp_path):
  """A job restoring a checkpoint of another state (the warm-up's drafter state over a train
  run's checkpoints, same config) stops without moving it: only an unreadable checkpoint or
  one that fails its checksums is set aside."""
  settings = {"rl.steps": 2}
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings=settings)
  ckpt.save(2, _state(2), {"step": 2})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings=settings)
  with pytest.raises(CheckpointMismatch, match=r"step 2 .* does not fit this run: its 2 arrays "
                     r"are not this run's 3, e\.g\. 'n' .*nothing was moved"):
    ckpt.restore_latest({"a": jnp.zeros((5,)), "b": jnp.zeros((2, 2)), "c": jnp.zeros(())})
  assert ckpt.manager.all_steps() == [2] and not os.path.exists(tmp_path / "failed_checkpoints")
  assert ckpt.restore_latest(_state(0))[0] == 2
  ckpt.close()


def test_the_same_arrays_under_other_names_are_a_mismatch_not_a_corrupt_checkpoint(tmp_path):
  """An earlier version's layout of the same state (the drafter's weights nested under its
  name since drafters became plug-ins): same shapes, other names. The run stops naming an
  array it does not have, and the checkpoint stays where it is."""
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings={"rl.steps": 2})
  ckpt.save(2, {"drafter": _state(2)}, {"step": 2})
  ckpt.close()
  ckpt = Checkpointer(str(tmp_path / "ckpt"), settings={"rl.steps": 2})
  with pytest.raises(CheckpointMismatch, match=r"does not fit this run: its 2 arrays are not "
                     r"this run's 2, e\.g\. 'drafter/.*earlier version's layout"):
    ckpt.restore_latest({"drafter": {"eagle": _state(0)}})
  assert ckpt.manager.all_steps() == [2] and not os.path.exists(tmp_path / "failed_checkpoints")
  ckpt.close()
