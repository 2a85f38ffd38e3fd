"""The explicit KV cache: a pytree that flows through pure prefill/decode/verify calls.

Layout (the layers stacked, as the weights are):
  k, v:    [L, B, KVH, S, D] in the model's compute dtype. Head-major so that one KV head's
           prefix is a contiguous [S, D] slab, which is what the attention kernel streams.
  lengths: [B] int32. Row b holds valid entries at slots [0, lengths[b]); entries beyond are
           garbage and always masked. The token at cache slot s has RoPE position s.

The cache declares its axes (`row_axes`, `logical_axes`), so code that moves rows between
batches or places a cache on a mesh never has to guess them from shapes.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

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
    return self.lengths.shape[0]

  def row_axes(self) -> "KVCache":
    """The batch-row axis of every array (a KVCache of ints)."""
    return KVCache(k=CACHE_KV_AXES.index("batch"), v=CACHE_KV_AXES.index("batch"),
                   lengths=0)

  def logical_axes(self) -> "KVCache":
    """The logical axis names of every array (a KVCache of PartitionSpecs)."""
    kv = PartitionSpec(*CACHE_KV_AXES)
    return KVCache(k=kv, v=kv, lengths=PartitionSpec(*CACHE_LENGTHS_AXES))


def init_cache(cfg: ModelConfig, batch_size: int, capacity: int) -> KVCache:
  """An empty cache for `batch_size` sequences of up to `capacity` tokens each."""
  shape = (cfg.num_layers, batch_size, cfg.num_kv_heads, capacity, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype),
                 lengths=jnp.zeros((batch_size,), jnp.int32))


def empty_prefix(cfg: ModelConfig, batch_size: int) -> KVCache:
  """A one-slot cache with nothing valid: the prefix of a forward that has none (training)."""
  return init_cache(cfg, batch_size, 1)


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
  slots = _slots(cache.lengths, cache.capacity, t, num_new)
  lengths = jnp.minimum(cache.lengths + num_new.astype(jnp.int32), cache.capacity)
  return KVCache(k=_scatter(cache.k, k_new, slots), v=_scatter(cache.v, v_new, slots),
                 lengths=lengths)


def write_layer_kv(buf: jax.Array, layer, new: jax.Array, lengths: jax.Array,
                   num_new: jax.Array) -> jax.Array:
  """Writes one layer's new entries into a stacked cache array, in place where XLA can.

  Args:
    buf: cache.k or cache.v [L, B, KVH, S, D].
    layer: the layer index (a Python int, or a traced int32 scalar inside a layer scan).
    new: [B, T, KVH, D] that layer's keys or values of T new tokens per row.
    lengths, num_new: [B] int32 as in `append_kv` (lengths are not advanced here).
  Returns:
    buf with the entries written (the same drop rule as `append_kv`).
  """
  slots = _slots(lengths, buf.shape[3], new.shape[1], num_new)
  return _scatter(buf, new, slots, layer)


def _slots(lengths: jax.Array, capacity: int, t: int, num_new: jax.Array) -> jax.Array:
  """[B, T] int32 target slots of T new entries per row; entries past num_new[b] get the
  out-of-range slot `capacity`, which the scatter drops."""
  j = jnp.arange(t)[None, :]
  return jnp.where(j < num_new[:, None], lengths[:, None] + j, capacity)


def _scatter(buf: jax.Array, new: jax.Array, slots: jax.Array, layer=None) -> jax.Array:
  """One scatter indexed by (row, slot) on axes 1 and 3 of buf [L, B, KVH, S, D]: new is
  [L, B, T, KVH, D] for every layer (layer None) or [B, T, KVH, D] for one. A per-row vmap
  here made XLA re-layout the whole cache on every step."""
  rows = jnp.broadcast_to(jnp.arange(slots.shape[0])[:, None], slots.shape)
  if layer is None:
    # The indexed axes lead the update: [L, B, T, KVH, D] -> [B, T, L, KVH, D].
    return buf.at[:, rows, :, slots, :].set(jnp.moveaxis(new, 0, 2).astype(buf.dtype),
                                            mode="drop")
  return buf.at[layer, rows, :, slots, :].set(new.astype(buf.dtype), mode="drop")


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
