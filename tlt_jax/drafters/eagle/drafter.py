"""The EAGLE drafter (a small trained decoder over the policy's features; see
`tlt_jax.drafters.eagle.network`) behind the drafter interface (`tlt_jax.drafters.base`): its KV
cache kept in step with the policy's, the EAGLE-2 dynamic tree search, its loss (EAGLE-3's
training-time test with drafter.train_depth > 1), and its export in EAGLE's Hugging Face
layout.

The export: `config.json` (the DrafterConfig and the policy shape it was trained for) and
`model.safetensors` with EAGLE's tensor names: `fc.weight` / `fc.bias` ([E, in], as
torch.nn.Linear stores them), `layers.{i}.self_attn.q_proj.weight` and the rest of each
decoder layer under the same names as the policy's layers (a Qwen3 policy's `q_norm` /
`k_norm` included), and `norm.weight` / `fuse.weight` when the architecture has them. The
embedding and LM head are the policy's and are not saved. A drafter with a reduced draft
vocabulary also holds its own head and the vocabulary maps as EAGLE-3 stores them:
`lm_head.weight` [r, E], `d2t` [r] int64 offsets (policy id = draft id + d2t[draft id]) and
`t2d` [V] bool (the policy ids in the draft vocabulary), with `draft_vocab_size` at the top
level of config.json.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafters.base import (Candidates, DraftContext, TrainedDrafter, beam_tree_count,
                                   register_drafter)
from tlt_jax.drafters.eagle.draft_vocab import (frequent_tokens, ids_from_offsets,
                                                in_draft_vocab, offsets_from_ids)
from tlt_jax.drafters.eagle.loss import drafter_loss
from tlt_jax.drafters.eagle.network import (DRAFT_TO_POLICY, DrafterConfig, drafter_forward,
                                            drafter_model_config, drafter_param_specs,
                                            init_drafter_cache, policy_token_ids,
                                            with_draft_vocab)
from tlt_jax.models.attention_inputs import decode_inputs, expansion_inputs, prefill_inputs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.hf import _tensor_table
from tlt_jax.models.kv_cache import KVCache, append_kv
from tlt_jax.models.policy import Policy

if TYPE_CHECKING:  # the strategy module imports the drafter registry
  from tlt_jax.speculative.strategy import Strategy


def top_log_probs(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """The k most likely tokens of logits [..., V] (float32): (log-probabilities [..., k],
  ids [..., k] int32), as `top_k(log_softmax(logits))` computes them, but ranked on the logits
  themselves and normalised on the k winners only: the full-vocabulary log-softmax is never
  written out (one pass over [rows, beams, V] less per draft depth). The values are
  log_softmax's own arithmetic, (x - max) - log(sum(exp(x - max))), bit for bit; only where
  rounding makes two log-probabilities equal may the pick among them differ, which changes a
  draft, never an emitted token."""
  top, ids = jax.lax.top_k(logits, k)
  m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
  lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))
  return (top - m) - lse, ids


@register_drafter("eagle")
@flax.struct.dataclass
class EagleDrafter(TrainedDrafter):
  """params: the drafter's weights (`init_drafter_params`); settings: its DrafterConfig
  (config section drafter.eagle). State: its KVCache of pairs (x_s, f_{s-1}), as long as the
  policy's cache."""
  Settings = DrafterConfig
  loss_reads = ("ce_weight", "train_depth", "train_step_decay")
  hf_architecture = "TltJaxEagleDrafter"
  params: dict
  settings: DrafterConfig = flax.struct.field(pytree_node=False, default=DrafterConfig())

  candidate_count = staticmethod(beam_tree_count)  # topk, then topk^2 per further step

  def init_state(self, cfg: ModelConfig, batch: int, capacity: int) -> KVCache:
    return init_drafter_cache(cfg, self.settings, batch, capacity)

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
    logp, tok = top_log_probs(logits[:, 0], k)  # [B, K]
    tok = policy_token_ids(self.params, tok)  # a reduced draft vocabulary's ids -> policy's

    cand_tokens, cand_scores, cand_parents = [tok], [logp], [jnp.full((b, k), -1, jnp.int32)]
    beam_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate index
    beam_scores, beam_tokens = logp, tok
    beam_feats = jnp.repeat(feats, k, axis=1)  # [B, K, E]: the parent's predicted feature
    buf_size = max(passes - 1, 1) * k
    buf_shape = (self.settings.num_layers, b, buf_size, cfg.num_kv_heads, cfg.head_dim)
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

      child_logp, child_tok = top_log_probs(logits, k)  # [B, K, K]
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
    """The EAGLE-aligned loss on packed windows (`tlt_jax.drafters.eagle.loss.drafter_loss`;
    options: ce_weight, train_depth, train_step_decay) -> (scalar, metrics)."""
    return drafter_loss(self.params, policy.params, batch, policy.cfg, self.settings, **options)

  # ---------------------------------------------------------------- weights and export

  @classmethod
  def check_strategies(cls, settings: DrafterConfig, strategies: list, section: str,
                       where: str) -> list[str]:
    """A reduced draft vocabulary holds at least the widest strategy's topk (a beam keeps topk
    distinct draft tokens); fused layer outputs want a norm at the input (on a real model they
    are the residual stream's, far larger than the final-norm state: such a drafter diverged)."""
    widest = max((s.topk for s in strategies), default=0)
    if settings.draft_vocab_size and settings.draft_vocab_size < widest:
      raise ValueError(f"{section}.draft_vocab_size={settings.draft_vocab_size} is below the "
                       f"widest strategy's topk ({widest}, in {where}); use at least {widest}")
    if settings.feature_layers and not settings.norm_input:
      return [f"{section}.feature_layers={tuple(settings.feature_layers)} fuses the policy's "
              f"layer outputs before any norm; set {section}.norm_input=True (without it an "
              f"EAGLE-3 drafter diverged on SmolLM2-135M: docs/results/drafter_ablation_smollm2)"]
    return []

  @classmethod
  def param_specs(cls, settings: DrafterConfig, cfg: ModelConfig) -> dict:
    return drafter_param_specs(cfg, settings)

  @classmethod
  def untrained_problem(cls, settings: DrafterConfig) -> str | None:
    if settings.draft_vocab_size:
      return (f"drafter.eagle.draft_vocab_size={settings.draft_vocab_size} needs a drafter "
              f"whose draft vocabulary was chosen from the policy's responses: set "
              f"drafter.eagle.path to an export of python -m tlt_jax.warmup_drafter (or "
              f"drafter.eagle.draft_vocab_size=0); a new one would draft ids 0 to "
              f"{settings.draft_vocab_size - 1}")
    return None

  @classmethod
  def warm_start(cls, settings: DrafterConfig, params: dict, policy_params: dict,
                 cfg: ModelConfig, responses, say=print) -> dict:
    """A reduced draft vocabulary: the tokens the policy generates most (EAGLE-3, FR-Spec),
    its head started from the policy's LM head at those ids."""
    if not settings.draft_vocab_size:
      return params
    d2t = frequent_tokens(responses, cfg.vocab_size, settings.draft_vocab_size)
    say(f"draft vocabulary: the {settings.draft_vocab_size} of {cfg.vocab_size} tokens most "
        f"frequent in the responses")
    return with_draft_vocab(params, policy_params, d2t, cfg)

  @classmethod
  def hf_tensors(cls, settings: DrafterConfig, cfg: ModelConfig) -> list[tuple]:
    """EAGLE's names (see the module docstring)."""
    t = lambda w: w.T  # noqa: E731
    rows = [("fc.weight", ("fc", "kernel"), t, t), ("fc.bias", ("fc", "bias"), None, None)]
    if settings.feature_layers:
      rows.append(("fuse.weight", ("fuse", "kernel"), t, t))
    if settings.norm_output:
      rows.append(("norm.weight", ("norm", "weight"), None, None))
    if settings.draft_vocab_size:
      rows.append(("lm_head.weight", ("lm_head", "kernel"), t, t))
      rows.append(("d2t", (DRAFT_TO_POLICY,), ids_from_offsets, offsets_from_ids))
    layer_rows = [r for r in _tensor_table(drafter_model_config(cfg, settings)) if r.per_layer]
    for i in range(settings.num_layers):
      for r in layer_rows:
        if r.path[1] == "input_layernorm" and i == 0 and not settings.norm_input:
          continue  # EAGLE's first layer has no input norm
        rows.append((r.hf_name.format(i=i).removeprefix("model."), (f"layer_{i}",) + r.path[1:],
                     r.to_ours, r.to_hf))
    return rows

  @classmethod
  def extra_tensors(cls, settings: DrafterConfig, params: dict, cfg: ModelConfig) -> dict:
    """EAGLE-3's t2d mask beside a reduced vocabulary's d2t."""
    if not settings.draft_vocab_size:
      return {}
    d2t = np.asarray(jax.device_get(params[DRAFT_TO_POLICY]))
    return {"t2d": np.asarray(in_draft_vocab(jnp.asarray(d2t), cfg.vocab_size))}

  @classmethod
  def extra_tensor_names(cls, settings: DrafterConfig) -> set[str]:
    return {"t2d"} if settings.draft_vocab_size else set()

  @classmethod
  def check_loaded(cls, settings: DrafterConfig, params: dict, extras: dict,
                   cfg: ModelConfig) -> None:
    if not settings.draft_vocab_size:
      return
    d2t = params[DRAFT_TO_POLICY]
    if (np.any(d2t < 0) or np.any(d2t >= cfg.vocab_size) or np.any(np.diff(d2t) <= 0)
        or not np.array_equal(extras["t2d"], cls.extra_tensors(settings, params, cfg)["t2d"])):
      raise ValueError(f"its d2t and t2d do not describe one draft vocabulary of increasing "
                       f"policy ids below {cfg.vocab_size}")

  @classmethod
  def export_config(cls, settings: DrafterConfig) -> dict:
    return {"draft_vocab_size": settings.draft_vocab_size} if settings.draft_vocab_size else {}

  @classmethod
  def settings_from_saved(cls, saved: dict) -> DrafterConfig:
    """Exports from before `feature_layers` counted the fused layers (`fused_features`)
    without naming them; a count of 0 reads as ()."""
    saved = dict(saved)
    count = saved.pop("fused_features", 0)
    if count:
      raise ValueError(f"its config.json counts fused_features={count} without naming the "
                       f"policy layers; replace it with \"feature_layers\": [...], the policy "
                       f"layers it was trained on (drafter.eagle.feature_layers of its run)")
    return super().settings_from_saved(saved)

  def _forward(self, policy: Policy, tokens, features, attn, cache=None, earlier_kv=None):
    return drafter_forward(self.params, policy.params, tokens, features, attn, policy.cfg,
                           self.settings, cache=cache, earlier_kv=earlier_kv)
