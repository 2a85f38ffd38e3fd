"""The EAGLE drafter (a small trained decoder over the policy's features; see
`tlt_jax.models.drafter`) behind the drafter interface (`tlt_jax.drafters.base`): its KV
cache kept in step with the policy's, and the EAGLE-2 dynamic tree search."""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafter_training.loss import drafter_loss
from tlt_jax.drafters.base import Candidates, DraftContext
from tlt_jax.models.attention_inputs import decode_inputs, expansion_inputs, prefill_inputs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import (DrafterConfig, drafter_forward, init_drafter_cache,
                                    policy_token_ids)
from tlt_jax.models.kv_cache import KVCache, append_kv
from tlt_jax.models.policy import Policy

if TYPE_CHECKING:  # the strategy module imports the drafter registry
  from tlt_jax.speculative.strategy import Strategy


@flax.struct.dataclass
class EagleDrafter:
  """params: the drafter's weights (`init_drafter_params`); dcfg: its DrafterConfig.
  State: its KVCache of pairs (x_s, f_{s-1}), as long as the policy's cache."""
  reads_corpus = False  # drafts from its own weights, not from other responses
  params: dict
  dcfg: DrafterConfig = flax.struct.field(pytree_node=False)

  @staticmethod
  def candidate_count(depth: int, topk: int) -> int:
    """topk children of the root, then topk^2 per further step."""
    return topk + (depth - 1) * topk * topk

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
    return init_drafter_cache(cfg, self.dcfg, batch, capacity)

  def prefill(self, policy: Policy, state: KVCache, prompts: jax.Array, lengths: jax.Array,
              hidden: jax.Array) -> KVCache:
    """The prompt pairs (x_s, f_{s-1}), f_{-1} = 0, into an empty cache."""
    prev = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)
    _, _, k_new, v_new = self._forward(policy, prompts, prev,
                                       prefill_inputs(state.lengths, prompts.shape[1], lengths))
    return append_kv(state, k_new, v_new, lengths)

  def catch_up(self, policy: Policy, state: KVCache, tokens: jax.Array,
               prev_features: jax.Array, count: jax.Array) -> KVCache:
    """Appends the first count[b] pairs (tokens [B, A], prev_features [B, A, F])."""
    a = tokens.shape[1]
    attn = decode_inputs(state.lengths) if a == 1 else prefill_inputs(state.lengths, a)
    _, _, k_new, v_new = self._forward(policy, tokens, prev_features, attn, state)
    return append_kv(state, k_new, v_new, count)

  def propose(self, policy: Policy, state: KVCache, ctx: DraftContext, strategy: Strategy,
              limits: jax.Array | None = None) -> tuple[Candidates, KVCache]:
    """EAGLE-2 dynamic tree: expand the best `topk` beams by cumulative log-probability for
    `depth` drafter passes. Pass 0 reads the root pair (x_n, f_{n-1}), which is real, so it
    joins the cache (for active rows). Scores are cumulative log-probabilities (<= 0), so a
    parent always outranks its children. Under `limits`, passes past limits[0] are skipped
    (`lax.cond`) and their candidates score -inf."""
    cfg = policy.cfg
    k, passes = strategy.topk, strategy.depth
    b = ctx.root.shape[0]
    n = state.lengths

    feats, logits, k_root, v_root = self._forward(
        policy, ctx.root[:, None], ctx.features[:, None], decode_inputs(n), state)
    state = append_kv(state, k_root, v_root, ctx.active.astype(jnp.int32))
    logp, tok = jax.lax.top_k(jax.nn.log_softmax(logits[:, 0]), k)  # [B, K]
    tok = policy_token_ids(self.params, tok)  # a reduced draft vocabulary's ids -> policy's

    cand_tokens, cand_scores, cand_parents = [tok], [logp], [jnp.full((b, k), -1, jnp.int32)]
    beam_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index
    beam_scores, beam_tokens = logp, tok
    beam_feats = jnp.repeat(feats, k, axis=1)  # [B, K, E]: the parent's predicted feature
    buf_size = max(passes - 1, 1) * k
    buf_shape = (self.dcfg.num_layers, b, buf_size, cfg.num_kv_heads, cfg.head_dim)
    buf_k = jnp.zeros(buf_shape, state.k.dtype)
    buf_v = jnp.zeros(buf_shape, state.k.dtype)
    beam_anc = jnp.zeros((b, k, buf_size), bool)  # ancestors among earlier beams (buffer slots)
    next_id = k

    for depth in range(1, passes):
      def expand(beam_tokens, beam_feats, beam_anc, buf_k, buf_v, depth=depth):
        return self._forward(policy, beam_tokens, beam_feats,
                             expansion_inputs(n + depth, beam_anc), state,
                             earlier_kv=(buf_k, buf_v))
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
      child_tok = policy_token_ids(self.params, child_tok)
      scores = (beam_scores[:, :, None] + child_logp).reshape(b, k * k)
      if limits is not None:
        scores = jnp.where(depth < limits[0], scores, -jnp.inf)
      child_tok = child_tok.reshape(b, k * k)
      cand_tokens.append(child_tok)
      cand_scores.append(scores)
      cand_parents.append(jnp.repeat(beam_ids, k, axis=1))
      if depth == passes - 1:
        break
      beam_scores, pick = jax.lax.top_k(scores, k)  # [B, K] among the K*K children
      parent_beam = pick // k
      beam_ids = next_id + pick
      beam_tokens = jnp.take_along_axis(child_tok, pick, axis=1)
      beam_feats = jnp.take_along_axis(feats, parent_beam[:, :, None], axis=1)
      own_slot = jax.nn.one_hot(slot0 + parent_beam, buf_size, dtype=bool)
      beam_anc = jnp.take_along_axis(beam_anc, parent_beam[:, :, None], axis=1) | own_slot
      next_id += k * k

    cands = Candidates(tokens=jnp.concatenate(cand_tokens, 1).astype(jnp.int32),
                       parents=jnp.concatenate(cand_parents, 1).astype(jnp.int32),
                       scores=jnp.concatenate(cand_scores, 1))
    return cands, state

  def loss(self, policy: Policy, batch, **options):
    """The EAGLE-aligned loss on packed windows (`drafter_training.loss.drafter_loss`;
    options: ce_weight, train_depth, train_step_decay) -> (scalar, metrics)."""
    return drafter_loss(self.params, policy.params, batch, policy.cfg, self.dcfg, **options)

  def _forward(self, policy: Policy, tokens, features, attn, cache=None, earlier_kv=None):
    return drafter_forward(self.params, policy.params, tokens, features, attn, policy.cfg,
                           self.dcfg, cache=cache, earlier_kv=earlier_kv)
