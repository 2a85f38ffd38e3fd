"""Prefix + tree attention whose result for a query depends only on its key/value at each
absolute position: the same bits whether the prefix sits in a KV cache, in a draft tree's
ancestors or in a training row, and whatever the cache's capacity or the batch.

The keys are walked in blocks of `BLOCK` absolute positions from position 0, twice: once for
the softmax's maximum (exact in any order), once adding each block's sums in order (a block
wholly past the query adds zeros, exactly); within a block every sum (q . k over the head
dimension, the softmax's denominator, the weighted values) is a `tree_sum` over the block's
positions. What
varies between programs is only where a position's key is read from:
  - the cache, for positions below cache_lengths[b] (a decode step's own key is written there
    before it attends);
  - the uncached block: in a causal block (prefill, training rows, packed rows) query t's key
    at position a is at index t - positions[t] + a; in a draft tree (`tree=True`) it is the
    ancestor of query t at that position, found from the mask.
Same contract as `reference.prefix_tree_attention_reference`, plus the new keys' positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.kernels.numerics import fixed_path, tree_sum

BLOCK = 64  # absolute positions per block; part of the numerics (fixed, never derived)
_MASK = -1e30


def invariant_prefix_tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                    cache_lengths: jax.Array, k_new: jax.Array,
                                    v_new: jax.Array, new_mask: jax.Array,
                                    new_positions: jax.Array, tree: bool,
                                    scale: float | None = None) -> jax.Array:
  """Attention of T new queries over a cached prefix and N = T uncached keys.

  Args:
    q: [B, T, H, D]; k_cache, v_cache: [B, KVH, S, D], slot s at position s, valid below
      cache_lengths [B] int32; k_new, v_new: [B, T, KVH, D] the new tokens' keys/values;
    new_mask: [B, T, T] bool (query i may attend new key j); new_positions: [B, T] int32
      absolute positions of the new tokens (queries and keys alike).
    tree: the new block is a draft tree (keys found by ancestry) rather than causal runs.
  Returns:
    [B, T, H, D] in q.dtype; a query with nothing to attend to gets zeros.
  """
  b, t, h, d = q.shape
  kvh, s = k_cache.shape[1], k_cache.shape[2]
  if k_new.shape[1] != t:
    raise ValueError(f"invariant attention takes the new tokens' own keys (N = T = {t}), got "
                     f"N = {k_new.shape[1]}")
  g = h // kvh
  scale = d ** -0.5 if scale is None else scale
  qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32)
  num_blocks = -(-(s + t) // BLOCK)  # positions < cache length + T <= S + T
  rows = jnp.arange(b)[:, None, None]
  queries = jnp.arange(t)[None, :, None]

  def new_index(a):
    """[B, T, BLOCK] index of the new key at absolute positions a [BLOCK] seen by each query,
    and whether there is one."""
    if tree:
      sel = new_mask[:, :, None, :] & (new_positions[:, None, None, :] == a[None, None, :, None])
      return jnp.argmax(sel, axis=-1), jnp.any(sel, axis=-1)
    j = queries - new_positions[:, :, None] + a[None, None, :]
    jc = jnp.clip(j, 0, t - 1)
    ok = ((j >= 0) & (j < t) & new_mask[rows, queries, jc]
          & (jnp.take_along_axis(new_positions, jc.reshape(b, -1), 1).reshape(jc.shape)
             == a[None, None, :]))
    return jc, ok

  def keys(i):
    """Block i's keys and values [B, T, BLOCK, KVH, D] as each query sees them, and whether
    each position holds one [B, T, BLOCK]."""
    a = i * BLOCK + jnp.arange(BLOCK)
    j, valid = new_index(a)
    k_blk = jnp.take_along_axis(k_new[:, None], j[..., None, None], axis=2)
    v_blk = jnp.take_along_axis(v_new[:, None], j[..., None, None], axis=2)
    if s:
      slot = jnp.clip(a, 0, s - 1)
      in_cache = (a[None, :] < jnp.minimum(cache_lengths, s)[:, None])[:, None, :]  # [B,1,BL]
      kc = jnp.swapaxes(k_cache[:, :, slot], 1, 2)[:, None]  # [B, 1, BL, KVH, D]
      vc = jnp.swapaxes(v_cache[:, :, slot], 1, 2)[:, None]
      k_blk = jnp.where(in_cache[..., None, None], kc, k_blk)
      v_blk = jnp.where(in_cache[..., None, None], vc, v_blk)
      valid = in_cache | valid
    return k_blk, v_blk, valid[:, :, None, None, :]

  def scores(k_blk, valid):
    """[B, T, KVH, G, BLOCK] float32, masked positions at _MASK: each a tree over the head
    dimension of products of two bfloat16 (or float16) numbers, exact in float32, so that
    no rounding is left for XLA to contract into an FMA; then scaled, on its own."""
    prods = qg[:, :, :, :, None, :] * jnp.moveaxis(k_blk.astype(jnp.float32), 2, 3)[:, :, :, None]
    scaled = jax.lax.optimization_barrier(tree_sum(prods, -1) * scale)
    return jnp.where(valid, scaled, _MASK)

  def block_max(m, i):
    k_blk, _, valid = keys(i)
    return jnp.maximum(m, jnp.max(scores(k_blk, valid), axis=-1)), None

  # Two passes rather than an online softmax: with the maximum known first, the second pass
  # only adds, so no product meets a sum that XLA:CPU could contract into an FMA in one
  # program and not in another.
  m, _ = jax.lax.scan(block_max, jnp.full((b, t, kvh, g), _MASK, jnp.float32),
                      jnp.arange(num_blocks))

  def block_sums(carry, i):
    l, acc = carry
    k_blk, v_blk, valid = keys(i)
    p = jnp.where(valid, fixed_path(jnp.exp, scores(k_blk, valid) - m[..., None]), 0.0)
    # The weights in the values' dtype, as flash attention kernels take them: a weight times
    # a value is then exact in float32.
    p = p.astype(v_blk.dtype).astype(jnp.float32)
    weighted = p[..., None] * jnp.moveaxis(v_blk.astype(jnp.float32), 2, 3)[:, :, :, None]
    return (l + tree_sum(p, -1), acc + tree_sum(weighted, -2)), None

  init = (jnp.zeros((b, t, kvh, g), jnp.float32), jnp.zeros((b, t, kvh, g, d), jnp.float32))
  (l, acc), _ = jax.lax.scan(block_sums, init, jnp.arange(num_blocks))
  out = acc / jnp.where(l == 0.0, 1.0, l)[..., None]
  return out.reshape(b, t, h, d).astype(q.dtype)
