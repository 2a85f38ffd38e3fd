"""Row operations on a GenState: gather rows into a smaller batch, scatter rows into a batch.

The engine uses them between compiled calls: to compact the running sequences into a smaller
batch-size bucket as others finish, and to insert freshly prefilled requests into rows freed
by finished ones (continuous batching). Row `i` of a GenState lives at axis 1 of the cache
K/V arrays ([L, B, ...]) and at axis 0 of everything else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.models.kv_cache import KVCache
from tlt_jax.speculative.decoding import GenState


def _map_rows(fn, state: GenState, *others: GenState) -> GenState:
  """Applies fn(x, *xs, axis) to every array of the state(s) with its row axis."""
  def cache_map(c, *cs):
    if c is None:
      return None
    return KVCache(k=fn(c.k, *[o.k for o in cs], axis=1), v=fn(c.v, *[o.v for o in cs], axis=1),
                   lengths=fn(c.lengths, *[o.lengths for o in cs], axis=0))
  rows = lambda name: fn(getattr(state, name), *[getattr(o, name) for o in others],  # noqa
                         axis=0)
  return GenState(cache=cache_map(state.cache, *[o.cache for o in others]),
                  draft_cache=cache_map(state.draft_cache, *[o.draft_cache for o in others]),
                  root=rows("root"), features=rows("features"), out=rows("out"),
                  num_out=rows("num_out"), done=rows("done"),
                  feature_log=None if state.feature_log is None else rows("feature_log"))


def take_rows(state: GenState, rows: jax.Array) -> GenState:
  """A GenState of len(rows) rows: state's rows `rows` [R] int32, in that order."""
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis), state)


def put_rows(state: GenState, new: GenState, rows: jax.Array) -> GenState:
  """state with rows `rows` [R] replaced by the R rows of `new` (same capacity and widths).

  Indices out of range are dropped, so a padded index list can point past the batch.
  """
  def put(x, y, axis):
    x = jnp.moveaxis(x, axis, 0)
    x = x.at[rows].set(jnp.moveaxis(y, axis, 0).astype(x.dtype), mode="drop")
    return jnp.moveaxis(x, 0, axis)
  return _map_rows(put, state, new)
