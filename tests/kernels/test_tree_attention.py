"""Pallas tree attention (interpret mode) against the jnp reference, plus GPU lowering.

Interpret mode is slow on CPU, so shapes are tiny and each case is a distinct, deliberate mix of
tree shape, ragged prefix lengths, GQA ratio, T and dtype.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.kernels import ATTENTION_IMPLS, prefix_tree_attention
from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import (pack_ancestor_bits,
                                                   prefix_tree_attention_pallas)


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
  """parents [T] (parent index < own index, -1 for a root) -> [T, T] ancestor-or-self mask."""
  t = len(parents)
  mask = np.eye(t, dtype=bool)
  for i in range(t):
    if parents[i] >= 0:
      mask[i] |= mask[parents[i]]
  return mask


def tree_parents(kind: str, t: int, rng: np.random.Generator) -> np.ndarray:
  if kind == "chain":  # a single draft path; also the causal prefill mask
    return np.arange(t) - 1
  if kind == "star":  # one root, every other token a child of it
    return np.where(np.arange(t) == 0, -1, 0)
  if kind == "random":
    return np.array([rng.integers(-1, i) if i else -1 for i in range(t)])
  raise ValueError(kind)


def make_inputs(*, b, t, h, kvh, d, s, lengths, tree, dtype, seed=0):
  rng = np.random.default_rng(seed)
  keys = jax.random.split(jax.random.key(seed), 5)
  q = jax.random.normal(keys[0], (b, t, h, d), jnp.float32).astype(dtype)
  k_cache = jax.random.normal(keys[1], (b, kvh, s, d), jnp.float32).astype(dtype)
  v_cache = jax.random.normal(keys[2], (b, kvh, s, d), jnp.float32).astype(dtype)
  k_new = jax.random.normal(keys[3], (b, t, kvh, d), jnp.float32).astype(dtype)
  v_new = jax.random.normal(keys[4], (b, t, kvh, d), jnp.float32).astype(dtype)
  mask = np.stack([ancestor_mask(tree_parents(tree, t, rng)) for _ in range(b)])
  return (q, k_cache, v_cache, jnp.asarray(lengths, jnp.int32), k_new, v_new,
          jnp.asarray(mask))


def assert_matches_reference(args, out, dtype):
  ref = prefix_tree_attention_reference(*args)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert np.isfinite(np.asarray(out, np.float32)).all()
  tol = 1e-5 if dtype == jnp.float32 else 3e-2
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                             rtol=tol, atol=tol)


# (tree, T, H, KVH, D, S, lengths, dtype, block_k). block_k=16 gives several prefix blocks and
# lengths that end inside a block; S=80 with block_k=32 exercises the padded-cache path.
CASES = [
    ("chain", 1, 2, 2, 16, 24, [0, 5, 17], jnp.float32, 16),  # decode, MHA, empty prefix
    ("chain", 8, 4, 2, 32, 48, [33, 0], jnp.float32, 16),  # causal prefill block, GQA 2
    ("star", 16, 8, 2, 16, 64, [64, 1, 47], jnp.float32, 16),  # GQA 4, full-cache row
    ("random", 48, 4, 2, 32, 80, [80, 29], jnp.float32, 32),  # T padded to 64, two words
    ("random", 8, 6, 2, 16, 40, [23, 40], jnp.float32, 16),  # GQA 3: rows not a power of 2
    ("random", 16, 8, 2, 32, 48, [50, 0], jnp.bfloat16, 16),  # bf16, length > S clamps
    ("chain", 48, 2, 2, 16, 32, [31, 16], jnp.bfloat16, 16),  # bf16, T = 48
]


@pytest.mark.parametrize("tree,t,h,kvh,d,s,lengths,dtype,block_k", CASES,
                         ids=[f"{c[0]}-T{c[1]}-G{c[2] // c[3]}-{jnp.dtype(c[7]).name}"
                              for c in CASES])
def test_interpret_kernel_matches_reference(tree, t, h, kvh, d, s, lengths, dtype, block_k):
  args = make_inputs(b=len(lengths), t=t, h=h, kvh=kvh, d=d, s=s, lengths=lengths, tree=tree,
                     dtype=dtype)
  out = prefix_tree_attention_pallas(*args, block_k=block_k, interpret=True)
  assert_matches_reference(args, out, dtype)


def test_row_blocks_split_a_large_group():
  # 16 queries x 4 heads = 64 rows in blocks of 16: four programs per (b, kv head).
  args = make_inputs(b=2, t=16, h=4, kvh=1, d=16, s=32, lengths=[19, 32], tree="random",
                     dtype=jnp.float32, seed=3)
  out = prefix_tree_attention_pallas(*args, block_k=16, block_rows=16, interpret=True)
  assert_matches_reference(args, out, jnp.float32)


def test_fully_masked_rows_give_zeros_not_nan():
  q, kc, vc, _, kn, vn, mask = make_inputs(b=2, t=8, h=4, kvh=2, d=16, s=32, lengths=[0, 0],
                                           tree="random", dtype=jnp.float32, seed=1)
  mask = mask.at[:, 5:].set(False)  # padding queries 5..7
  lengths = jnp.array([0, 20], jnp.int32)
  # Large scores would overflow a softmax without max subtraction.
  q = q * 30.0
  out = prefix_tree_attention_pallas(q, kc, vc, lengths, kn, vn, mask, block_k=16,
                                     interpret=True)
  assert np.isfinite(np.asarray(out)).all()
  # No prefix and no tree token: exact zeros. With a prefix, padding rows still see it.
  np.testing.assert_array_equal(np.asarray(out[0, 5:]), 0.0)
  assert np.abs(np.asarray(out[1, 5:])).min() > 0.0
  assert np.abs(np.asarray(out[0, :5])).max() > 0.0
  assert_matches_reference((q, kc, vc, lengths, kn, vn, mask), out, jnp.float32)


def test_pack_ancestor_bits():
  mask = np.zeros((1, 2, 48), bool)
  mask[0, 0, [0, 2]] = True
  mask[0, 1, [1, 31, 32, 40]] = True
  bits = np.asarray(pack_ancestor_bits(jnp.asarray(mask), 2))
  assert bits.dtype == np.uint32 and bits.shape == (1, 2, 2)
  np.testing.assert_array_equal(bits[0], [[0b101, 0], [(1 << 31) | 2, 1 | (1 << 8)]])


def test_dispatcher_routes_and_falls_back():
  args = make_inputs(b=2, t=8, h=4, kvh=2, d=16, s=24, lengths=[9, 24], tree="random",
                     dtype=jnp.float32, seed=2)
  ref = prefix_tree_attention_reference(*args)
  assert jax.default_backend() == "cpu"
  np.testing.assert_array_equal(prefix_tree_attention(*args, impl="auto"), ref)
  assert_matches_reference(args, prefix_tree_attention(*args, impl="pallas_interpret"),
                           jnp.float32)
  # T > 64 does not fit the two-word bitmask: the kernel refuses, the dispatcher falls back.
  wide = make_inputs(b=1, t=72, h=2, kvh=1, d=16, s=8, lengths=[3], tree="star",
                     dtype=jnp.float32)
  with pytest.raises(ValueError, match="exceeds"):
    prefix_tree_attention_pallas(*wide, interpret=True)
  np.testing.assert_array_equal(prefix_tree_attention(*wide, impl="pallas_interpret"),
                                prefix_tree_attention_reference(*wide))
  with pytest.raises(ValueError, match="allowed"):
    prefix_tree_attention(*args, impl="triton")
  assert set(ATTENTION_IMPLS) == {"auto", "reference", "pallas", "pallas_interpret"}


@pytest.mark.parametrize("dtype,t,h", [(jnp.bfloat16, 48, 6), (jnp.float32, 1, 8)])
def test_triton_lowering_for_cuda(dtype, t, h):
  """Lowers the compiled (non-interpret) kernel for CUDA on this CPU-only machine.

  Runs the whole Pallas -> Triton IR lowering, which rejects e.g. non power-of-two tiles or
  unsupported ops, so a change that breaks the GPU path fails here without a GPU.
  """
  args = make_inputs(b=2, t=t, h=h, kvh=2, d=80, s=200, lengths=[100, 7], tree="random",
                     dtype=dtype)
  fn = lambda *a: prefix_tree_attention_pallas(*a, num_warps=4, interpret=False)  # noqa: E731
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
  assert "num_warps = 4" in text
