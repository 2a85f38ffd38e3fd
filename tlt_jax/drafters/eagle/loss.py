"""EAGLE-aligned drafter loss on packed windows of policy features.

A window row holds several samples back to back. Slot s of a sample carries token x_s and the
policy's feature f_s of that token (what the policy computed when it read x_s). The drafter
reads (x_s, f_{s-1}) -- the previous feature of the same sample, zeros at a sample's start --
and is trained to predict f_s (SmoothL1) and the policy's next-token distribution
softmax(lm_head(f_s)) (soft cross-entropy), exactly the pairing it sees when drafting; with
`train_depth` > 1 the later draft steps are unrolled too (training-time test).
Segment ids keep samples apart: attention never crosses them and positions restart at 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tlt_jax.drafters.base import Windows, previous_features
from tlt_jax.drafters.eagle.draft_vocab import in_draft_vocab
from tlt_jax.drafters.eagle.network import (DRAFT_TO_POLICY, DrafterConfig, drafter_forward,
                                            policy_token_ids)
from tlt_jax.models.attention_inputs import unrolled_inputs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import lm_logits


def unrolled_forward(drafter_params: dict, policy_params: dict, batch: Windows,
                     cfg: ModelConfig, dcfg: DrafterConfig, steps: int
                     ) -> list[tuple[jax.Array, jax.Array]]:
  """The drafter's predictions over packed windows for draft steps 1 .. steps.

  Step 1 reads (x_t, f_{t-1}) with the policy's features. Step k > 1 reads, at slot t, the true
  token x_t with the feature the drafter predicted at slot t - 1 in step k - 1, and attends as
  the depth-(k - 1) node of a draft tree rooted at slot t - k + 1 (`unrolled_inputs`): slot t
  of step k is what drafting computes k - 1 steps past that root when every earlier draft was
  the true token. Slots whose root lies before their sample start hold garbage.
  Returns per step (features_pred [B, W, E], logits [B, W, V or r] float32, r with a reduced
  draft vocabulary).
  """
  features = previous_features(batch.features, batch.segment_ids)
  earlier, out = None, []
  for k in range(steps):
    pred, logits, k_new, v_new = drafter_forward(
        drafter_params, policy_params, batch.tokens, features,
        unrolled_inputs(batch.segment_ids, batch.positions, k), cfg, dcfg, earlier_kv=earlier)
    earlier = (k_new, v_new) if earlier is None else (
        jnp.concatenate([earlier[0], k_new], axis=2), jnp.concatenate([earlier[1], v_new], 2))
    out.append((pred, logits))
    features = previous_features(pred, batch.segment_ids)
  return out


def drafter_loss(drafter_params: dict, policy_params: dict, batch: Windows, cfg: ModelConfig,
                 dcfg: DrafterConfig, ce_weight: float = 0.1, train_depth: int = 1,
                 train_step_decay: float = 0.8):
  """Scalar loss and metrics {'loss', 'feature_loss', 'ce_loss', 'top1', 'top1_ahead',
  'tokens'}.

  train_depth: K draft steps unrolled per slot (training-time test, as EAGLE-3 trains). Step 1
    reads the policy's features; step k > 1 reads, at slot t, the true token x_t with the
    feature the drafter itself predicted at slot t - 1 in step k - 1, and attends as the
    depth-(k - 1) node of a draft tree rooted at slot t - k + 1 does (`unrolled_inputs`). So
    from the second draft step on, the drafter trains on what it is fed when drafting (its own
    E-wide predictions, which bypass a fused drafter's `fuse` projection). Step k's loss covers
    the trained slots whose chain stays inside their sample and weighs train_step_decay ** (k - 1);
    the total is the weighted mean, so K = 1 is the single-step loss.
  top1: how often the drafter's argmax equals the policy's argmax at step 1 (a proxy for
    acceptance); top1_ahead: the same at step K.
  With a reduced draft vocabulary (EAGLE-3, FR-Spec) the cross-entropy's target is the
  policy's distribution restricted to the draft vocabulary, and slots whose policy argmax lies
  outside it (no draft can be accepted there) are left out of the loss (and of 'tokens'),
  not of top1: there they are misses.
  The policy params are only read (embedding, LM head) and get no gradient.
  """
  policy_params = jax.lax.stop_gradient(policy_params)
  target = batch.features[..., :cfg.hidden_size].astype(jnp.float32)
  target_logits = jax.lax.stop_gradient(lm_logits(policy_params, target, cfg))
  target_top = jnp.argmax(target_logits, -1)
  loss_mask = batch.loss_mask
  if dcfg.draft_vocab_size:
    d2t = drafter_params[DRAFT_TO_POLICY]
    loss_mask = loss_mask & in_draft_vocab(d2t, cfg.vocab_size)[target_top]
    target_logits = jnp.take(target_logits, d2t, axis=-1)
  soft = jax.nn.softmax(target_logits, axis=-1)
  seg = batch.segment_ids
  total, weights, per_step = 0.0, 0.0, []
  for k, (pred, logits) in enumerate(unrolled_forward(drafter_params, policy_params, batch, cfg,
                                                      dcfg, train_depth)):
    # Slot t's chain is rooted at t - k: it must lie in the same sample.
    rooted = jnp.concatenate([jnp.zeros_like(seg[:, :k]), seg[:, :seg.shape[1] - k]], 1) == seg
    mask = (loss_mask & rooted).astype(jnp.float32)
    n = jnp.maximum(mask.sum(), 1.0)
    feature_loss = jnp.sum(smooth_l1(pred.astype(jnp.float32), target).mean(-1) * mask) / n
    ce = -jnp.sum(soft * jax.nn.log_softmax(logits, axis=-1), axis=-1)
    ce_loss = jnp.sum(ce * mask) / n
    drafted = policy_token_ids(drafter_params, jnp.argmax(logits, -1))
    # top1 counts every trained slot: one outside the draft vocabulary is a miss, not skipped.
    scored = (batch.loss_mask & rooted).astype(jnp.float32)
    top1 = jnp.sum((drafted == target_top) * scored) / jnp.maximum(scored.sum(), 1.0)
    w = train_step_decay ** k
    total, weights = total + w * (feature_loss + ce_weight * ce_loss), weights + w
    per_step.append((feature_loss, ce_loss, top1, mask.sum()))
  loss = total / weights
  feature_loss, ce_loss, top1, tokens = per_step[0]
  return loss, {"loss": loss, "feature_loss": feature_loss, "ce_loss": ce_loss, "top1": top1,
                "top1_ahead": per_step[-1][2], "tokens": tokens}


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Elementwise SmoothL1 (Huber with delta 1), as EAGLE uses for features."""
  diff = jnp.abs(pred - target)
  return jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5)
