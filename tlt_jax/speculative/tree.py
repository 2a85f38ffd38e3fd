"""Draft trees: the DraftTree topology, and the tree of one SD iteration built from the
candidates of one or several drafters (`tlt_jax.drafters`)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafters.base import Candidates, DraftContext
from tlt_jax.models.attention_inputs import ancestor_mask, tree_depths
from tlt_jax.models.policy import Policy
from tlt_jax.speculative.strategy import Strategy


@flax.struct.dataclass
class DraftTree:
  """A draft tree of T nodes per sequence, topologically ordered, node 0 = the root.

  tokens [B, T] int32; parents [B, T] int32 (-1 for the root); mask [B, T, T] bool
  ancestor-or-self; depths [B, T] int32 (root 0). Padding nodes (a smaller tree in a program
  shaped for a larger one) come last, with parent -1, depth -1 and an all-False mask row.
  """
  tokens: jax.Array
  parents: jax.Array
  mask: jax.Array
  depths: jax.Array


def tree_from_parents(tokens: jax.Array, parents: jax.Array,
                      valid: jax.Array | None = None) -> DraftTree:
  """A DraftTree from tokens and a topologically ordered parent array (both [B, T]); valid:
  optional [B, T] bool, False for padding nodes (see `ancestor_mask`)."""
  mask = ancestor_mask(parents, valid)
  return DraftTree(tokens=tokens, parents=parents, mask=mask, depths=tree_depths(mask))


def build_draft_tree(policy: Policy, drafters: dict, states: dict, ctx: DraftContext,
                     strategy: Strategy, limits: jax.Array | None = None
                     ) -> tuple[DraftTree, dict]:
  """The draft tree of one SD iteration: the candidates of the drafters `strategy.drafts`
  names (`tlt_jax.drafters`), merged in that order (`merge_candidates`), and the best
  `verify_tokens - 1` of them under the root.

  Args:
    policy: the Policy; drafters: name -> drafter; states: name -> drafter state (stateful
      drafters only); ctx: what the drafters read (root [B], its features, ...).
    limits: optional int32 [2], (depth, verify_tokens) of a smaller strategy with the same
      drafts and topk, drawn inside `strategy`'s shapes (one program serves several
      strategies): deeper candidates score -inf, and the nodes past `verify_tokens` are
      padding.
  Returns:
    (DraftTree with T = verify_tokens, the states: a proposing stateful drafter holds the root
    pair). Under `limits` the tree's first limits[1] nodes are the smaller strategy's tree,
    node for node, and the rest are padding: parent -1, depth -1, no one's ancestor, never
    accepted.
  """
  missing = [name for name in strategy.drafts if name not in drafters]
  if missing:
    raise ValueError(f"strategy {strategy.as_tuple()} drafts with {missing}, which this "
                     f"decoder was not given (it has {sorted(drafters)}); a trained drafter "
                     f"must be passed in to be used")
  states, merged = dict(states), None
  for name in strategy.drafts:
    cands, state = drafters[name].propose(policy, states.get(name), ctx, strategy, limits)
    if name in states:
      states[name] = state
    merged = cands if merged is None else merge_candidates(merged, cands)
  size = strategy.verify_tokens if limits is None else limits[1]
  return select_tree(ctx.root, merged, strategy.verify_tokens, size), states


def merge_candidates(first: Candidates, second: Candidates) -> Candidates:
  """second's candidates grafted onto first's: a candidate of second whose path from the root
  (its tokens) is already a candidate of first is that candidate, which takes the higher of the
  two scores; the rest join after first's, under their grafted parent, scoring at most their
  parent. So the merged candidates are topological, a parent never scores below its children,
  and no path is drafted twice. [B, C1 + C2] each."""
  b, c1 = first.tokens.shape
  scores1 = first.scores
  node = jnp.zeros((b, 0), jnp.int32)       # merged index of each of second's candidates so far
  parents2, scores2 = [], []
  for j in range(second.tokens.shape[1]):
    p = second.parents[:, j]
    parent = -jnp.ones_like(p) if j == 0 else jnp.where(
        p < 0, -1, jnp.take_along_axis(node, jnp.maximum(p, 0)[:, None], 1)[:, 0])
    same = ((first.parents == parent[:, None]) & (first.tokens == second.tokens[:, j, None])
            & (scores1 > -jnp.inf))                                            # [B, C1]
    found = jnp.any(same, axis=1) & (second.scores[:, j] > -jnp.inf)
    dup = jnp.argmax(same, axis=1)
    scores1 = jnp.where(same & found[:, None],
                        jnp.maximum(scores1, second.scores[:, j, None]), scores1)
    earlier = jnp.concatenate([scores1] + [s[:, None] for s in scores2], axis=1)
    parent_score = jnp.where(parent < 0, jnp.inf,
                             jnp.take_along_axis(earlier, jnp.maximum(parent, 0)[:, None], 1)[:, 0])
    scores2.append(jnp.where(found, -jnp.inf, jnp.minimum(second.scores[:, j], parent_score)))
    parents2.append(parent)
    node = jnp.concatenate([node, jnp.where(found, dup, c1 + j)[:, None].astype(jnp.int32)], 1)
  return Candidates(tokens=jnp.concatenate([first.tokens, second.tokens], 1),
                    parents=jnp.concatenate([first.parents, jnp.stack(parents2, 1)], 1),
                    scores=jnp.concatenate([scores1, jnp.stack(scores2, 1)], 1))


def select_tree(root_tokens: jax.Array, cands: Candidates, width: int, size) -> DraftTree:
  """Keeps the best size - 1 candidates (in candidate order) under the root, in a tree of
  `width` nodes whose nodes past `size` (an int32 scalar, traced or not) are padding, as are
  the -inf candidates a too-small draft leaves. root_tokens: [B] int32.

  A parent never scores below its children, and `top_k` breaks ties toward the lower
  (earlier) index, which the parent has: every kept node's parent is kept too."""
  cand_tokens, cand_scores, cand_parents = cands.tokens, cands.scores, cands.parents
  c = cand_tokens.shape[1]
  best, keep = jax.lax.top_k(cand_scores, width - 1)  # best first
  real = (jnp.arange(1, width)[None] < size) & (best > -jnp.inf)
  # Candidate order is topological; the padding sorts after every candidate.
  keep = jnp.sort(jnp.where(real, keep, c + jnp.arange(width - 1)[None]), axis=1)
  node_of_cand = jax.vmap(lambda kp: jnp.full((c,), -1, jnp.int32).at[kp].set(
      jnp.arange(1, width, dtype=jnp.int32), mode="drop"))(keep)
  keep = jnp.minimum(keep, c - 1)
  cand_parent = jnp.take_along_axis(cand_parents, keep, axis=1)
  parent_node = jnp.where(cand_parent < 0, 0, jnp.take_along_axis(
      node_of_cand, jnp.maximum(cand_parent, 0), axis=1))
  tokens = jnp.concatenate([root_tokens[:, None], jnp.take_along_axis(cand_tokens, keep, 1)], 1)
  parents = jnp.concatenate([jnp.full_like(root_tokens[:, None], -1),
                             jnp.where(real, parent_node, -1)], axis=1)
  valid = jnp.concatenate([jnp.ones_like(real[:, :1]), real], axis=1)
  valid = jnp.broadcast_to(valid, parents.shape)
  return tree_from_parents(tokens.astype(jnp.int32), parents.astype(jnp.int32), valid)
