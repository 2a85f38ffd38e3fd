"""EAGLE-aligned drafter loss on packed windows of policy features.

A window row holds several samples back to back. Slot s of a sample carries token x_s and the
policy's feature f_s of that token (what the policy computed when it read x_s). The drafter
reads (x_s, f_{s-1}) -- the previous feature of the same sample, zeros at a sample's start --
and is trained to predict f_s (SmoothL1) and the policy's next-token distribution
softmax(lm_head(f_s)) (soft cross-entropy), exactly the pairing it sees when drafting.
Segment ids keep samples apart: attention never crosses them and positions restart at 0.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.models.attention_inputs import packed_inputs
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import lm_logits
from tlt_jax.models.drafter import DrafterConfig, drafter_forward


@flax.struct.dataclass
class Windows:
  """A batch of packed windows, all [B, W] except features [B, W, F].

  segment_ids: 1, 2, ... per sample within a row, 0 for padding.
  positions: position of each token within its sample (restarts at 0).
  loss_mask: slots whose prediction is trained (those predicting response tokens).
  """
  tokens: jax.Array
  features: jax.Array
  segment_ids: jax.Array
  positions: jax.Array
  loss_mask: jax.Array


def previous_features(features: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """f_{s-1} for every slot, zeros where slot s starts a segment: [B, W, F]."""
  prev = jnp.concatenate([jnp.zeros_like(features[:, :1]), features[:, :-1]], axis=1)
  starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
  return jnp.where(starts[..., None], 0.0, prev)


def drafter_loss(drafter_params: dict, policy_params: dict, batch: Windows, cfg: ModelConfig,
                 dcfg: DrafterConfig, ce_weight: float = 0.1):
  """Scalar loss and metrics {'loss', 'feature_loss', 'ce_loss', 'top1', 'tokens'}.

  top1: how often the drafter's argmax equals the policy's argmax (a proxy for acceptance).
  The policy params are only read (embedding, LM head) and get no gradient.
  """
  policy_params = jax.lax.stop_gradient(policy_params)
  pred, logits, _, _ = drafter_forward(
      drafter_params, policy_params, batch.tokens,
      previous_features(batch.features, batch.segment_ids),
      packed_inputs(batch.segment_ids, batch.positions), cfg, dcfg)
  target = batch.features[..., :cfg.hidden_size].astype(jnp.float32)
  target_logits = jax.lax.stop_gradient(lm_logits(policy_params, target, cfg))
  mask = batch.loss_mask.astype(jnp.float32)
  n = jnp.maximum(mask.sum(), 1.0)
  feature_loss = jnp.sum(smooth_l1(pred.astype(jnp.float32), target).mean(-1) * mask) / n
  soft = jax.nn.softmax(target_logits, axis=-1)
  ce = -jnp.sum(soft * jax.nn.log_softmax(logits, axis=-1), axis=-1)
  ce_loss = jnp.sum(ce * mask) / n
  top1 = jnp.sum((jnp.argmax(logits, -1) == jnp.argmax(target_logits, -1)) * mask) / n
  loss = feature_loss + ce_weight * ce_loss
  return loss, {"loss": loss, "feature_loss": feature_loss, "ce_loss": ce_loss, "top1": top1,
                "tokens": mask.sum()}


def smooth_l1(pred: jax.Array, target: jax.Array) -> jax.Array:
  """Elementwise SmoothL1 (Huber with delta 1), as EAGLE uses for features."""
  diff = jnp.abs(pred - target)
  return jnp.where(diff < 1.0, 0.5 * diff * diff, diff - 0.5)
