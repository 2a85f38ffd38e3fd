"""Attention masks over a block of new tokens (the `new_mask` of the attention contract)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_causal_mask(segment_ids: jax.Array) -> jax.Array:
  """[B, T] segment ids (1, 2, ... per packed sample, 0 = padding) -> [B, T, T] bool mask:
  causal within a segment, never across segments; padding rows attend to nothing."""
  t = segment_ids.shape[1]
  same = segment_ids[:, :, None] == segment_ids[:, None, :]
  causal = jnp.tril(jnp.ones((t, t), bool))[None]
  return same & causal & (segment_ids[:, :, None] > 0)
