"""The attention kernel on a mesh: one call per shard of rows and KV heads.

XLA cannot partition a Pallas custom call, so on a mesh it would run the whole kernel on every
device, each first gathering every row and head. Attention is independent per row and per KV
head group, so the kernel runs under `jax.shard_map` over the mesh axes that split rows
(`batch` in the rules) and heads (`heads` and `kv_heads`, when one axis divides both: each
device then holds whole GQA groups). The mesh is the one the program is traced under
(`jax.set_mesh`, as the rollout, the updates and the budget do); without one, or when no axis
splits anything, the kernel is called as it is.

Which axes split what comes from `tlt_jax.mesh.DEFAULT_RULES` (rows and heads map alike in
both layouts). The result does not depend on it: a layout that differs only moves data around
the call.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from tlt_jax.mesh import DEFAULT_RULES, OPTIONAL, row_axes


def kernel_specs(mesh, batch: int, heads: int, kv_heads: int
                 ) -> tuple[tuple[str, ...], str | None]:
  """(row axes, head axis) the kernel splits over on `mesh` (a Mesh or AbstractMesh): the
  axes that split `batch` rows (`mesh.row_axes`), and the `heads` rule's axis when it has size
  > 1 and divides both head counts (whole GQA groups per device), else None."""
  rows = row_axes(mesh, batch)
  target = dict(DEFAULT_RULES).get("heads")
  for marked in (target,) if isinstance(target, str) else tuple(target or ()):
    axis = marked.removesuffix(OPTIONAL)
    n = mesh.shape.get(axis, 1)
    if n > 1 and axis not in rows and heads % n == 0 and kv_heads % n == 0:
      return rows, axis
  return rows, None


def per_shard(kernel: Callable, q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask):
  """kernel(q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask) -> [B, T, H, D], run
  per shard of rows and KV heads on the mesh the caller is traced under (see the module
  docstring); shapes as in `prefix_tree_attention_reference`."""
  mesh = jax.sharding.get_abstract_mesh()
  args = (q, k_cache, v_cache, cache_lengths, k_new, v_new, new_mask)
  if mesh.empty:
    return kernel(*args)
  rows, head = kernel_specs(mesh, q.shape[0], q.shape[2], k_cache.shape[1])
  if not rows and head is None:
    return kernel(*args)
  r = rows if rows else None
  heads_last = P(r, None, head, None)  # q, k_new, v_new, out: [B, T|N, heads, D]
  cache = P(r, head, None, None)  # [B, KVH, S, D]
  return jax.shard_map(kernel, mesh=mesh,
                       in_specs=(heads_last, cache, cache, P(r), heads_last, heads_last,
                                 P(r, None, None)),
                       out_specs=heads_last, check_vma=False)(*args)
