"""Draft trees: the DraftTree topology and the EAGLE-2 dynamic tree the drafter builds."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.attention_inputs import (ancestor_mask, decode_inputs, expansion_inputs,
                                             tree_depths)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterConfig, drafter_forward, policy_token_ids
from tlt_jax.models.kv_cache import KVCache, append_kv
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


def build_draft_tree(drafter_params: dict, policy_params: dict, root_tokens: jax.Array,
                     root_features: jax.Array, drafter_cache: KVCache, active: jax.Array,
                     strategy: Strategy, cfg: ModelConfig, dcfg: DrafterConfig,
                     limits: jax.Array | None = None):
  """EAGLE-2 dynamic tree: expand the best `topk` beams by cumulative log-probability for
  `steps` drafter passes, then keep the best `verify_tokens - 1` candidates plus the root.

  Args:
    root_tokens: [B] int32, the newest token (sampled, not yet in either cache).
    root_features: [B, E] policy features of the token before it (f_{n-1}).
    drafter_cache: the drafter's cache, same length n as the policy's.
    active: [B] bool; inactive rows are drafted but their cache is not extended.
    limits: optional int32 [2], (steps, verify_tokens) of a smaller strategy of the same topk
      drawn inside `strategy`'s shapes (one program serves several strategies): passes past
      `steps` are skipped, and the nodes past `verify_tokens` are padding.
  Returns:
    (DraftTree with T = verify_tokens, drafter cache extended by the root pair). Under
    `limits` the tree's first limits[1] nodes are the smaller strategy's tree, node for node,
    and the rest are padding: parent -1, depth -1, no one's ancestor, never accepted.

  A candidate's score is its parent's score plus a log-probability (<= 0), so a parent always
  outranks its children, and `top_k` breaks ties toward the lower (earlier) index, which the
  parent has: every kept node's parent is kept too.
  """
  k, steps = strategy.topk, strategy.steps
  b = root_tokens.shape[0]
  n = drafter_cache.lengths

  # Pass 0: the root pair (x_n, f_{n-1}) at slot n; it is real, so it joins the cache.
  feats, logits, k_root, v_root = drafter_forward(
      drafter_params, policy_params, root_tokens[:, None], root_features[:, None],
      decode_inputs(n), cfg, dcfg, cache=drafter_cache)
  drafter_cache = append_kv(drafter_cache, k_root, v_root, active.astype(jnp.int32))
  logp, tok = jax.lax.top_k(jax.nn.log_softmax(logits[:, 0]), k)  # [B, K]
  tok = policy_token_ids(drafter_params, tok)  # a reduced draft vocabulary's ids -> policy's

  cand_tokens, cand_scores, cand_parents = [tok], [logp], [jnp.full((b, k), -1, jnp.int32)]
  beam_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index
  beam_scores, beam_tokens = logp, tok
  beam_feats = jnp.repeat(feats, k, axis=1)  # [B, K, E]: the parent's predicted feature
  buf_size = max(steps - 1, 1) * k
  buf_shape = (dcfg.num_layers, b, buf_size, cfg.num_kv_heads, cfg.head_dim)
  buf_k = jnp.zeros(buf_shape, drafter_cache.k.dtype)
  buf_v = jnp.zeros(buf_shape, drafter_cache.k.dtype)
  beam_anc = jnp.zeros((b, k, buf_size), bool)  # ancestors among earlier beams (buffer slots)
  next_id = k

  for depth in range(1, steps):
    def expand(beam_tokens, beam_feats, beam_anc, buf_k, buf_v, depth=depth):
      return drafter_forward(drafter_params, policy_params, beam_tokens, beam_feats,
                             expansion_inputs(n + depth, beam_anc), cfg, dcfg,
                             cache=drafter_cache, earlier_kv=(buf_k, buf_v))
    operands = (beam_tokens, beam_feats, beam_anc, buf_k, buf_v)
    if limits is None:
      feats, logits, k_new, v_new = expand(*operands)
    else:  # a pass past the smaller strategy's depth is not run: its candidates score -inf
      skip = lambda *ops, expand=expand: jax.tree.map(  # noqa: E731
          jnp.zeros_like, jax.eval_shape(expand, *ops))
      feats, logits, k_new, v_new = jax.lax.cond(depth < limits[0], expand, skip, *operands)
    slot0 = (depth - 1) * k
    buf_k = jax.lax.dynamic_update_slice_in_dim(buf_k, k_new.astype(buf_k.dtype), slot0, 2)
    buf_v = jax.lax.dynamic_update_slice_in_dim(buf_v, v_new.astype(buf_v.dtype), slot0, 2)

    child_logp, child_tok = jax.lax.top_k(jax.nn.log_softmax(logits), k)  # [B, K, K]
    child_tok = policy_token_ids(drafter_params, child_tok)
    scores = (beam_scores[:, :, None] + child_logp).reshape(b, k * k)
    if limits is not None:
      scores = jnp.where(depth < limits[0], scores, -jnp.inf)
    child_tok = child_tok.reshape(b, k * k)
    cand_tokens.append(child_tok)
    cand_scores.append(scores)
    cand_parents.append(jnp.repeat(beam_ids, k, axis=1))
    if depth == steps - 1:
      break
    beam_scores, pick = jax.lax.top_k(scores, k)  # [B, K] among the K*K children
    parent_beam = pick // k
    beam_ids = next_id + pick
    beam_tokens = jnp.take_along_axis(child_tok, pick, axis=1)
    beam_feats = jnp.take_along_axis(feats, parent_beam[:, :, None], axis=1)
    own_slot = jax.nn.one_hot(slot0 + parent_beam, buf_size, dtype=bool)
    beam_anc = jnp.take_along_axis(beam_anc, parent_beam[:, :, None], axis=1) | own_slot
    next_id += k * k

  size = strategy.verify_tokens if limits is None else limits[1]
  return _select_tree(root_tokens, jnp.concatenate(cand_tokens, 1),
                      jnp.concatenate(cand_scores, 1), jnp.concatenate(cand_parents, 1),
                      strategy.verify_tokens, size), drafter_cache


def _select_tree(root_tokens, cand_tokens, cand_scores, cand_parents, width: int,
                 size) -> DraftTree:
  """Keeps the best size - 1 candidates (in candidate order) under the root, in a tree of
  `width` nodes whose nodes past `size` (an int32 scalar, traced or not) are padding."""
  c = cand_tokens.shape[1]
  _, keep = jax.lax.top_k(cand_scores, width - 1)  # best first
  real = jnp.arange(1, width)[None] < size
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
