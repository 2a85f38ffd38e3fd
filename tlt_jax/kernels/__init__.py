"""Attention kernels: one contract (see `reference.py`), several implementations."""

import jax

from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import MAX_TREE_TOKENS, prefix_tree_attention_pallas

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def prefix_tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, *,
                          impl: str = "auto", scale: float | None = None):
  """Dispatches prefix + tree attention to an implementation; see the reference for shapes.

  impl:
    "auto": the compiled Pallas kernel on GPU when T <= 64, the jnp reference otherwise
      (CPU production runs, or trees too wide for the kernel's two-word ancestor bitmask).
    "reference": the jnp reference.
    "pallas": the compiled Pallas kernel (Triton backend; needs a GPU to run).
    "pallas_interpret": the same kernel under the Pallas interpreter (slow; CPU tests).
  Both Pallas choices fall back to the reference when T > 64, or when the uncached block has
  more keys than queries (N > T, the drafter's tree expansion).
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; allowed: {ATTENTION_IMPLS}")
  args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask)
  fits_kernel = q.shape[1] <= MAX_TREE_TOKENS and k_new.shape[1] == q.shape[1]
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" and fits_kernel else "reference"
  if impl == "reference" or not fits_kernel:
    return prefix_tree_attention_reference(*args, scale=scale)
  return prefix_tree_attention_pallas(*args, scale=scale, interpret=impl == "pallas_interpret")
