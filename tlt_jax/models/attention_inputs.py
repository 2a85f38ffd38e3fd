"""Attention inputs: the one place that builds positions and masks.

Every forward pass (policy or drafter, prefill, decode, tree verification, packed training)
runs T new tokens per row at explicit RoPE positions; they attend to the valid prefix of a KV
cache (the cache says how long it is) and to N >= T uncached keys under a [B, T, N] mask. The
builders below make the positions and the mask for each kind of call, so masks are written
once.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class AttentionInputs:
  """positions [B, T] int32 RoPE positions of the new tokens; mask [B, T, N] bool, query i
  may attend uncached key j; tree: the new tokens are a draft tree (a key's place is found by
  ancestry, not by position: the shape-invariant attention reads it)."""
  positions: jax.Array
  mask: jax.Array
  tree: bool = flax.struct.field(pytree_node=False, default=False)


def causal(t: int) -> jax.Array:
  """[T, T] bool lower-triangular mask."""
  return jnp.tril(jnp.ones((t, t), bool))


def prefill_inputs(start: jax.Array, t: int, lengths: jax.Array | None = None) -> AttentionInputs:
  """A causal block of T tokens at positions start[b] + j (prefill after a prefix of
  start[b] tokens, chunked prefill, the drafter's catch-up on an accepted path).
  lengths [B]: only the first lengths[b] keys of row b are real (right padding); None = all."""
  b = start.shape[0]
  mask = jnp.broadcast_to(causal(t), (b, t, t))
  if lengths is not None:
    mask = mask & (jnp.arange(t)[None, :] < lengths[:, None])[:, None, :]
  positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  return AttentionInputs(positions=positions, mask=mask)


def decode_inputs(position: jax.Array) -> AttentionInputs:
  """One token per row at position[b] (the slot after its prefix)."""
  return AttentionInputs(positions=position[:, None],
                         mask=jnp.ones((position.shape[0], 1, 1), bool))


def cached_decode_inputs(position: jax.Array) -> AttentionInputs:
  """One token per row at position[b] whose key/value is already written into the cache at
  slot position[b]: it attends to the cache alone, its own uncached copy masked out.

  No mask over the cache's S slots is built here: the attention reads the valid prefix from
  the cache's lengths (the kernel stops at them; the reference compares an iota over S with
  them inside its score fusion, which reads every slot anyway)."""
  return AttentionInputs(positions=position[:, None],
                         mask=jnp.zeros((position.shape[0], 1, 1), bool))


def tree_inputs(start: jax.Array, depths: jax.Array, ancestors: jax.Array) -> AttentionInputs:
  """A draft tree of T nodes whose root sits at position start[b]: node i at start + depth,
  attending to its ancestors and itself (ancestors [B, T, T], see `ancestor_mask`)."""
  return AttentionInputs(positions=start[:, None] + depths, mask=ancestors, tree=True)


def packed_inputs(segment_ids: jax.Array, positions: jax.Array) -> AttentionInputs:
  """Packed training rows without a cache: causal within a segment, never across segments
  (segment ids 1, 2, ... per sample, 0 = padding, which attends to nothing); positions
  restart per sample."""
  return AttentionInputs(positions=positions, mask=segment_causal_mask(segment_ids))


def unrolled_inputs(segment_ids: jax.Array, positions: jax.Array, step: int) -> AttentionInputs:
  """Inputs of unrolled draft step `step` over packed training rows (training-time test).

  Query t of step k stands for the draft node at slot t of a chain rooted at slot t - k: it
  attends the step-0 keys at slots <= t - k of its segment (what the drafter's cache holds at
  that root) and, for i = 1 .. k, the step-i key at slot t - k + i (its draft ancestors, then
  itself), exactly as `EagleDrafter.propose` does at inference. Keys are ordered step 0, 1,
  .., k: the earlier steps come in as `earlier_kv`. Step 0 is `packed_inputs`.

  segment_ids, positions: [B, W] as in `packed_inputs`.
  Returns positions [B, W] and mask [B, W, (step + 1) * W] bool.
  """
  w = segment_ids.shape[1]
  same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
  t = jnp.arange(w)[:, None]
  j = jnp.arange(w)[None, :]
  blocks = [same & (j <= t - step)[None]]
  blocks += [same & (j == t - step + i)[None] for i in range(1, step + 1)]
  return AttentionInputs(positions=positions, mask=jnp.concatenate(blocks, axis=-1))


def rows_inputs(b: int, t: int) -> AttentionInputs:
  """One right-padded sequence per row, no cache: causal, positions 0 .. T-1 (padding comes
  last, so no real token attends to it)."""
  return AttentionInputs(positions=jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                         mask=jnp.broadcast_to(causal(t), (b, t, t)))


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids (1, 2, ... per packed sample, 0 = padding) -> [B, T, T] bool mask:
  causal within a segment, never across segments; padding rows attend to nothing."""
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  return same & causal(segment_ids.shape[1])[None] & (segment_ids[:, :, None] > 0)


def ancestor_mask(parents: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """Ancestor-or-self mask of a topologically ordered tree.

  Args:
    parents: [B, T] int32; parents[b, i] < i is node i's parent, -1 for the root (node 0).
    valid: optional [B, T] bool; invalid (padding) nodes get an all-False row and are not
      anyone's ancestor.
  Returns:
    [B, T, T] bool, mask[b, i, j] = node j is node i or one of its ancestors.

  The transitive closure of the parent edges by repeated squaring, ceil(log2(T - 1)) small
  batched matmuls: no loop over the nodes, which inside a compiled decode loop would be a
  nested `while` (on a GPU, a host round trip per node per SD iteration). An edge counts only
  between valid nodes and toward a lower index, so a valid node under an invalid parent is its
  own only ancestor, as it was when the rows were built node by node. 0/1 entries and sums of
  at most T are exact in float32 (and in TF32).
  """
  b, t = parents.shape
  valid = jnp.ones(parents.shape, bool) if valid is None else valid
  j = jnp.arange(t)
  edge = ((parents[:, :, None] == j[None, None, :]) & (j[None, None, :] < j[None, :, None])
          & valid[:, :, None] & valid[:, None, :])
  reach = edge | (jnp.eye(t, dtype=bool)[None] & valid[:, :, None])
  for _ in range(max(t - 2, 0).bit_length()):  # paths of up to 2^k edges after k squarings
    r = reach.astype(jnp.float32)
    reach = reach | (jnp.einsum("bij,bjk->bik", r, r) > 0)
  return reach


def tree_depths(mask: jax.Array) -> jax.Array:
  """[B, T] int32 depth of each node (root 0; padding nodes -1) from an ancestor mask."""
  return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1


def expansion_inputs(position: jax.Array, earlier: jax.Array) -> AttentionInputs:
  """The drafter's tree expansion: K beams of row b side by side at position[b], each
  attending to its earlier draft nodes (earlier [B, K, N0] bool over the uncached keys that
  precede the beams) and to itself."""
  b, k, _ = earlier.shape
  eye = jnp.broadcast_to(jnp.eye(k, dtype=bool), (b, k, k))
  return AttentionInputs(positions=jnp.broadcast_to(position[:, None], (b, k)),
                         mask=jnp.concatenate([earlier, eye], axis=-1))
