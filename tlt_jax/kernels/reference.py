"""Reference (jnp) attention over a KV-cache prefix plus a block of new tokens.

One primitive serves prefill (new block is causal), decode (T = 1) and tree verification (new
block masked by tree ancestry). The Pallas kernel in this package implements the same contract.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Large negative instead of -inf so a fully masked row stays finite before the final guard.
_MASK_VALUE = -1e30


def prefix_tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    *,
    scale: float | None = None,
) -> jax.Array:
  """Attention of T new queries over a cached prefix and N >= T uncached keys.

  Args:
    q: [B, T, H, D] queries of the new tokens (any float dtype).
    k_cache, v_cache: [B, KVH, S, D] cached keys/values; entry s of row b is valid iff
      s < cache_lengths[b]. H must be a multiple of KVH (grouped-query attention).
    cache_lengths: [B] int32, valid prefix length per sequence (0 allowed).
    k_new, v_new: [B, N, KVH, D] keys/values not in the cache: usually the T new tokens
      themselves (N = T); the drafter's tree expansion puts earlier draft nodes first (N > T).
    new_mask: [B, T, N] bool; new_mask[b, i, j] says query i may attend uncached key j
      (causal for prefill, ancestor-or-self for a draft tree, False rows for padding).
    scale: softmax scale, default D ** -0.5.

  Returns:
    [B, T, H, D] in q.dtype. A query with nothing to attend to returns zeros, never NaN.
  """
  b, t, h, d = q.shape
  kvh = k_cache.shape[1]
  if h % kvh:
    raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
  g = h // kvh
  scale = d**-0.5 if scale is None else scale
  s = k_cache.shape[2]

  qg = q.reshape(b, t, kvh, g, d).astype(jnp.float32) * scale
  kc = k_cache.astype(jnp.float32)
  vc = v_cache.astype(jnp.float32)
  kn = k_new.astype(jnp.float32)
  vn = v_new.astype(jnp.float32)

  # Scores against the prefix [B, KVH, G, T, S] and against the new block [B, KVH, G, T, N].
  s_prefix = jnp.einsum("btkgd,bksd->bkgts", qg, kc)
  s_new = jnp.einsum("btkgd,bjkd->bkgtj", qg, kn)
  prefix_valid = jnp.arange(s)[None, :] < cache_lengths[:, None]  # [B, S]
  s_prefix = jnp.where(prefix_valid[:, None, None, None, :], s_prefix, _MASK_VALUE)
  s_new = jnp.where(new_mask[:, None, None, :, :], s_new, _MASK_VALUE)

  scores = jnp.concatenate([s_prefix, s_new], axis=-1)
  m = jnp.max(scores, axis=-1, keepdims=True)
  p = jnp.exp(scores - m)
  valid = jnp.concatenate(
      [jnp.broadcast_to(prefix_valid[:, None, None, None, :], s_prefix.shape),
       jnp.broadcast_to(new_mask[:, None, None, :, :], s_new.shape)], axis=-1)
  p = jnp.where(valid, p, 0.0)
  denom = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(denom == 0.0, 1.0, denom)

  out = (jnp.einsum("bkgts,bksd->btkgd", p[..., :s], vc)
         + jnp.einsum("bkgtj,bjkd->btkgd", p[..., s:], vn))
  return out.reshape(b, t, h, d).astype(q.dtype)


def query_chunked_attention(attention_fn, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                            cache_lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                            new_mask: jax.Array, chunk: int, **kw) -> jax.Array:
  """attention_fn (the contract above) computed `chunk` queries at a time, each chunk under
  `jax.checkpoint`, so neither the forward nor the backward pass ever holds more than one
  chunk's [B, H, chunk, S + N] scores: the saved residuals are the inputs alone. Every query
  still sees every key, so the result is the same attention (exact, not approximated), for
  any mask (causal rows, packed segments, the drafter's unrolled steps).

  Shapes as in `prefix_tree_attention_reference`; chunk <= 0 or T <= chunk calls it once.
  """
  b, t = q.shape[:2]
  if chunk <= 0 or t <= chunk:
    return attention_fn(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, **kw)
  pad = -t % chunk
  n = (t + pad) // chunk
  # Padded queries attend to nothing (all-False mask rows) and come back as zeros, cut below.
  q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
  new_mask = jnp.pad(new_mask, ((0, 0), (0, pad), (0, 0)))
  qs = q.reshape(b, n, chunk, *q.shape[2:]).swapaxes(0, 1)
  masks = new_mask.reshape(b, n, chunk, new_mask.shape[-1]).swapaxes(0, 1)

  @jax.checkpoint
  def one(q_chunk, mask_chunk):
    return attention_fn(q_chunk, k_cache, v_cache, cache_lengths, k_new, v_new, mask_chunk,
                        **kw)
  out = jax.lax.map(lambda a: one(*a), (qs, masks))  # [n, B, chunk, H, D]
  return out.swapaxes(0, 1).reshape(b, t + pad, *out.shape[3:])[:, :t]
