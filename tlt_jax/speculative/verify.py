"""Lossless acceptance of a verified draft tree (target-only tree rule).

At the current node, with the policy's distribution q there, draw one uniform u and walk the
node's children in order, accumulating q of their tokens: the first child whose cumulative mass
exceeds u is accepted, so child token t is taken with probability q(t) given that the earlier
siblings were not. If none is, the next token is sampled from q with the tried children
removed (renormalised), so every token's total probability is exactly q(t). After the deepest
accepted node the same residual draw gives the bonus token. Draft probabilities never enter:
the drafter only decides which tokens get a chance. Greedy (one-hot q) reduces to following
the child whose token is the argmax.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.speculative.sampling import sample_from_probs
from tlt_jax.speculative.tree import DraftTree


@flax.struct.dataclass
class Acceptance:
  """path [B, D+1] node indices from the root (entries past num_nodes repeat the last node);
  num_nodes [B] int32 accepted nodes including the root (1..D+1); next_token [B] int32, the
  bonus/residual token that follows the accepted path."""
  path: jax.Array
  num_nodes: jax.Array
  next_token: jax.Array


def residual_probs(q: jax.Array, tried: jax.Array) -> jax.Array:
  """q [B, V] with the tried tokens (bool [B, V]) removed; unnormalised (the sampler scales).

  Float rounding can leave u just above a children mass of 1, so that nothing is left: then
  q's own support is kept.
  """
  residual = jnp.where(tried, 0.0, q)
  return jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, q)


def accept_tree(tree: DraftTree, probs: jax.Array, key: jax.Array, max_depth: int,
                greedy: bool) -> Acceptance:
  """Walks the tree with the policy's distributions.

  Args:
    tree: the verified draft tree (T nodes; children of a node carry distinct tokens).
    probs: [B, T, V] float32 target distribution q at every node (see `target_probs`).
    key: PRNG key (unused when greedy).
    max_depth: the tree's maximum depth D (the strategy's `steps`).
    greedy: probs are one-hot; follow argmax matches, no randomness.
  """
  b, t = tree.tokens.shape
  rows = jnp.arange(b)
  keys = jax.random.split(key, max_depth + 1)
  node = jnp.zeros((b,), jnp.int32)
  alive = jnp.ones((b,), bool)
  path = [node]
  for level in range(max_depth):
    q = probs[rows, node]  # [B, V]
    is_child = tree.parents == node[:, None]  # [B, T]
    child_q = jnp.where(is_child, jnp.take_along_axis(q, tree.tokens, axis=1), 0.0)
    if greedy:
      hit = is_child & (tree.tokens == jnp.argmax(q, axis=-1)[:, None])
    else:
      u = jax.random.uniform(keys[level], (b, 1), jnp.float32)
      hit = is_child & (jnp.cumsum(child_q, axis=1) > u)
    found = alive & jnp.any(hit, axis=1)
    node = jnp.where(found, jnp.argmax(hit, axis=1).astype(jnp.int32), node)
    alive = found
    path.append(node)

  # Residual at the final node: q without the children that were tried (all of them; none
  # for a leaf). Greedy: the argmax, which no child matched.
  q = probs[rows, node]
  if greedy:
    next_token = jnp.argmax(q, axis=-1).astype(jnp.int32)
  else:
    is_child = tree.parents == node[:, None]
    tried = jnp.zeros_like(q, dtype=bool).at[rows[:, None], tree.tokens].max(is_child)
    next_token = sample_from_probs(keys[max_depth], residual_probs(q, tried))
  path = jnp.stack(path, axis=1)
  num_nodes = 1 + jnp.sum(path[:, 1:] != path[:, :-1], axis=1, dtype=jnp.int32)
  return Acceptance(path=path, num_nodes=num_nodes, next_token=next_token)
