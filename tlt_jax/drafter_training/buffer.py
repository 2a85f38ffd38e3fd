"""The hidden-state buffer: the policy's own features of recent rollouts, kept on device.

The rollout engine logs features as it decodes and hands over one FeatureBlock per slice and
RL step (tlt_jax.rollout.feature_log). The buffer keeps the blocks of the last `keep_steps`
RL steps and turns them into packed training windows on any sub-mesh: the host plans the
packing from lengths, and the features are gathered device to device, never through the host.

Thread-safe: the rollout's host loop adds blocks while spot-training threads read them.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.drafters.base import Windows
from tlt_jax.drafter_training.windows import plan_windows, window_arrays
from tlt_jax.mesh import ROLLOUT_RULES, logical_to_mesh_spec
from tlt_jax.rollout.feature_log import FeatureBlock


@functools.partial(jax.jit, donate_argnums=(0,))
def _add_block_features(acc, block, rows, offsets, take):
  """acc [R, W, F] + block[rows, offsets] where take [R, W] (block [M, C, F])."""
  picked = block[rows, offsets].astype(acc.dtype)
  return acc + jnp.where(take[..., None], picked, 0)


class FeatureBuffer:
  """FeatureBlocks by RL step; steps older than the last `keep_steps` are dropped."""

  def __init__(self, keep_steps: int = 2):
    if keep_steps < 1:
      raise ValueError(f"drafter.buffer.keep_steps must be >= 1, got {keep_steps}")
    self.keep_steps = keep_steps
    self._blocks: dict[int, list[FeatureBlock]] = {}
    self._lock = threading.Lock()
    self.version = 0  # bumped on every change, so readers can tell when to re-pack

  def add(self, step: int, block: FeatureBlock | None) -> None:
    """Adds a block of RL step `step` and drops steps older than the last keep_steps."""
    if block is None or not len(block):
      return
    with self._lock:
      self._blocks.setdefault(step, []).append(block)
      for old in sorted(self._blocks)[:-self.keep_steps]:
        del self._blocks[old]
      self.version += 1

  @property
  def steps(self) -> list[int]:
    with self._lock:
      return sorted(self._blocks)

  def blocks(self, step: int | None = None) -> list[FeatureBlock]:
    """The blocks of one step (default: all kept steps), oldest first."""
    with self._lock:
      keys = sorted(self._blocks) if step is None else [step]
      return [b for k in keys for b in self._blocks.get(k, [])]

  @property
  def num_sequences(self) -> int:
    return sum(len(b) for b in self.blocks())

  def windows_on(self, mesh: Mesh, window: int, rows: int, rng: np.random.Generator,
                 step: int | None = None, rules=ROLLOUT_RULES) -> tuple[Windows, int]:
    """`rows` packed windows of `window` slots on `mesh` (batch axis sharded by `rules`),
    from a random selection of the buffer's sequences (or only RL step `step`'s).

    Every sequence but its last token is a sample (the last token's feature was never
    computed; it is still a label, through the previous slot's target); training starts at
    the last prompt token. Returns (windows, number of real rows); rows past it are empty.
    """
    blocks = self.blocks(step)
    entries = [(b, i) for b, block in enumerate(blocks) for i in range(len(block))]
    if not entries:
      raise ValueError("the feature buffer is empty: no rollout has logged features yet")
    seqs = [blocks[b].sequences[i][:-1] for b, i in entries]
    train_from = [blocks[b].prompt_lens[i] - 1 for b, i in entries]
    plan = plan_windows([len(s) for s in seqs], window)
    plan = [plan[i] for i in rng.permutation(len(plan))]
    a = window_arrays(plan, seqs, train_from, window, rows)

    def place(x, names):
      spec = logical_to_mesh_spec(P(*names), x.shape, mesh, rules)
      return jax.device_put(x, NamedSharding(mesh, spec))

    width = blocks[0].features.shape[-1]
    features = place(np.zeros(a["tokens"].shape + (width,), np.float32),
                     ("batch", None, None))
    entry_block = np.asarray([b for b, _ in entries] + [-1], np.int32)[a["source"]]
    entry_row = np.asarray([i for _, i in entries] + [0], np.int32)[a["source"]]
    for b in sorted(set(entry_block[a["source"] >= 0].tolist())):
      take = entry_block == b
      block = place(blocks[b].features, ("batch", None, None))
      features = _add_block_features(
          features, block, place(np.where(take, entry_row, 0), ("batch", None)),
          place(np.where(take, a["offset"], 0), ("batch", None)), place(take, ("batch", None)))
    windows = Windows(tokens=place(a["tokens"], ("batch", None)), features=features,
                      segment_ids=place(a["segment_ids"], ("batch", None)),
                      positions=place(a["positions"], ("batch", None)),
                      loss_mask=place(a["loss_mask"], ("batch", None)))
    return windows, min(len(plan), rows)
