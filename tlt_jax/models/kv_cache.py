"""The policy's explicit KV cache: a pytree that flows through pure prefill/decode/verify calls.

Layout (all layers stacked so the decoder can scan over them):
  k, v:    [L, B, KVH, S, D] in the model's compute dtype. Head-major so that one KV head's
           prefix is a contiguous [S, D] slab, which is what the attention kernel streams.
  lengths: [B] int32. Row b holds valid entries at positions [0, lengths[b]); entries beyond are
           garbage and always masked. Token at cache slot s has RoPE position s.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.config import ModelConfig

# Logical axis names of the cache arrays, for sharding rules (see tlt_jax.mesh).
CACHE_KV_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")
CACHE_LENGTHS_AXES = ("batch",)


@flax.struct.dataclass
class KVCache:
  k: jax.Array
  v: jax.Array
  lengths: jax.Array

  @property
  def capacity(self) -> int:
    """S: the number of token slots per sequence."""
    return self.k.shape[3]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int) -> KVCache:
  """An empty cache for `batch_size` sequences of up to `capacity` tokens each."""
  shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def append_kv(cache: KVCache, k_new: jax.Array, v_new: jax.Array,
              num_new: jax.Array) -> KVCache:
  """Writes the first num_new[b] of T new entries of each row at slots lengths[b] + j.

  Args:
    cache: the cache to extend.
    k_new, v_new: [L, B, T, KVH, D] keys/values of T new tokens per row, in order.
    num_new: [B] int32, how many of the T entries to keep (0..T); the rest are not written.

  Writes past the capacity are dropped rather than clamped, so a full row is never corrupted;
  lengths saturate at the capacity.
  """
  t = k_new.shape[2]
  j = jnp.arange(t)[None, :]
  slots = cache.lengths[:, None] + j  # [B, T]
  # Out-of-range slot index: the scatter drops it.
  slots = jnp.where(j < num_new[:, None], slots, cache.capacity)

  def write_row(buf, new, row_slots):
    # buf [L, KVH, S, D]; new [L, T, KVH, D]; row_slots [T].
    return buf.at[:, :, row_slots, :].set(jnp.swapaxes(new, 1, 2).astype(buf.dtype), mode="drop")

  write = jax.vmap(write_row, in_axes=(1, 1, 0), out_axes=1)
  lengths = jnp.minimum(cache.lengths + num_new.astype(jnp.int32), cache.capacity)
  return KVCache(k=write(cache.k, k_new, slots),
                 v=write(cache.v, v_new, slots), lengths=lengths)


def gather_tree_kv(tree_kv: jax.Array, path: jax.Array) -> jax.Array:
  """Selects tree nodes along accepted paths.

  Args:
    tree_kv: [L, B, T, KVH, D] keys or values of the T tree tokens returned by `verify`.
    path: [B, P] int32 tree-node indices in acceptance order (entries past the accepted count
      may be anything in [0, T)).
  Returns:
    [L, B, P, KVH, D], ready for `append_kv` with num_new = accepted count.
  """
  return jnp.take_along_axis(tree_kv, path[None, :, :, None, None], axis=2)
