"""MTP heads (Medusa / multi-token-prediction style): several small heads over the policy's
last hidden state, each predicting one token further ahead; no KV cache, no state.

Head k (k = 0 .. num_heads - 1) reads the policy's final-norm feature f_{n-1} of the token
before the root and, with `use_token`, the root x_n's embedding (as DeepSeek's MTP modules
condition on the next token; Medusa reads the feature alone), and predicts x_{n+1+k}:

  u = [f_{n-1}; embed(x_n)]      h = u @ fc_k + b_k      h = h + SiLU(h @ res_k)
  logits_k = the policy's LM head (h)

fc_k starts as the identity on the feature and res_k at zero, so an untrained head reads
like the policy's own head (Medusa's initialisation). Drafting: the top-k tokens of head 0
under the root, then each of the best top-k beams extended by the top-k of the next head
(the heads do not read the drafted tokens, so every beam gets the same children, ranked by
cumulative log-probability): as many candidates as an EAGLE tree of the same shape, for one
pass of the heads instead of `depth` drafter passes. Levels deeper than num_heads draft
nothing.

Training (`loss`): at window slot t, reading (f_{t-1}, x_t) as drafting would, head k learns
the policy's next-token distribution at slot t + k, softmax(LM head(f_{t+k})), by soft
cross-entropy (reported as the KL divergence, 0 for a perfect head), weighted
drafter.train_step_decay ** k (slots whose target leaves their sample or the trained part are
left out).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafters.base import previous_features, register_drafter
from tlt_jax.drafters.base import (Candidates, DraftContext, TrainedDrafter,
                                   beam_tree_count)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import embed, lm_logits
from tlt_jax.models.params import ParamSpec
from tlt_jax.models.policy import Policy

if TYPE_CHECKING:  # the strategy module imports the drafter registry
  from tlt_jax.speculative.strategy import Strategy


# The most heads: each adds 3 E x E weights (a 4096-wide policy: 50M parameters a head), and
# an SD tree deeper than this accepts its last tokens too rarely to pay for drafting them.
MAX_HEADS = 16


@dataclasses.dataclass(frozen=True)
class MtpSettings:
  """num_heads: tokens predicted ahead of the root (the deepest useful draft depth);
  use_token: heads also read the root token's embedding. (Config section drafter.mtp.)"""
  num_heads: int = 4
  use_token: bool = True

  def __post_init__(self):
    if not 1 <= self.num_heads <= MAX_HEADS:
      raise ValueError(f"drafter.mtp.num_heads must be in [1, {MAX_HEADS}], got "
                       f"{self.num_heads}")


@register_drafter("mtp")
@flax.struct.dataclass
class MtpDrafter(TrainedDrafter):
  """params: {'head_k': {'fc': {'kernel' [in, E], 'bias' [E]}, 'res': {'kernel' [E, E]}}}
  (in = 2E with use_token, else E); settings: its MtpSettings."""
  Settings = MtpSettings
  loss_reads = ("train_step_decay",)
  hf_architecture = "TltJaxMtpHeads"
  params: dict
  settings: MtpSettings = flax.struct.field(pytree_node=False, default=MtpSettings())

  candidate_count = staticmethod(beam_tree_count)  # as many as EAGLE's tree

  @classmethod
  def check_strategies(cls, settings: MtpSettings, strategies: list, section: str,
                       where: str) -> list[str]:
    """Head k drafts at depth k + 1 only, so num_heads is at most the deepest strategy that
    drafts with MTP (heads past it would be trained and never draft)."""
    deepest = max((s.depth for s in strategies), default=None)
    if deepest is not None and settings.num_heads > deepest:
      raise ValueError(f"{section}.num_heads={settings.num_heads} is more heads than the "
                       f"deepest strategy that drafts with MTP drafts ({deepest} tokens, in "
                       f"{where}): heads past depth {deepest} are trained and never draft; set "
                       f"{section}.num_heads={deepest}, or draft deeper with MTP")
    return []

  @classmethod
  def param_specs(cls, settings: MtpSettings, cfg: ModelConfig) -> dict:
    e = cfg.hidden_size
    fc_in = 2 * e if settings.use_token else e
    return {f"head_{k}": {"fc": {"kernel": ParamSpec((fc_in, e), ("embed_in", "embed")),
                                 "bias": ParamSpec((e,), ("embed",), "zeros")},
                          "res": {"kernel": ParamSpec((e, e), ("embed_in", "embed"), "zeros")}}
            for k in range(settings.num_heads)}

  @classmethod
  def init_params(cls, settings: MtpSettings, cfg: ModelConfig, rng: jax.Array) -> dict:
    """Medusa's start: fc the identity on the feature (zero on the token), res zero."""
    params = super().init_params(settings, cfg, rng)
    shape = params["head_0"]["fc"]["kernel"].shape
    # One array per head: an update donates each leaf, and a shared buffer cannot be donated.
    return {name: {**head, "fc": {**head["fc"], "kernel": jnp.eye(*shape,
                                                                  dtype=cfg.jnp_param_dtype)}}
            for name, head in params.items()}

  @classmethod
  def example(cls, cfg: ModelConfig, seed: int = 0,
              settings: MtpSettings | None = None) -> MtpDrafter:
    """Random weights everywhere: Medusa's start (`init_params`) drafts what the policy's head
    reads off the feature alone, so noise makes its drafts sometimes right and sometimes
    wrong."""
    settings = cls.Settings() if settings is None else settings
    params = cls.init_params(settings, cfg, jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1000), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return cls(params=jax.tree.unflatten(treedef, noisy), settings=settings)

  def heads(self, policy: Policy, features: jax.Array, tokens: jax.Array) -> jax.Array:
    """Every head's logits: features [..., F] (the policy's, final hidden state first) and
    the tokens [...] they precede -> [..., num_heads, V] float32."""
    cfg = policy.cfg
    dt = cfg.jnp_dtype
    u = features[..., :cfg.hidden_size].astype(dt)
    if self.settings.use_token:
      u = jnp.concatenate([u, embed(policy.params, tokens, cfg)], axis=-1)
    out = []
    for k in range(self.settings.num_heads):
      p = self.params[f"head_{k}"]
      h = u @ p["fc"]["kernel"].astype(dt) + p["fc"]["bias"].astype(dt)
      h = h + jax.nn.silu(h @ p["res"]["kernel"].astype(dt))
      out.append(lm_logits(policy.params, h, cfg))
    return jnp.stack(out, axis=-2)

  def propose(self, policy: Policy, state, ctx: DraftContext, strategy: Strategy,
              limits: jax.Array | None = None) -> tuple[Candidates, None]:
    """Beams over the heads (see the module docstring); scores are cumulative
    log-probabilities (<= 0), so a parent always outranks its children."""
    k, b = strategy.topk, ctx.root.shape[0]
    logp = jax.nn.log_softmax(self.heads(policy, ctx.features, ctx.root), axis=-1)  # [B, H, V]
    lp, tok = jax.lax.top_k(logp[:, 0], k)
    cand_tokens, cand_scores, cand_parents = [tok], [lp], [jnp.full((b, k), -1, jnp.int32)]
    beam_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
    beam_scores, next_id = lp, k
    for depth in range(1, strategy.depth):
      if depth < self.settings.num_heads:
        lp, tok = jax.lax.top_k(logp[:, depth], k)
      else:  # deeper than the heads reach: nothing to draft
        lp, tok = jnp.full((b, k), -jnp.inf), jnp.zeros((b, k), jnp.int32)
      scores = (beam_scores[:, :, None] + lp[:, None, :]).reshape(b, k * k)
      if limits is not None:
        scores = jnp.where(depth < limits[0], scores, -jnp.inf)
      cand_tokens.append(jnp.broadcast_to(tok[:, None, :], (b, k, k)).reshape(b, k * k))
      cand_scores.append(scores)
      cand_parents.append(jnp.repeat(beam_ids, k, axis=1))
      beam_scores, pick = jax.lax.top_k(scores, k)
      beam_ids = next_id + pick
      next_id += k * k
    return Candidates(tokens=jnp.concatenate(cand_tokens, 1).astype(jnp.int32),
                      parents=jnp.concatenate(cand_parents, 1).astype(jnp.int32),
                      scores=jnp.concatenate(cand_scores, 1)), state

  def loss(self, policy: Policy, batch, train_step_decay: float = 0.8):
    """KL divergence of every head from the policy's distribution it predicts (the soft
    cross-entropy's gradient; see the module docstring) -> (scalar, {'loss', 'ce_loss'
    (head 0's), 'top1' (head 0's argmax is the policy's), 'top1_ahead' (the last head's),
    'tokens'})."""
    cfg = policy.cfg
    params = jax.lax.stop_gradient(policy.params)
    policy = Policy(params, cfg)
    feats = batch.features[..., :cfg.hidden_size]
    target = jax.lax.stop_gradient(lm_logits(params, feats, cfg))               # [B, W, V]
    logits = self.heads(policy, previous_features(feats, batch.segment_ids), batch.tokens)
    seg, w = batch.segment_ids, batch.tokens.shape[1]
    total, weights, per_head = 0.0, 0.0, []
    for k in range(self.settings.num_heads):
      # Head k at slot t predicts slot t + k's distribution: in the same sample, trained.
      ahead = lambda x, k=k: jnp.concatenate(  # noqa: E731
          [x[:, k:], jnp.zeros_like(x[:, :k])], axis=1)
      mask = (ahead(batch.loss_mask) & (ahead(seg) == seg) & (jnp.arange(w) < w - k)[None]
              ).astype(jnp.float32)
      n = jnp.maximum(mask.sum(), 1.0)
      t = jax.nn.log_softmax(ahead(target), -1)
      # KL(policy || head): the soft cross-entropy less the target's entropy (the same
      # gradient), so that 0 is a perfect head whatever the policy's entropy.
      ce = jnp.sum(jnp.exp(t) * (t - jax.nn.log_softmax(logits[:, :, k], -1)), -1)
      top1 = jnp.sum((jnp.argmax(logits[:, :, k], -1) == jnp.argmax(t, -1)) * mask) / n
      w_k = train_step_decay ** k
      total, weights = total + w_k * jnp.sum(ce * mask) / n, weights + w_k
      per_head.append((jnp.sum(ce * mask) / n, top1, mask.sum()))
    loss = total / weights
    return loss, {"loss": loss, "ce_loss": per_head[0][0], "top1": per_head[0][1],
                  "top1_ahead": per_head[-1][1], "tokens": per_head[0][2]}
