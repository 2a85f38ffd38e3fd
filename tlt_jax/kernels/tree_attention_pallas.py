"""Pallas prefix + tree attention (Triton backend on GPU, interpret mode on CPU).

Same contract as `reference.prefix_tree_attention_reference`. One program handles one
(sequence b, KV head, block of query rows). Its query rows are the T new tokens of every query
head that shares that KV head (GQA), flattened as row = t * G + g, so each prefix KV block is
read from HBM once for the whole group -- that read is the cost of memory-bound verification.

Per program:
  1. Prefix: flash-attention online softmax over KV blocks of `block_k` cache slots; the loop
     stops after the last block that holds a valid slot (s < cache_lengths[b]), so the work of a
     short sequence does not depend on the cache capacity S.
  2. Tree: one more softmax step against the T new keys/values, masked by a per-row ancestor
     bitmask (bit j of a row's words says the row may attend new token j), not a dense
     [T, T] bool mask. T <= 64 fits in two uint32 words (x64 stays off).

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
# Finite instead of -inf: exp(m_old - m_new) must stay defined while a row has seen nothing.
_MASK_VALUE = -1e30
_BITS_PER_WORD = 32
_WORD_SHIFT = 5  # log2(_BITS_PER_WORD): tree column j lives in word j >> _WORD_SHIFT
# Smallest dot operand edge the Triton backend accepts.
_MIN_DOT_DIM = 16


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


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


def _tree_attention_kernel(lens_ref, q_ref, kc_ref, vc_ref, kn_ref, vn_ref, bits_ref, o_ref, *,
                           scale: float, block_k: int, num_words: int):
  """One (b, kv head, row block) program.

  lens_ref: [] int32 valid prefix length (already clipped to [0, S]).
  q_ref: [R, D]; kc_ref, vc_ref: [S_pad, D] this head's cache; kn_ref, vn_ref: [t_pad, D];
  bits_ref: [W, R] uint32; o_ref: [R, D].
  """
  rows, d = q_ref.shape
  t_pad = kn_ref.shape[0]
  q = q_ref[...]
  length = lens_ref[...]
  carry = (jnp.zeros((rows, d), jnp.float32),
           jnp.full((rows,), _MASK_VALUE, jnp.float32),
           jnp.zeros((rows,), jnp.float32))

  def prefix_block(i, carry):
    start = pl.multiple_of(i * block_k, block_k)
    k = kc_ref[pl.ds(start, block_k), :]
    v = vc_ref[pl.ds(start, block_k), :]
    scores = _dot_nt(q, k) * scale
    # Every visited block holds >= 1 valid slot and validity is the same for all rows, so the
    # masked scores underflow to exactly 0 after exp and no extra select on p is needed.
    valid = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < length
    scores = jnp.where(valid, scores, _MASK_VALUE)
    return _softmax_step(carry, scores, None, v)

  carry = lax.fori_loop(0, pl.cdiv(length, block_k), prefix_block, carry)

  scores = _dot_nt(q, kn_ref[...]) * scale
  allowed = _tree_allowed(bits_ref, num_words, t_pad)
  acc, _, l = _softmax_step(carry, scores, allowed, vn_ref[...])
  o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


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


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "block_rows", "num_warps",
                                              "num_stages", "interpret"))
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
    num_warps, num_stages: Triton compiler params (GPU only); num_warps defaults by tile size.
    interpret: run the kernel with the Pallas interpreter (CPU tests).

  Returns:
    [B, T, H, D] in q.dtype; rows with nothing to attend to are zeros.
  """
  b, t, h, d = q.shape
  _, kvh, s, _ = k_cache.shape
  if t > MAX_TREE_TOKENS:
    raise ValueError(f"tree size {t} exceeds {MAX_TREE_TOKENS}; use the reference")
  if h % kvh:
    raise ValueError(f"query heads {h} must be a multiple of kv heads {kvh}")
  for name, value in (("block_k", block_k), ("block_rows", block_rows)):
    if value is not None and (value < _MIN_DOT_DIM or value & (value - 1)):
      raise ValueError(f"{name}={value} must be a power of two >= {_MIN_DOT_DIM}")
  g = h // kvh
  scale = d**-0.5 if scale is None else scale

  t_pad = max(_MIN_DOT_DIM, _next_pow2(t))
  d_pad = max(_MIN_DOT_DIM, _next_pow2(d))
  num_words = -(-t_pad // _BITS_PER_WORD)
  block_k = min(block_k, max(_MIN_DOT_DIM, _next_pow2(s)))
  s_pad = -(-s // block_k) * block_k
  rows = t * g
  if block_rows is None:
    block_rows = min(max(_MIN_DOT_DIM, _next_pow2(rows)), 128)
  rows_pad = -(-rows // block_rows) * block_rows

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
  lengths = jnp.clip(cache_lengths.astype(jnp.int32), 0, s)

  kernel = functools.partial(_tree_attention_kernel, scale=float(scale), block_k=block_k,
                             num_words=num_words)
  compiler_params = None
  if not interpret:
    if pltriton is None:
      raise RuntimeError("this jax has no Pallas Triton backend; use interpret=True or the reference")
    if num_warps is None:
      num_warps = 4 if block_rows * d_pad <= 64 * 128 else 8
    compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)

  head = lambda bi, hi, ri: (bi, hi, 0, 0)  # noqa: E731 - a whole per-head slab
  out = pl.pallas_call(
      kernel,
      grid=(b, kvh, rows_pad // block_rows),
      in_specs=[
          pl.BlockSpec((None,), lambda bi, hi, ri: (bi,)),
          pl.BlockSpec((None, None, block_rows, d_pad), lambda bi, hi, ri: (bi, hi, ri, 0)),
          pl.BlockSpec((None, None, s_pad, d_pad), head),
          pl.BlockSpec((None, None, s_pad, d_pad), head),
          pl.BlockSpec((None, None, t_pad, d_pad), head),
          pl.BlockSpec((None, None, t_pad, d_pad), head),
          pl.BlockSpec((None, num_words, block_rows), lambda bi, hi, ri: (bi, 0, ri)),
      ],
      out_specs=pl.BlockSpec((None, None, block_rows, d_pad),
                             lambda bi, hi, ri: (bi, hi, ri, 0)),
      out_shape=jax.ShapeDtypeStruct((b, kvh, rows_pad, d_pad), q.dtype),
      compiler_params=compiler_params,
      interpret=interpret,
      name="prefix_tree_attention",
  )(lengths, qr, kc, vc, kn, vn, bits)

  out = out[:, :, :rows, :d].reshape(b, kvh, t, g, d)
  return out.transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
