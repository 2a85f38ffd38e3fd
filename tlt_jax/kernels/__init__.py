"""Attention kernels: one contract (see `reference.py`), several implementations."""

from tlt_jax.kernels.reference import prefix_tree_attention_reference

ATTENTION_IMPLS = ("auto", "reference")


def prefix_tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, *,
                          impl: str = "auto", scale: float | None = None):
  """Dispatches prefix + tree attention to an implementation; see the reference for shapes."""
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; allowed: {ATTENTION_IMPLS}")
  return prefix_tree_attention_reference(q, k_cache, v_cache, cache_lengths, k_new, v_new,
                                         new_mask, scale=scale)
