"""Attention kernels: one contract (see `reference.py`), several implementations."""

import functools

import jax
import jax.numpy as jnp

from tlt_jax.kernels import crossover
from tlt_jax.kernels.per_shard import per_shard
from tlt_jax.kernels.reference import prefix_tree_attention_reference, query_chunked_attention
from tlt_jax.kernels.tree_attention_pallas import MAX_TREE_TOKENS, prefix_tree_attention_pallas

ATTENTION_IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def auto_uses_kernel(backend: str, device_kind: str, dtype: str, batch: int, prefix_len: int,
                     tree_size: int, fits_kernel: bool, tables=()) -> bool:
  """The `impl="auto"` decision as a pure function of the call's static facts.

  Off GPU, or when the shape does not fit the kernel: never. On GPU: the measured crossover
  table's verdict for (device_kind, dtype, B, S, T) when one exists (see `crossover`); without
  one, the fallback rule: always (the kernel whenever T <= 64 and N == T).
  """
  if backend != "gpu" or not fits_kernel:
    return False
  wins = crossover.kernel_wins(tables, device_kind, dtype, batch, prefix_len, tree_size)
  return True if wins is None else wins


def prefix_tree_attention(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, *,
                          impl: str = "auto", scale: float | None = None,
                          query_chunk: int = 0):
  """Dispatches prefix + tree attention to an implementation; see the reference for shapes.

  impl:
    "auto": on GPU, the compiled Pallas kernel where the measured crossover table
      (`crossover.DEFAULT_TABLE_PATH`, written by `experiments/bench_tree_attention.py
      --write-crossovers`) says it beats the reference for this device kind, dtype and
      (B, S, T) bucket. Where no table exists for the device kind and dtype -- today everywhere,
      none is shipped -- or it has no entry for the bucket, the fallback rule applies: the
      kernel whenever T <= 64 and N == T. The jnp reference otherwise (CPU production runs, or
      trees too wide for the kernel's two-word ancestor bitmask).
    "reference": the jnp reference.
    "pallas": the compiled Pallas kernel (Triton backend; needs a GPU to run).
    "pallas_interpret": the same kernel under the Pallas interpreter (slow; CPU tests).
  Both Pallas choices fall back to the reference when T > 64, or when the uncached block has
  more keys than queries (N > T, the drafter's tree expansion). On a mesh (a program traced
  under `jax.set_mesh`), they run per shard of rows and KV heads (`per_shard`).
  query_chunk: where the reference runs over more than this many queries (training rows,
    long prefills), it runs `query_chunk` queries at a time under rematerialisation
    (`query_chunked_attention`: the same result in a fraction of the memory); 0 = never.
  """
  if impl not in ATTENTION_IMPLS:
    raise ValueError(f"unknown attention impl {impl!r}; allowed: {ATTENTION_IMPLS}")
  args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask)
  fits_kernel = q.shape[1] <= MAX_TREE_TOKENS and k_new.shape[1] == q.shape[1]
  if impl == "auto":
    backend = jax.default_backend()
    use_kernel = backend == "gpu" and auto_uses_kernel(
        backend, jax.devices()[0].device_kind, jnp.dtype(q.dtype).name, q.shape[0],
        k_cache.shape[2], q.shape[1], fits_kernel, crossover.load_tables())
    impl = "pallas" if use_kernel else "reference"
  if impl == "reference" or not fits_kernel:
    return query_chunked_attention(prefix_tree_attention_reference, *args, query_chunk,
                                   scale=scale)
  interpret = impl == "pallas_interpret"
  return per_shard(lambda *a: _kernel(*a, scale, interpret), *args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _kernel(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, scale, interpret):
  """The Pallas kernel, differentiable: it has no backward of its own, so its gradient is the
  reference's (the same function), recomputed from the inputs. Training forwards whose blocks
  fit the kernel (short drafter windows) take it on GPU under impl="auto"."""
  return prefix_tree_attention_pallas(q, k_cache, v_cache, cache_lengths, k_new, v_new,
                                      new_mask, scale=scale, interpret=interpret)


def _kernel_fwd(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, scale, interpret):
  out = _kernel(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask, scale, interpret)
  return out, (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask)


def _kernel_bwd(scale, interpret, saved, grad_out):
  q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask = saved
  _, vjp = jax.vjp(lambda q, kc, vc, kn, vn: prefix_tree_attention_reference(
      q, kc, vc, cache_lengths, kn, vn, new_mask, scale=scale), q, k_cache, v_cache, k_new, v_new)
  dq, dkc, dvc, dkn, dvn = vjp(grad_out)
  return dq, dkc, dvc, None, dkn, dvn, None


_kernel.defvjp(_kernel_fwd, _kernel_bwd)
