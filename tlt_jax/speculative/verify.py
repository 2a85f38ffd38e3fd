"""Lossless acceptance of a verified draft tree, by the same Gumbel-max draws plain decoding
makes.

Plain decoding emits, at response position p, the token argmax(log q_p + g_p): an exact
sample from the policy's distribution q_p, with noise g_p fixed by (request, position) (see
`tlt_jax.speculative.sampling`). Verification walks the tree from the root: at a node of depth
d it computes that same token for position p + d from the policy's q at the node; if a child
carries it, the walk moves there, else it stops and the token itself is emitted. After a
fully accepted path of `max_depth` nodes the token of the next position is the bonus.

Every emitted token is therefore exactly the token plain decoding would have emitted: SD
changes how many tokens one policy pass yields, never which. A child is accepted with
probability q(child's token), summed over the children: what the target-only tree rule
accepts, without its residual resampling. Draft probabilities never enter. Greedy (no noise)
follows the child that carries the argmax.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.speculative.sampling import SamplingParams, gumbel_max
from tlt_jax.speculative.tree import DraftTree


@flax.struct.dataclass
class Acceptance:
  """path [B, D+1] node indices from the root (entries past num_nodes repeat the last node);
  num_nodes [B] int32 accepted nodes including the root (1..D+1); next_token [B] int32, the
  token that follows the accepted path."""
  path: jax.Array
  num_nodes: jax.Array
  next_token: jax.Array


def stop_token(probs: jax.Array, noise: jax.Array | None,
               sp: SamplingParams = SamplingParams()) -> jax.Array:
  """The token emitted where the walk stops: the stop node's own draw. [B] int32."""
  return gumbel_max(probs, noise, sp)


def accept_tree(tree: DraftTree, probs: jax.Array, noise: jax.Array | None,
                max_depth: int, sp: SamplingParams = SamplingParams()) -> Acceptance:
  """Walks the tree with the policy's distributions and the positions' noise.

  Args:
    tree: the verified draft tree (T nodes; children of a node carry distinct tokens).
    probs: [B, T, V] float32 target distribution q at every node (see `target_probs`).
    noise: [B, max_depth + 1, V] Gumbel noise of the positions after the root, p .. p + D
      (`token_noise`); None for greedy decoding.
    max_depth: the tree's maximum depth D (the strategy's `steps`).
    sp: the draw's numerics (sp.numerics; temperature and support are already in probs).
  """
  b = tree.tokens.shape[0]
  rows = jnp.arange(b)
  node = jnp.zeros((b,), jnp.int32)
  depth = jnp.zeros((b,), jnp.int32)
  alive = jnp.ones((b,), bool)
  path = [node]
  for level in range(max_depth):
    target = gumbel_max(probs[rows, node], None if noise is None else noise[:, level], sp)
    hit = (tree.parents == node[:, None]) & (tree.tokens == target[:, None])  # [B, T]
    found = alive & jnp.any(hit, axis=1)
    node = jnp.where(found, jnp.argmax(hit, axis=1).astype(jnp.int32), node)
    depth = depth + found
    alive = found
    path.append(node)
  path = jnp.stack(path, axis=1)
  level_noise = None if noise is None else noise[rows, depth]
  return Acceptance(path=path, num_nodes=depth + 1,
                    next_token=stop_token(probs[rows, node], level_noise, sp))
