"""Pallas tree attention (interpret mode) against the jnp reference, plus GPU lowering.

Interpret mode is slow on CPU, so shapes are tiny and each case is a distinct, deliberate mix of
tree shape, ragged prefix lengths, GQA ratio, T and dtype.
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.budget import abstract_gpu
from tlt_jax.kernels import ATTENTION_IMPLS, auto_uses_kernel, crossover, prefix_tree_attention
from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import (choose_k_splits, kernel_plan,
                                                   pack_ancestor_bits,
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


# (tree, T, H, KVH, D, S, lengths, dtype, block_k, k_splits). block_k=16 gives several prefix
# blocks and lengths that end inside a block; S=80 with block_k=32 exercises the padded-cache
# path. k_splits=1 is the unsplit kernel (output normalised in the kernel); the split cases also
# cover splits past a row's valid length (no prefix work), a last split holding only the tree,
# and a split count above the number of KV blocks (capped).
CASES = [
    ("chain", 1, 2, 2, 16, 24, [0, 5, 17], jnp.float32, 16, 1),  # decode, MHA, empty prefix
    ("chain", 8, 4, 2, 32, 48, [33, 0], jnp.float32, 16, 1),  # causal prefill block, GQA 2
    ("star", 16, 8, 2, 16, 64, [64, 1, 47], jnp.float32, 16, 1),  # GQA 4, full-cache row
    ("random", 48, 4, 2, 32, 80, [80, 29], jnp.float32, 32, 1),  # T padded to 64, two words
    ("random", 8, 6, 2, 16, 40, [23, 40], jnp.float32, 16, 1),  # GQA 3: rows not a power of 2
    ("random", 16, 8, 2, 32, 48, [50, 0], jnp.bfloat16, 16, 1),  # bf16, length > S clamps
    ("chain", 48, 2, 2, 16, 32, [31, 16], jnp.bfloat16, 16, 1),  # bf16, T = 48
    # 8 blocks in 5 splits: 2 per split for S, so the last split has only the tree; rows of
    # length 0 and 3 leave 5 and 4 splits entirely masked.
    ("chain", 1, 7, 1, 16, 128, [0, 3, 128, 40], jnp.float32, 16, 5),  # decode, GQA 7
    ("random", 64, 2, 2, 16, 64, [64, 10], jnp.float32, 16, 3),  # T = 64, both words full
    ("star", 16, 8, 2, 16, 80, [80, 1, 47], jnp.float32, 32, 4),  # GQA 4, padded, 4 -> 3
    ("random", 8, 6, 2, 16, 40, [23, 40], jnp.float32, 16, 2),  # GQA 3
    ("random", 16, 8, 2, 32, 48, [50, 0], jnp.bfloat16, 16, 3),  # bf16, clamp, empty row
    ("chain", 48, 2, 2, 16, 32, [31, 16], jnp.bfloat16, 16, 2),  # bf16, T = 48
]


@pytest.mark.parametrize("tree,t,h,kvh,d,s,lengths,dtype,block_k,k_splits", CASES,
                         ids=[f"{c[0]}-T{c[1]}-G{c[2] // c[3]}-{jnp.dtype(c[7]).name}-K{c[9]}"
                              for c in CASES])
def test_interpret_kernel_matches_reference(tree, t, h, kvh, d, s, lengths, dtype, block_k,
                                            k_splits):
  args = make_inputs(b=len(lengths), t=t, h=h, kvh=kvh, d=d, s=s, lengths=lengths, tree=tree,
                     dtype=dtype)
  out = prefix_tree_attention_pallas(*args, block_k=block_k, k_splits=k_splits, interpret=True)
  assert_matches_reference(args, out, dtype)


def test_row_blocks_split_a_large_group():
  # 16 queries x 4 heads = 64 rows in blocks of 16: four programs per (b, kv head).
  args = make_inputs(b=2, t=16, h=4, kvh=1, d=16, s=32, lengths=[19, 32], tree="random",
                     dtype=jnp.float32, seed=3)
  out = prefix_tree_attention_pallas(*args, block_k=16, block_rows=16, interpret=True)
  assert_matches_reference(args, out, jnp.float32)


@pytest.mark.parametrize("k_splits", [1, 2])
def test_fully_masked_rows_give_zeros_not_nan(k_splits):
  q, kc, vc, _, kn, vn, mask = make_inputs(b=2, t=8, h=4, kvh=2, d=16, s=32, lengths=[0, 0],
                                           tree="random", dtype=jnp.float32, seed=1)
  mask = mask.at[:, 5:].set(False)  # padding queries 5..7
  lengths = jnp.array([0, 20], jnp.int32)
  # Large scores would overflow a softmax without max subtraction (in the kernel or the merge).
  q = q * 30.0
  out = prefix_tree_attention_pallas(q, kc, vc, lengths, kn, vn, mask, block_k=16,
                                     k_splits=k_splits, interpret=True)
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


# k_splits None takes the split rule, which splits this small grid (4 programs, 4 KV blocks);
# the last two rows are the Qwen2.5-7B decode and verify shapes (28 / 4 heads, D = 128).
@pytest.mark.parametrize("dtype,b,t,h,kvh,d,s,k_splits", [
    (jnp.bfloat16, 2, 48, 6, 2, 80, 200, 1), (jnp.float32, 2, 1, 8, 2, 80, 200, None),
    (jnp.bfloat16, 2, 48, 6, 2, 80, 200, 3), (jnp.bfloat16, 1, 1, 28, 4, 128, 16384, None),
    (jnp.bfloat16, 8, 48, 28, 4, 128, 8704, None)])
def test_triton_lowering_for_cuda(dtype, b, t, h, kvh, d, s, k_splits):
  """Lowers the compiled (non-interpret) kernel for CUDA on this CPU-only machine, under an
  abstract H100 (jax 0.11 refuses to lower Pallas for a GPU it cannot see otherwise).

  Runs the whole Pallas -> Triton IR lowering, which rejects e.g. non power-of-two tiles or
  unsupported ops, so a change that breaks the GPU path fails here without a GPU.
  """
  args = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in make_inputs(
      b=b, t=t, h=h, kvh=kvh, d=d, s=8, lengths=[3] * b, tree="random", dtype=dtype)]
  args[1] = args[2] = jax.ShapeDtypeStruct((b, kvh, s, d), dtype)  # the cache at full size
  fn = lambda *a: prefix_tree_attention_pallas(*a, k_splits=k_splits, num_sms=132,  # noqa: E731
                                               num_warps=4, interpret=False)
  with abstract_gpu():
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text or "triton_kernel_call" in text
  assert "num_warps = 4" in text
  split = "prefix_tree_attention_split" in text
  assert ('"prefix_tree_attention"' in text) == (not split)
  if k_splits is not None:
    assert split == (k_splits != 1)


def test_kernel_gradients_are_the_references():
  """The kernel has no backward of its own; through the dispatcher its gradient is the
  reference's, so a training forward that takes the kernel still trains."""
  args = make_inputs(b=2, t=8, h=4, kvh=2, d=16, s=24, lengths=[20, 5], tree="random",
                     dtype=jnp.float32)
  w = jax.random.normal(jax.random.key(0), args[0].shape)

  def loss(impl, q, kc, vc, kn, vn):
    out = prefix_tree_attention(q, kc, vc, args[3], kn, vn, args[6], impl=impl)
    return jnp.sum(out * w)
  floats = [args[i] for i in (0, 1, 2, 4, 5)]
  want = jax.grad(functools.partial(loss, "reference"), argnums=range(5))(*floats)
  got = jax.grad(functools.partial(loss, "pallas_interpret"), argnums=range(5))(*floats)
  for a, b in zip(got, want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_split_rule_fills_the_grid():
  """H100-like 132 SMs, Qwen2.5-7B heads (28 query, 4 KV, D=128), bf16, block_k=64."""
  def plan(b, s, t):
    p = kernel_plan((b, t, 28, 128), (b, 4, s, 128), jnp.bfloat16, num_sms=132)
    return p["k_splits"], b * 4 * p["rows_pad"] // p["block_rows"] * p["k_splits"]

  # B=1 decode over 16k: 4 programs alone; split into 64 runs of 4 KV blocks -> 256 programs.
  assert plan(1, 16384, 1) == (64, 256)
  splits, programs = plan(1, 16384, 48)  # 3 row blocks of 128 rows each
  assert splits > 1 and programs >= 132
  assert plan(1, 2048, 1)[0] == 16  # capped: >= 2 KV blocks per split
  # Enough programs already: no split, no merge.
  assert plan(32, 16384, 1)[0] == 1
  assert plan(16, 16384, 48)[0] == 1
  counts = [plan(b, 16384, 1)[0] for b in (1, 2, 4, 8, 16, 32, 64)]
  assert counts == sorted(counts, reverse=True) and counts[-1] == 1
  assert choose_k_splits(4, 1, num_sms=132) == 1  # one KV block cannot be split
  assert choose_k_splits(4, 256, min_split_blocks=100, num_sms=132) == 2
  # The count is evened out: 66 wanted, 4 blocks per split -> 64 splits, none empty at full S.
  assert choose_k_splits(4, 256, min_split_blocks=2, num_sms=132) == 64
  # A forced count is capped at the number of KV blocks.
  assert kernel_plan((1, 1, 4, 16), (1, 4, 64, 16), jnp.float32, block_k=16,
                     k_splits=9)["k_splits"] == 4


SYNTHETIC_TABLE = dict(device_kind="NVIDIA H100 80GB HBM3", dtype="bfloat16", entries=[
    dict(batch=b, prefix_len=s, tree_size=t, kernel_wins=wins)
    for b, s, t, wins in [(1, 2048, 8, True), (1, 2048, 64, False), (1, 16384, 8, True),
                          (1, 16384, 64, True), (16, 2048, 8, False), (16, 2048, 64, False),
                          (16, 16384, 8, True), (16, 16384, 64, True)]])


def test_crossover_lookup_buckets_shapes():
  tables = [SYNTHETIC_TABLE]
  wins = functools.partial(crossover.kernel_wins, tables, "NVIDIA H100 80GB HBM3", "bfloat16")
  assert wins(1, 2048, 8) is True and wins(1, 2048, 64) is False
  assert wins(1, 1000, 1) is True  # below the grid: the smallest bucket
  assert wins(2, 2048, 8) is False  # B=2 falls into the B<=16 bucket
  assert wins(4, 3000, 48) is True  # (16, 16384, 64)
  assert wins(256, 1 << 20, 64) is True  # beyond the grid: the largest bucket
  assert crossover.bucket(17, [16, 1, 32]) == 32 and crossover.bucket(99, [16, 32]) == 32
  # No table for the device kind or dtype: no verdict.
  assert crossover.kernel_wins(tables, "NVIDIA A100-SXM4-80GB", "bfloat16", 1, 2048, 8) is None
  assert crossover.kernel_wins(tables, "NVIDIA H100 80GB HBM3", "float32", 1, 2048, 8) is None
  assert crossover.kernel_wins([], "NVIDIA H100 80GB HBM3", "bfloat16", 1, 2048, 8) is None


def test_auto_dispatch_uses_table_else_fallback():
  tables = [SYNTHETIC_TABLE]
  h100 = "NVIDIA H100 80GB HBM3"
  assert not auto_uses_kernel("gpu", h100, "bfloat16", 16, 2048, 8, True, tables)
  assert auto_uses_kernel("gpu", h100, "bfloat16", 1, 2048, 8, True, tables)
  # No measured table for this device kind: fallback rule, the kernel whenever it fits.
  assert auto_uses_kernel("gpu", "NVIDIA H200", "bfloat16", 16, 2048, 8, True, tables)
  assert auto_uses_kernel("gpu", h100, "bfloat16", 16, 2048, 8, True, ())
  assert not auto_uses_kernel("gpu", h100, "bfloat16", 1, 2048, 8, False, tables)
  assert not auto_uses_kernel("cpu", h100, "bfloat16", 1, 2048, 8, True, tables)


def test_crossover_table_from_results_round_trips(tmp_path):
  row = dict(batch=1, prefix_len=2048, tree_size=8, kernel_ms=0.1, kernel_status="ok",
             reference_ms=0.2, reference_status="ok", kernel_correct=True)
  results = [row,
             dict(row, tree_size=64, kernel_ms=0.3),  # slower
             dict(row, batch=2, kernel_correct=False),  # faster but wrong: never wins
             dict(row, batch=4, reference_ms=None, reference_status="error: OOM"),
             dict(row, batch=8, kernel_ms=None, kernel_status="skipped: cpu: reference only")]
  table = crossover.table_from_results(results, "dev", "bfloat16", source=dict(iters=10))
  assert [(e["batch"], e["tree_size"], e["kernel_wins"]) for e in table["entries"]] == [
      (1, 8, True), (1, 64, False), (2, 8, False), (4, 8, True)]
  assert table["entries"][0]["speedup"] == pytest.approx(2.0)
  other = dict(device_kind="dev", dtype="float32", entries=[])
  doc = crossover.merge_tables(crossover.merge_tables(None, other), dict(table, entries=[]))
  doc = crossover.merge_tables(doc, table)  # replaces the bfloat16 table, keeps float32
  assert [(t["dtype"], len(t["entries"])) for t in doc["tables"]] == [("float32", 0),
                                                                      ("bfloat16", 4)]
  path = tmp_path / "crossover.json"
  path.write_text(json.dumps(doc))
  tables = crossover.load_tables(str(path))
  assert crossover.kernel_wins(tables, "dev", "bfloat16", 1, 2048, 8) is True
  assert crossover.load_tables(str(tmp_path / "missing.json")) == ()
