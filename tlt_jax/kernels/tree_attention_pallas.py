"""Pallas prefix + tree attention (Triton backend on GPU, interpret mode on CPU).

Same contract as `reference.prefix_tree_attention_reference`. One program handles one
(sequence b, KV head, block of query rows, prefix split). Its query rows are the T new tokens of
every query head that shares that KV head (GQA), flattened as row = t * G + g, so each prefix KV
block is read from HBM once for the whole group -- that read is the cost of memory-bound
verification.

Per program:
  1. Prefix: flash-attention online softmax over KV blocks of `block_k` cache slots. The valid
     blocks of a row (those holding a slot s < cache_lengths[b]) are dealt out to the
     `k_splits` programs of that row in equal runs of whole blocks; a program whose run lies past
     the row's valid length loops zero times. The work of a short sequence therefore does not
     depend on the cache capacity S.
  2. Tree: one more softmax step against the T new keys/values, masked by a per-row ancestor
     bitmask (bit j of a row's words says the row may attend new token j), not a dense
     [T, T] bool mask. T <= 64 fits in two uint32 words (x64 stays off). Only the last split
     takes this step, so the tree block is attended exactly once.

Split-K ("flash-decoding"): with B x KVH x row blocks programs alone, a small batch leaves most
SMs idle (B=1 with 4 KV heads is 4 programs on a 132-SM H100) and reads the prefix at a few
percent of HBM bandwidth. `choose_k_splits` adds splits until the grid fills the device. With
one split the program normalises and writes the output itself; with several, each writes its
unnormalised fp32 partial output with its running max and denominator, and `_merge_splits`
(XLA, a few small reductions) combines them exactly.

Shapes inside the kernel are powers of two (Triton needs that): T pads to `t_pad` >= 16, D to a
power of two >= 16, the rows to a multiple of `block_rows`. Padded tree slots have no bit set in
any row, padded rows are sliced off. Accumulation is fp32; dots run at HIGHEST precision so fp32
inputs are not silently rounded to TF32 on GPU.

The kernel body only uses ref loads/stores, `dot_general`, elementwise ops and `fori_loop`, so a
Mosaic GPU port needs new block specs and compiler params, not a new algorithm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # The Triton backend module; deprecated from jax 0.11 and may disappear later.
  from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover - depends on the installed jax
  pltriton = None

# Largest tree the bitmask handles: two uint32 words per row.
MAX_TREE_TOKENS = 64
# Finite instead of -inf: exp(m_old - m_new) must stay defined while a row has seen nothing,
# and an empty split's max must give exp(m - m_max) == 0, not NaN, in the merge.
_MASK_VALUE = -1e30
_BITS_PER_WORD = 32
_WORD_SHIFT = 5  # log2(_BITS_PER_WORD): tree column j lives in word j >> _WORD_SHIFT
# Smallest dot operand edge the Triton backend accepts.
_MIN_DOT_DIM = 16

# Split rule constants (see `choose_k_splits`): a starting point, not yet measured; tune them
# against `experiments/bench_tree_attention.py --k-splits N` runs.
# An H100 SXM has 132 SMs; used when the device does not report its count (CPU, interpret
# mode, lowering for CUDA without a GPU).
DEFAULT_NUM_SMS = 132
# Splitting aims at this many programs per SM: a few resident programs per SM keep enough loads
# in flight to stream the prefix at full bandwidth.
_PROGRAMS_PER_SM = 2
# No split once this fraction of the SMs already has a program: the gain is then at most the
# idle remainder, paid for with partial-output traffic and a merge.
_BUSY_SM_FRACTION = 0.8
# Each split reads at least this many times the bytes of partial output it writes.
_MIN_READ_PER_WRITE = 4
# ... and at least this many KV blocks, so the software pipeline (num_stages=2) has a next load
# to overlap.
_MIN_SPLIT_BLOCKS = 2


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def choose_k_splits(programs: int, num_kv_blocks: int, *, min_split_blocks: int = 1,
                    num_sms: int = DEFAULT_NUM_SMS) -> int:
  """Number of prefix splits per (b, KV head, row block) that fills the GPU.

  Args:
    programs: programs without splitting, B * KVH * row blocks.
    num_kv_blocks: cache capacity in KV blocks, S_pad / block_k (the most splits possible).
    min_split_blocks: fewest KV blocks a split may get.
    num_sms: streaming multiprocessors of the device.

  Returns:
    1 when at least `_BUSY_SM_FRACTION` of the SMs already get a program; otherwise enough
    splits for about `_PROGRAMS_PER_SM` programs per SM, capped so every split of a full-length
    row gets >= min_split_blocks blocks, and evened out so the capped count does not leave the
    last splits of a full-length row empty.
  """
  if programs >= _BUSY_SM_FRACTION * num_sms:
    return 1
  splits = min(_cdiv(_PROGRAMS_PER_SM * num_sms, programs),
               num_kv_blocks // max(1, min_split_blocks))
  if splits <= 1:
    return 1
  return _cdiv(num_kv_blocks, _cdiv(num_kv_blocks, splits))


def min_split_blocks(block_rows: int, block_k: int, head_dim: int, itemsize: int) -> int:
  """Fewest KV blocks per split: reads >= `_MIN_READ_PER_WRITE` x the partial output written.

  A split reads 2 * block_k * head_dim * itemsize bytes of K and V per block and writes
  block_rows * (head_dim + 2) fp32 values (accumulator, max, denominator), which the merge reads
  back.
  """
  written = block_rows * (head_dim + 2) * 4
  read_per_block = 2 * block_k * head_dim * itemsize
  return max(_MIN_SPLIT_BLOCKS, _cdiv(_MIN_READ_PER_WRITE * written, read_per_block))


def device_num_sms() -> int:
  """SM count of the default device when it reports one, else `DEFAULT_NUM_SMS`."""
  device = jax.devices()[0]
  count = getattr(device, "core_count", None) if device.platform == "gpu" else None
  return int(count) if count else DEFAULT_NUM_SMS


def _dot_nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b[N, K].T -> [M, N] float32 (operands promoted to a common dtype)."""
  dtype = jnp.promote_types(a.dtype, b.dtype)
  return lax.dot_general(a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _dot_nn(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [M, K] @ b [K, N] -> [M, N] float32; `a` is cast to b's dtype (bf16 P @ V on GPU)."""
  return lax.dot_general(a.astype(b.dtype), b, (((1,), (0,)), ((), ())),
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _softmax_step(carry, scores, allowed, v):
  """One online-softmax update.

  carry: (acc [R, D] f32, m [R] f32 running max, l [R] f32 running denominator).
  scores: [R, N] f32 already scaled; allowed: [R, N] bool or None (all allowed); v: [N, D].
  """
  acc, m, l = carry
  if allowed is not None:
    scores = jnp.where(allowed, scores, _MASK_VALUE)
  m_new = jnp.maximum(m, jnp.max(scores, axis=1))
  correction = jnp.exp(m - m_new)
  p = jnp.exp(scores - m_new[:, None])
  if allowed is not None:
    # A row with nothing allowed so far has m_new == _MASK_VALUE and exp(0) == 1 here.
    p = jnp.where(allowed, p, 0.0)
  l = correction * l + jnp.sum(p, axis=1)
  acc = correction[:, None] * acc + _dot_nn(p, v)
  return acc, m_new, l


def _tree_allowed(bits_ref, num_words: int, t_pad: int) -> jax.Array:
  """Unpacks the per-row ancestor bitmask [W, R] uint32 into allowed [R, t_pad] bool."""
  cols = lax.broadcasted_iota(jnp.int32, (1, t_pad), 1)
  shift = (cols & (_BITS_PER_WORD - 1)).astype(jnp.uint32)
  allowed = None
  for w in range(num_words):  # static, at most 2
    word = bits_ref[w, :][:, None]  # [R, 1]
    hit = (((word >> shift) & 1) != 0) & ((cols >> _WORD_SHIFT) == w)
    allowed = hit if allowed is None else allowed | hit
  return allowed


def _tree_attention_kernel(lens_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, bits_ref, *out_refs,
                           scale: float, block_k: int, num_words: int, k_splits: int):
  """One (b, kv head, row block, split) program.

  lens_ref: [] int32 valid prefix length (already clipped to [0, S]).
  q_ref: [R, D]; kc_ref, vc_ref: [S_pad, D] this head's cache; kn_ref, vn_ref: [t_pad, D];
  bits_ref: [W, R] uint32.
  out_refs: o_ref [R, D] (normalised, q.dtype) when k_splits == 1; else acc_ref [R, D] f32
  (unnormalised), m_ref [R] f32 (running max), l_ref [R] f32 (denominator).
  """
  rows, d = q_ref.shape
  t_pad = kn_ref.shape[0]
  q = q_ref[...]
  length = lens_ref[...]
  carry = (jnp.zeros((rows, d), jnp.float32),
           jnp.full((rows,), _MASK_VALUE, jnp.float32),
           jnp.zeros((rows,), jnp.float32))

  num_blocks = pl.cdiv(length, block_k)
  if k_splits == 1:
    first, count = 0, num_blocks
  else:
    # This row's valid blocks in runs of `per_split`: a short row still spreads over up to one
    # split per block (balanced work), and a split past the row's end gets count 0 and keeps
    # the empty carry.
    split = pl.program_id(3)
    per_split = pl.cdiv(num_blocks, k_splits)
    first = split * per_split
    count = jnp.clip(num_blocks - first, 0, per_split)

  def prefix_block(i, carry):
    start = pl.multiple_of((first + i) * block_k, block_k)
    k = kc_ref[pl.ds(start, block_k), :]
    v = vc_ref[pl.ds(start, block_k), :]
    scores = _dot_nt(q, k) * scale
    # Every visited block holds >= 1 valid slot and validity is the same for all rows, so the
    # masked scores underflow to exactly 0 after exp and no extra select on p is needed.
    valid = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < length
    scores = jnp.where(valid, scores, _MASK_VALUE)
    return _softmax_step(carry, scores, None, v)

  carry = lax.fori_loop(0, count, prefix_block, carry)

  def tree_step(_, carry):
    scores = _dot_nt(q, kn_ref[...]) * scale
    allowed = _tree_allowed(bits_ref, num_words, t_pad)
    return _softmax_step(carry, scores, allowed, vn_ref[...])

  if k_splits == 1:
    acc, _, l = tree_step(0, carry)
    o_ref, = out_refs
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)
  else:
    # A loop of 0 or 1 trips instead of a branch: only the last split attends the tree block.
    is_last = (split == k_splits - 1).astype(jnp.int32)
    acc, m, l = lax.fori_loop(0, is_last, tree_step, carry)
    acc_ref, m_ref, l_ref = out_refs
    acc_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def _merge_splits(acc: jax.Array, m: jax.Array, l: jax.Array) -> jax.Array:
  """Exact softmax merge over splits: acc [..., K, R, D], m, l [..., K, R] f32 -> [..., R, D].

  An empty split has m == _MASK_VALUE, l == 0, acc == 0: its weight exp(m - m_max) is 0 when
  any split saw a key, and 1 times zeros otherwise, so it adds nothing and never makes NaN.
  """
  m_max = jnp.max(m, axis=-2, keepdims=True)
  weight = jnp.exp(m - m_max)
  l_sum = jnp.sum(weight * l, axis=-2)
  acc_sum = jnp.sum(weight[..., None] * acc, axis=-3)
  return acc_sum / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]


def pack_ancestor_bits(new_mask: jax.Array, num_words: int) -> jax.Array:
  """Packs new_mask [B, T, T] bool into [B, T, num_words] uint32; bit j%32 of word j//32."""
  b, t, cols = new_mask.shape
  width = num_words * _BITS_PER_WORD
  mask = jnp.pad(new_mask.astype(jnp.uint32), ((0, 0), (0, 0), (0, width - cols)))
  mask = mask.reshape(b, t, num_words, _BITS_PER_WORD)
  weights = jnp.left_shift(jnp.uint32(1), jnp.arange(_BITS_PER_WORD, dtype=jnp.uint32))
  # Distinct powers of two: the sum is the bitwise OR and cannot overflow 32 bits.
  return jnp.sum(mask * weights, axis=-1, dtype=jnp.uint32)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def kernel_plan(q_shape, kv_shape, dtype, *, block_k: int = 64, block_rows: int | None = None,
                k_splits: int | None = None, num_sms: int | None = None) -> dict:
  """Static tiling of one call: block sizes, padded extents and the number of prefix splits.

  Args:
    q_shape: (B, T, H, D); kv_shape: (B, KVH, S, D) of the cache; dtype: the cache dtype.
    block_k, block_rows: as in `prefix_tree_attention_pallas` (block_rows None: default).
    k_splits: None chooses with `choose_k_splits`; an int is used as given, capped at the
      number of KV blocks.
    num_sms: SM count for the split rule; None asks the default device.

  Returns:
    dict of ints: t_pad, d_pad, num_words, block_k, s_pad, rows, block_rows, rows_pad, k_splits.
  """
  b, t, h, d = q_shape
  _, kvh, s, _ = kv_shape
  if t > MAX_TREE_TOKENS:
    raise ValueError(f"tree size {t} exceeds {MAX_TREE_TOKENS}; use the reference")
  if h % kvh:
    raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
  for name, value in (("block_k", block_k), ("block_rows", block_rows)):
    if value is not None and (value < _MIN_DOT_DIM or value & (value - 1)):
      raise ValueError(f"{name}={value} must be a power of two >= {_MIN_DOT_DIM}")
  if k_splits is not None and k_splits < 1:
    raise ValueError(f"k_splits={k_splits} must be >= 1")
  t_pad = max(_MIN_DOT_DIM, _next_pow2(t))
  d_pad = max(_MIN_DOT_DIM, _next_pow2(d))
  block_k = min(block_k, max(_MIN_DOT_DIM, _next_pow2(s)))
  s_pad = _cdiv(s, block_k) * block_k
  rows = t * (h // kvh)
  if block_rows is None:
    block_rows = min(max(_MIN_DOT_DIM, _next_pow2(rows)), 128)
  rows_pad = _cdiv(rows, block_rows) * block_rows
  num_kv_blocks = s_pad // block_k
  if k_splits is None:
    k_splits = choose_k_splits(
        b * kvh * (rows_pad // block_rows), num_kv_blocks,
        min_split_blocks=min_split_blocks(block_rows, block_k, d_pad, jnp.dtype(dtype).itemsize),
        num_sms=device_num_sms() if num_sms is None else num_sms)
  return dict(t_pad=t_pad, d_pad=d_pad, num_words=_cdiv(t_pad, _BITS_PER_WORD), block_k=block_k,
              s_pad=s_pad, rows=rows, block_rows=block_rows, rows_pad=rows_pad,
              k_splits=max(1, min(k_splits, num_kv_blocks)))


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "block_rows", "k_splits",
                                              "num_sms", "num_warps", "num_stages", "interpret"))
def prefix_tree_attention_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_lengths: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    *,
    scale: float | None = None,
    block_k: int = 64,
    block_rows: int | None = None,
    k_splits: int | None = None,
    num_sms: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
  """Pallas prefix + tree attention; arguments and result as in the reference.

  Args:
    q: [B, T, H, D]; k_cache, v_cache: [B, KVH, S, D]; cache_lengths: [B] int;
      k_new, v_new: [B, T, KVH, D]; new_mask: [B, T, T] bool. T <= 64. Cache slots past
      cache_lengths[b] are masked like in the reference: any finite stale contents are ignored
      (non-finite ones in the last visited block would leak through 0 * inf, as there).
    scale: softmax scale, default D ** -0.5.
    block_k: prefix slots per KV block (power of two >= 16; shrunk for short caches). If S is
      not a multiple of it the cache is padded, which copies it: allocate caches in multiples.
    block_rows: query rows per program (power of two >= 16). Default: all T * G rows of a GQA
      group up to 128; larger groups split into row blocks that each re-read the prefix, which
      is then compute-bound anyway (>= 128 rows per KV byte pair).
    k_splits: programs sharing one row's prefix (split-K). None: `choose_k_splits` from the grid
      size and the cache capacity; 1: no split, no merge. Capped at S_pad / block_k.
    num_sms: SM count the split rule fills; None asks the default device (132 off GPU).
    num_warps, num_stages: Triton compiler params (GPU only); num_warps defaults by tile size.
    interpret: run the kernel with the Pallas interpreter (CPU tests).

  Returns:
    [B, T, H, D] in q.dtype; rows with nothing to attend to are zeros.
  """
  b, t, h, d = q.shape
  kvh = k_cache.shape[1]
  plan = kernel_plan(q.shape, k_cache.shape, k_cache.dtype, block_k=block_k,
                     block_rows=block_rows, k_splits=k_splits, num_sms=num_sms)
  g = h // kvh
  scale = d**-0.5 if scale is None else scale
  t_pad, d_pad, num_words = plan["t_pad"], plan["d_pad"], plan["num_words"]
  block_k, s_pad, splits = plan["block_k"], plan["s_pad"], plan["k_splits"]
  rows, block_rows, rows_pad = plan["rows"], plan["block_rows"], plan["rows_pad"]

  # Queries of one GQA group as rows t * G + g: [B, KVH, rows_pad, d_pad].
  qr = q.reshape(b, t, kvh, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kvh, rows, d)
  qr = _pad_axis(_pad_axis(qr, 2, rows_pad), 3, d_pad)
  kc = _pad_axis(_pad_axis(k_cache, 2, s_pad), 3, d_pad)
  vc = _pad_axis(_pad_axis(v_cache, 2, s_pad), 3, d_pad)
  kn = _pad_axis(_pad_axis(k_new.transpose(0, 2, 1, 3), 2, t_pad), 3, d_pad)
  vn = _pad_axis(_pad_axis(v_new.transpose(0, 2, 1, 3), 2, t_pad), 3, d_pad)
  # Per-row bits: every head of a group shares its query's ancestry; padded rows get none.
  bits = jnp.repeat(pack_ancestor_bits(new_mask, num_words), g, axis=1)  # [B, rows, W]
  bits = _pad_axis(bits, 1, rows_pad).transpose(0, 2, 1)  # [B, W, rows_pad]
  lengths = jnp.clip(cache_lengths.astype(jnp.int32), 0, k_cache.shape[2])

  kernel = functools.partial(_tree_attention_kernel, scale=float(scale), block_k=block_k,
                             num_words=num_words, k_splits=splits)
  compiler_params = None
  if not interpret:
    if pltriton is None:
      raise RuntimeError(
          "this jax has no Pallas Triton backend; use interpret=True or the reference")
    if num_warps is None:
      num_warps = 4 if block_rows * d_pad <= 64 * 128 else 8
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

  head = lambda bi, hi, ri, si: (bi, hi, 0, 0)  # noqa: E731 - a whole per-head slab
  in_specs = [
      pl.BlockSpec((None,), lambda bi, hi, ri, si: (bi,)),
      pl.BlockSpec((None, None, block_rows, d_pad), lambda bi, hi, ri, si: (bi, hi, ri, 0)),
      pl.BlockSpec((None, None, s_pad, d_pad), head),
      pl.BlockSpec((None, None, s_pad, d_pad), head),
      pl.BlockSpec((None, None, t_pad, d_pad), head),
      pl.BlockSpec((None, None, t_pad, d_pad), head),
      pl.BlockSpec((None, num_words, block_rows), lambda bi, hi, ri, si: (bi, 0, ri)),
  ]
  if splits == 1:
    out_specs = pl.BlockSpec((None, None, block_rows, d_pad),
                             lambda bi, hi, ri, si: (bi, hi, ri, 0))
    out_shape = jax.ShapeDtypeStruct((b, kvh, rows_pad, d_pad), q.dtype)
  else:
    # Partials stay fp32 until the merge: rounding them to bf16 would add error per split.
    out_specs = [
        pl.BlockSpec((None, None, None, block_rows, d_pad),
                     lambda bi, hi, ri, si: (bi, hi, si, ri, 0)),
        pl.BlockSpec((None, None, None, block_rows), lambda bi, hi, ri, si: (bi, hi, si, ri)),
        pl.BlockSpec((None, None, None, block_rows), lambda bi, hi, ri, si: (bi, hi, si, ri)),
    ]
    out_shape = [jax.ShapeDtypeStruct((b, kvh, splits, rows_pad, d_pad), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, splits, rows_pad), jnp.float32),
                 jax.ShapeDtypeStruct((b, kvh, splits, rows_pad), jnp.float32)]
  out = pl.pallas_call(
      kernel,
      grid=(b, kvh, rows_pad // block_rows, splits),
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=compiler_params,
      interpret=interpret,
      name="prefix_tree_attention" if splits == 1 else "prefix_tree_attention_split",
  )(lengths, qr, kc, vc, kn, vn, bits)
  if splits == 1:
    out = out[:, :, :rows, :d]
  else:
    acc, m, l = out
    out = _merge_splits(acc[..., :rows, :d], m[..., :rows], l[..., :rows]).astype(q.dtype)

  out = out.reshape(b, kvh, t, g, d)
  return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
