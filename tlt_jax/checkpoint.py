"""Checkpoints of a run: array state through orbax (async), small host state as JSON.

One checkpoint holds `state` (any pytree of arrays: params, optimizer states, ...) and `meta`
(JSON: step, data position, tuner state, RNG seeds). `restore_latest` walks back from the
newest step. A checkpoint that fails to load (corrupt, or cut short by a crash) is moved out
of the way, to FAILED_DIR next to the checkpoints folder, kept for inspection and no longer
counted by retention, so the run writes that step again when it gets there and retention
only ever weighs checkpoints that load; the previous one is used.

Every checkpoint also carries a checksum of each array (computed on the devices, so saving
stays asynchronous) and the settings of the run that wrote it. A restore whose arrays do not
match their checksums is a corrupt checkpoint like any other. A checkpoint whose arrays (by
its own metadata) are not those of the current state is not corrupt: it was written by other
settings or another job, and the restore stops with `CheckpointMismatch`, naming the settings
that differ, and moves nothing. Only a checkpoint that cannot be read, or fails its checksums,
is moved aside. Nor is one whose restore ran out of memory: the run stops (RunStopped). On
several processes they agree on every verdict, and process 0 moves the files.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from tlt_jax.config import RERUN_SETTINGS, ConfigError, RunStopped

FAILED_DIR = "failed_checkpoints"
_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


class CheckpointMismatch(ConfigError):
  """The newest checkpoint was written under other settings and does not fit this run."""


# Version 2: each element's bits, folded (bits ^ bits >> 16, so the top bits also move the low
# ones), weighted by index * even + 1 (odd); so flipped sign bits change the uint32 sum
# unless their indices happen to pair up mod 2**16. Version 1 (checkpoints without a
# checksum_version) summed the raw bits with weights that were even at odd indices, blind to
# a sign flip there and to any two anywhere; its checkpoints are still checked its way.
CHECKSUM_VERSION = 2
_MULTIPLIERS = {1: 2654435761, 2: 2 * 2654435761 % 2 ** 32}


def _leaf_checksum(x: jax.Array, version: int) -> jax.Array:
  """uint32 sum of x's bits (folded from version 2 on), each element weighted by its flat
  index times a multiplier, plus 1 (so flipped bits or swapped elements change it)."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    bits = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize]).astype(jnp.uint32)
  if version >= 2:
    bits = bits ^ (bits >> 16)
  index, stride = jnp.zeros(x.shape, jnp.uint32), 1
  for d in reversed(range(x.ndim)):  # the flat index without reshaping a sharded array
    index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride)
    stride = stride * x.shape[d] % 2 ** 32
  weight = index * jnp.uint32(_MULTIPLIERS[version]) + jnp.uint32(1)
  return jnp.sum(bits * weight, dtype=jnp.uint32)


@functools.partial(jax.jit, static_argnums=1)
def _checksums(leaves: list, version: int) -> list:
  return [_leaf_checksum(x, version) for x in leaves]


def checksums(tree, version: int = CHECKSUM_VERSION) -> list[int]:
  """One uint32 checksum per array leaf of `tree` (in jax.tree.leaves order), computed as
  checkpoints of checksum `version` were."""
  return [int(c) for c in jax.device_get(_checksums(jax.tree.leaves(tree), version))]


def settings_diff(old: dict, new: dict, most: int = 6) -> str:
  """'key: old -> new; ...' over the keys whose values differ, those a rerun may change alone
  (RERUN_SETTINGS) left out ('' when none)."""
  keys = sorted(k for k in old.keys() | new.keys()
                if old.get(k) != new.get(k) and k not in RERUN_SETTINGS)
  parts = [f"{k}: {old.get(k, '(unset)')} -> {new.get(k, '(unset)')}" for k in keys[:most]]
  if len(keys) > most:
    parts.append(f"and {len(keys) - most} more")
  return "; ".join(parts)


# What the OS says of a write that failed, as orbax passes it on (tensorstore's ValueError
# "RESOURCE_EXHAUSTED: Error writing ...: No space left on device [os_error_code='28']").
_WRITE_FAILURE = re.compile(r"No space left on device|Disk quota exceeded|Read-only file system|"
                            r"Input/output error|Permission denied")


def write_failure(e: BaseException) -> str | None:
  """The OS's reason when `e` is a failed write (an OSError, or orbax's error naming one),
  else None."""
  if isinstance(e, OSError):
    return (e.strerror or str(e)).lower()
  found = _WRITE_FAILURE.search(str(e))
  return found.group(0).lower() if found else None


class _WriteFailureFilter(logging.Filter):
  """Drops orbax's logs of a failed background write (each with its traceback, from each of
  its writer threads): the Checkpointer reports the failure once, in one line (RunStopped)."""

  def filter(self, record: logging.LogRecord) -> bool:
    exc = record.exc_info[1] if record.exc_info else None
    return not ("orbax" in record.pathname and exc is not None
                and write_failure(exc) is not None)


_QUIET_FAILED_WRITES = _WriteFailureFilter()


def _quiet_closed_loops(previous):
  """sys.unraisablehook, less the "Event loop is closed" errors of tensorstore's write
  callbacks (from its own threads) once orbax's writer thread has ended its asyncio loop on a
  failed write: dozens of tracebacks after a full disk that the Checkpointer reports itself."""
  def hook(unraisable):
    last = unraisable.exc_traceback
    while last is not None and last.tb_next is not None:
      last = last.tb_next
    if (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is "
        "closed" and last is not None and last.tb_frame.f_code.co_filename.endswith(
            os.path.join("asyncio", "base_events.py"))):
      return
    previous(unraisable)
  hook._tlt_quiet = True
  return hook


def _out_of_memory(e: BaseException) -> bool:
  """Whether a failed restore ran out of host or device memory: not the checkpoint's fault."""
  return isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e) \
      or "out of memory" in str(e).lower()


def _key_name(key) -> str:
  """A path entry as a name, whatever container holds it: a dict key, an attribute or an
  index (a checkpoint's metadata keeps dicts where the state has named tuples)."""
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def _array_shapes(tree) -> list[tuple]:
  """Sorted (path, shape, dtype name) of every array leaf: the state's arrays by name, shape
  and dtype, whatever containers hold them. Arrays of the same shapes under other names
  (a state whose layout changed between versions) are another state, not a corrupt one."""
  leaves = jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))
  return sorted(("/".join(_key_name(k) for k in path), tuple(x.shape), jnp.dtype(x.dtype).name)
                for path, x in leaves if hasattr(x, "shape") and hasattr(x, "dtype"))


# A restore's verdict on one process, worst last.
_LOADED, _BROKEN, _OUT_OF_MEMORY = 0, 1, 2


def _worst_on_any_process(verdict: int) -> int:
  """The worst verdict of every process (this one's alone on one process): all of them then
  use, move aside or stop at the same checkpoint."""
  if jax.process_count() == 1:
    return verdict
  return int(np.max(multihost_utils.process_allgather(np.int32(verdict))))


class Checkpointer:
  """orbax CheckpointManager over `directory`, keeping the newest `keep` checkpoints.

  settings: the run's settings as flat {key: JSON value} (`tlt_jax.config.flat_settings`),
    kept with every checkpoint to tell a changed config from a corrupt checkpoint.
  failures: (step, reason) of every checkpoint that failed to restore, moved to
    `failed_dir` (a sibling of `directory`).
  """

  def __init__(self, directory: str, keep: int = 2, settings: dict | None = None):
    self.directory = os.path.abspath(directory)
    self.settings = settings or {}
    self.failed_dir = os.path.join(os.path.dirname(self.directory), FAILED_DIR)
    self.failures: list[tuple[int, str]] = []
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))
    self._state_bytes = 0  # of the last save: what a failed write says it needs
    logging.getLogger("absl").addFilter(_QUIET_FAILED_WRITES)  # once: a set of filters
    if not getattr(sys.unraisablehook, "_tlt_quiet", False):
      sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)

  def save(self, step: int, state, meta: dict) -> None:
    """Starts an async save (arrays are copied off the devices before this returns)."""
    if step in self.manager.all_steps():
      return
    meta = {**meta, "checksums": checksums(state), "checksum_version": CHECKSUM_VERSION,
            "settings": self.settings}
    self._state_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(state))
    with self._writing(step):
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))

  @contextlib.contextmanager
  def _writing(self, step: int):
    """A failed write of checkpoint `step` (a full disk, a lost mount; an OSError, or orbax's
    error from its writer threads, raised here or by the previous async save) -> RunStopped
    in one line naming the folder, the cause, the space a checkpoint needs and the intact
    checkpoint."""
    try:
      yield
    except Exception as e:  # noqa: BLE001 -- only write failures are turned into one line
      why = write_failure(e)
      if why is None:
        raise
      # On disk: the committed checkpoints, and the one orbax left unfinished (it failed in
      # the background when a later save or the close reports it).
      names = os.listdir(self.directory) if os.path.isdir(self.directory) else []
      intact = [int(n) for n in names if n.isdigit() and int(n) <= step]
      unfinished = [int(n.split(".")[0]) for n in names if "tmp" in n and n.split(".")[0].isdigit()]
      failed = min(unfinished, default=step)
      kept = (f"the checkpoint of step {max(intact)} is intact" if intact else
              "no earlier checkpoint exists")
      raise RunStopped(f"the checkpoint of step {failed} could not be written to "
                       f"{self.directory}: {why}; a checkpoint needs about "
                       f"{self._state_bytes / 2 ** 20:.1f} MB; {kept}; free the space (or fix "
                       f"the folder) and rerun the same command to resume") from None

  def restore_latest(self, abstract_state) -> tuple[int, object, dict] | None:
    """(step, state, meta) of the newest loadable checkpoint, or None if there is none.

    abstract_state: the state's structure as arrays or ShapeDtypeStructs with shardings; the
    restored arrays take those shardings. Raises CheckpointMismatch when the newest
    checkpoint that fails to load holds, by its metadata, other arrays than `abstract_state`
    (other settings, or another job's state; other settings alone, such as rl.steps, do not
    explain a failure: a checkpoint whose arrays fit but do not load is corrupt). A restore
    that runs out of memory stops the run (RunStopped) and moves nothing. On several
    processes, a checkpoint is used only when it loaded on all of them, and process 0 alone
    moves a failed one.
    """
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        abstract_state)
    for step in sorted(self.manager.all_steps(), reverse=True):
      restored, error = None, None
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 -- any failure to load means: use an older one
        error = e
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      else:
        reason = self._checksum_mismatch(restored.state, restored.meta)
      verdict = _worst_on_any_process(
          _OUT_OF_MEMORY if error is not None and _out_of_memory(error)
          else _LOADED if reason is None else _BROKEN)
      if verdict == _OUT_OF_MEMORY:
        raise RunStopped(f"restoring the checkpoint of step {step} in {self.directory} ran out "
                         f"of memory ({reason or 'on another process'}); nothing was moved: "
                         f"free memory and rerun the same command") from error
      if verdict == _LOADED:
        return step, restored.state, restored.meta
      reason = reason or "it failed to load on another process"
      self._refuse_if_it_does_not_fit(step, abstract)
      moved = self._move_aside(step)  # corrupt: kept aside, the previous one is tried
      self.failures.append((step, reason))
      logging.warning("checkpoint at step %d in %s could not be restored (%s); moved to %s, "
                      "falling back to the previous one", step, self.directory, reason, moved)
    return None

  def _checksum_mismatch(self, state, meta: dict) -> str | None:
    """Why the restored arrays differ from what was saved (None: they do not, or the
    checkpoint predates checksums)."""
    saved = meta.get("checksums")
    if saved is None:
      return None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    version = meta.get("checksum_version", 1)
    if version not in _MULTIPLIERS:  # a newer package's checksums: not checkable here
      return None
    bad = [p for p, a, b in zip(paths, checksums(state, version), saved) if a != b]
    if len(saved) != len(paths) or bad:
      return f"checksum mismatch in {', '.join(bad[:3]) or 'the array count'}"
    return None

  def _refuse_if_it_does_not_fit(self, step: int, abstract) -> None:
    """Raises CheckpointMismatch when checkpoint `step` (which did not load) holds, by its own
    metadata, arrays other than those of `abstract` (naming the settings that differ, if its
    settings are known); returns when its metadata cannot be read or its arrays fit (then it
    is corrupt)."""
    try:
      saved = self.manager.item_metadata(step)["state"]
      saved = getattr(saved, "tree", saved)
    except Exception:  # noqa: BLE001 -- no readable metadata: judge it as corrupt
      return
    ours, theirs = _array_shapes(abstract), _array_shapes(saved)
    if not theirs or theirs == ours:
      return
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      written = meta.meta.get("settings")
    except Exception:  # noqa: BLE001 -- its arrays say enough
      written = None
    diff = settings_diff(written, self.settings) if written and self.settings else ""
    only_theirs = sorted({a[0] for a in theirs} - {a[0] for a in ours})
    named = f", e.g. {only_theirs[0]!r}" if only_theirs else ""
    why = (f"it was written with other settings ({diff})" if diff else
           f"its {len(theirs)} arrays are not this run's {len(ours)}{named} (another job's "
           f"checkpoint, an earlier version's layout, or settings it did not record)")
    raise CheckpointMismatch(
        f"the checkpoint of step {step} in {self.directory} does not fit this run: {why}; "
        f"nothing was moved; rerun with the settings it was written with, or start from "
        f"step 0 (tlt_jax.train's --start_over sets the earlier run aside; other jobs: "
        f"another --workdir)")

  def _move_aside(self, step: int) -> str:
    """Moves a checkpoint that failed to load into failed_dir (a fresh name per move); on
    several processes process 0 moves it and the others wait for that."""
    target = os.path.join(self.failed_dir, str(step))
    n = 1
    while os.path.exists(target):
      n += 1
      target = os.path.join(self.failed_dir, f"{step}-{n}")
    if jax.process_index() == 0:
      os.makedirs(self.failed_dir, exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"tlt_jax checkpoint {step} moved aside")
    self.manager.reload()
    return target

  @property
  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def close(self) -> None:
    with self._writing(self.manager.latest_step() or 0):
      self.manager.wait_until_finished()
    self.manager.close()
