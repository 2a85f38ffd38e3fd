"""The target distribution q that both plain decoding and speculative decoding sample from.

Speculative decoding is exact when it draws from the same q as plain decoding, so both go
through `target_probs`: temperature, then top-k, then top-p (nucleus), renormalised.
Temperature 0 is greedy: q is one-hot at the argmax.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


def target_probs(logits: jax.Array, sp: SamplingParams) -> jax.Array:
  """float32 logits [..., V] -> probabilities q [..., V] (float32, rows sum to 1)."""
  logits = logits.astype(jnp.float32)
  if sp.greedy:
    return jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  logits = logits / sp.temperature
  if sp.top_k:
    kth = jax.lax.top_k(logits, sp.top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  if sp.top_p < 1.0:
    # Keep the smallest prefix of the sorted distribution whose mass reaches top_p
    # (the token that crosses it included).
    order = jnp.argsort(-probs, axis=-1)
    sorted_probs = jnp.take_along_axis(probs, order, axis=-1)
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = mass_before < sp.top_p
    keep = jnp.zeros_like(keep_sorted).at[
        tuple(jnp.indices(order.shape)[:-1]) + (order,)].set(keep_sorted)
    probs = jnp.where(keep, probs, 0.0)
    probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
  return probs


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
  """One token per row from probs [..., V] by inverse CDF; [...] int32.

  Zero-probability tokens are never drawn (the search skips flat CDF steps).
  """
  u = jax.random.uniform(key, probs.shape[:-1] + (1,), jnp.float32)
  cdf = jnp.cumsum(probs, axis=-1)
  total = cdf[..., -1:]
  # First index whose cumulative mass exceeds u * total (total guards rounding).
  idx = jnp.sum(cdf <= u * total, axis=-1)
  return jnp.minimum(idx, probs.shape[-1] - 1).astype(jnp.int32)
