"""Shape-invariant numerics: a token's result computed in an order that depends only on that
token and its prefix, never on how many rows, tree nodes or positions the program holds.

`ModelConfig.numerics`:
  "fast": XLA's kernels as it picks them. A matrix-vector product (one decode row) and a
    matrix-matrix one (a tree verify, a prefill, the training forward) round their sums in
    different orders, and in bfloat16 that becomes another token at the first near tie.
  "invariant": every result a token's logits go through has one order and one code path:
    - matmuls (`invariant_matmul`) take bfloat16 or float32 operands and accumulate in float32
      in a loop over fixed tiles of rows (8 on a CPU, 64 elsewhere): one kernel shape for any
      call, and a row's sums never depend on the rows beside it. (One XLA:CPU dot is not
      enough: its last rows can take another micro-kernel, and where they start depends on
      the row count and on the layout XLA gives the operands in a loop or a scan.)
    - norms sum over the hidden axis with `tree_sum`, a fixed pairwise tree;
    - attention (`tlt_jax.kernels.invariant_attention`) walks the keys in blocks of absolute
      positions from position 0, an online softmax over the blocks in order and `tree_sum`
      within each, so that a key's place in a cache, a draft tree or a training row changes
      nothing;
    - exp, log, sigmoid, sin, cos and rsqrt go through `fixed_path`: XLA:CPU's vectorised
      functions and its scalar ones differ in the last bit, and which an element meets
      depends on the array's length and on the fusion it lands in (a softmax's exp inside its
      reduction, the 7th element of 7);
    - the sampler's softmax and log-softmax (`invariant_softmax`, `invariant_log_softmax`)
      sum over the vocabulary with `tree_sum`, so the rollout's token log-probs are the bits
      the trainer computes.
    Max, casts and the other elementwise arithmetic are exact or correctly rounded. XLA must
    also round every bfloat16 value it is asked to (`--xla_allow_excess_precision=false`,
    which importing tlt_jax sets: `tlt_jax.xla_flags`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Rows per matmul tile by backend: one kernel shape for every call. On a CPU 8 rows cost a
# decode step about what one row does; on a GPU 64 rows keep a decode step of up to 64 rows
# at one tile (a smaller step costs what 64 rows do).
TILE_ROWS = {"cpu": 8}
DEFAULT_TILE_ROWS = 64


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
  """Sum over `axis` by a fixed pairwise tree: the axis is zero-padded to a power of two and
  its halves are added until one entry is left. Entry i meets entry i + n/2 first, so the
  result depends only on the values and their indices: zeros appended past the last non-zero
  entry (a longer cache, a longer row) leave it bit for bit unchanged. [..., n, ...] -> [...]
  (the axis removed), in x's dtype."""
  x = jnp.moveaxis(x, axis, -1)
  n = x.shape[-1]
  width = 1 << max(n - 1, 0).bit_length()
  if width != n:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
  while x.shape[-1] > 1:
    half = x.shape[-1] // 2
    x = x[..., :half] + x[..., half:]
  return x[..., 0]


def fixed_path(fn, x: jax.Array) -> jax.Array:
  """fn (an elementwise jnp.exp, jnp.log, jax.nn.sigmoid, ...) of every element of x through
  one code path whatever x's shape:
  x is flattened, padded to a multiple of 128 elements and kept out of any fusion by
  optimization barriers, so each element meets the vectorised function. Same shape and dtype
  as x."""
  flat = x.reshape(-1)
  pad = -flat.shape[0] % 128
  flat = jax.lax.optimization_barrier(jnp.pad(flat, (0, pad), constant_values=1))
  out = jax.lax.optimization_barrier(fn(flat))
  return out[:x.size].reshape(x.shape)


def invariant_log_softmax(x: jax.Array) -> jax.Array:
  """log_softmax over the last axis of float32 [..., V] in one order for any leading dims
  (see the module docstring); -inf entries stay -inf."""
  shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
  total = tree_sum(fixed_path(jnp.exp, shifted))
  return shifted - fixed_path(jnp.log, total)[..., None]


def invariant_softmax(x: jax.Array) -> jax.Array:
  """softmax over the last axis of float32 [..., V], as `invariant_log_softmax` orders it."""
  e = fixed_path(jnp.exp, x - jnp.max(x, axis=-1, keepdims=True))
  return e / tree_sum(e)[..., None]


def invariant_matmul(x: jax.Array, w: jax.Array, dtype) -> jax.Array:
  """x [..., K] @ w [K, *N] -> [..., *N] float32 (w's trailing axes flattened for the product:
  a q/k/v kernel [E, heads, D]), the operands in `dtype`, accumulated in float32 in an order
  that does not depend on the leading dims (see the module docstring)."""
  rows = x.reshape(-1, x.shape[-1]).astype(dtype)
  out = _invariant_rows_matmul(rows, w.reshape(w.shape[0], -1).astype(dtype))
  return out.reshape(*x.shape[:-1], *w.shape[1:])


def _invariant_rows_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """[M, K] @ [K, N] -> [M, N] float32, each row's sums in one order for any M. On a mesh
  the weight is gathered whole first: a weight split along K (FSDP, tensor parallelism)
  would otherwise have each device sum its part and the parts be added across devices."""
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    w = jax.lax.with_sharding_constraint(w, jax.sharding.PartitionSpec())
  return tiled_matmul(x, w, TILE_ROWS.get(jax.default_backend(), DEFAULT_TILE_ROWS))


def tiled_matmul(x: jax.Array, w: jax.Array, tile: int) -> jax.Array:
  """[M, K] @ [K, N] -> [M, N] float32 through a loop over tiles of `tile` rows (M padded to a
  multiple): every product is one [tile, K] @ [K, N] kernel, whatever M, and a row's result
  does not depend on the other rows of its tile."""
  m, k = x.shape
  pad = -m % tile
  tiles = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, tile, k)
  out = jax.lax.map(lambda t: jnp.dot(t, w, preferred_element_type=jnp.float32), tiles)
  return out.reshape(-1, w.shape[-1])[:m]


def mean_square(x32: jax.Array, numerics: str) -> jax.Array:
  """mean(x^2) over the last axis of a float32 [..., E], keepdims: [..., 1]."""
  if numerics == "fast":
    return jnp.mean(x32 * x32, axis=-1, keepdims=True)
  # On its own: XLA may turn the division into a product and contract it with the + eps after.
  return jax.lax.optimization_barrier(tree_sum(x32 * x32)[..., None] / x32.shape[-1])
