"""The SFT update as pure pieces: the loss on response tokens of packed rows, the optimizer
and the jitted step (the job, with its files and flags, is tlt_jax.sft)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
import optax

from tlt_jax.components import sft_adamw
from tlt_jax.models import ModelConfig, forward
from tlt_jax.models.attention_inputs import packed_inputs
from tlt_jax.optim import make_adamw


def make_optimizer(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
  """AdamW with linear warm-up and cosine decay (`sft_adamw`), weight decay on matrices only."""
  return make_adamw(sft_adamw(config), decay_mask=_decay_mask)


def _decay_mask(params: dict) -> dict:
  """Weight decay on matrices (embeddings, kernels), not on norm weights or biases."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  treedef = jax.tree.structure(params)
  keep = [not any(getattr(k, "key", None) in ("bias", "weight") for k in path)
          for path, _ in flat]
  return jax.tree.unflatten(treedef, keep)


def sft_loss(params: dict, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
  """Mean next-token cross-entropy over response targets of a packed batch.

  Args:
    batch: arrays [R, S] from `tlt_jax.rl.packing` (tokens, targets, loss_mask, positions,
      segment_ids).
  Returns:
    (loss, number of target tokens), float32 scalars.
  """
  # No cache: packed rows attend only within themselves through the segment mask.
  attn = packed_inputs(batch["segment_ids"], batch["positions"])
  logits, _, _, _ = forward(params, batch["tokens"], attn, cfg)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  weight = batch["loss_mask"]
  count = jnp.sum(weight)
  return jnp.sum(ce * weight) / jnp.maximum(count, 1.0), count


def make_train_step(cfg: ModelConfig, tx: optax.GradientTransformation, param_sharding,
                    opt_sharding):
  """The jitted update: (params, opt_state, batch) -> (params, opt_state, metrics); the old
  params and optimizer state are donated."""

  @functools.partial(jax.jit, donate_argnums=(0, 1),
                     out_shardings=(param_sharding, opt_sharding, None))
  def train_step(params, opt_state, batch):
    (loss, count), grads = jax.value_and_grad(sft_loss, has_aux=True)(params, batch, cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    grad_norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "target_tokens": count}

  return train_step
