"""Row operations on a GenState: gather rows into a smaller batch, scatter rows into a batch.

The engine uses them between compiled calls: to compact the running sequences into a smaller
batch-size bucket as others finish, and to insert freshly prefilled requests into rows freed
by finished ones (continuous batching). Each array's row axis comes from the state itself
(`GenState.row_axes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.speculative.decoding import GenState


def take_rows(state: GenState, rows: jax.Array) -> GenState:
  """A GenState of len(rows) rows: state's rows `rows` [R] int32, in that order."""
  return jax.tree.map(lambda x, axis: jnp.take(x, rows, axis=axis), state, state.row_axes())


def put_rows(state: GenState, new: GenState, rows: jax.Array) -> GenState:
  """state with rows `rows` [R] replaced by the R rows of `new` (same capacity and widths).

  Indices out of range are dropped, so a padded index list can point past the batch.
  """
  def put(x, y, axis):
    x = jnp.moveaxis(x, axis, 0)
    x = x.at[rows].set(jnp.moveaxis(y, axis, 0).astype(x.dtype), mode="drop")
    return jnp.moveaxis(x, 0, axis)
  return jax.tree.map(put, state, new, state.row_axes())
