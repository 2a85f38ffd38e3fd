"""Tree topology helpers: parent arrays to ancestor masks and depths."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def ancestor_mask(parents: jax.Array, valid: jax.Array | None = None) -> jax.Array:
  """Ancestor-or-self mask of a topologically ordered tree.

  Args:
    parents: [B, T] int32; parents[b, i] < i is node i's parent, -1 for the root (node 0).
    valid: optional [B, T] bool; invalid (padding) nodes get an all-False row and are not
      anyone's ancestor.
  Returns:
    [B, T, T] bool, mask[b, i, j] = node j is node i or one of its ancestors.
  """
  t = parents.shape[1]
  valid = jnp.ones(parents.shape, bool) if valid is None else valid

  def one_tree(par, ok):
    def add_node(i, mask):
      p = par[i]
      inherited = jnp.where(p >= 0, mask[jnp.maximum(p, 0)], jnp.zeros((t,), bool))
      return mask.at[i].set((inherited | (jnp.arange(t) == i)) & ok[i])
    return jax.lax.fori_loop(0, t, add_node, jnp.zeros((t, t), bool))

  return jax.vmap(one_tree)(parents, valid)


def tree_depths(mask: jax.Array) -> jax.Array:
  """[B, T] int32 depth of each node (root 0; padding nodes -1) from an ancestor mask."""
  return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1
