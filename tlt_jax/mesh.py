"""Device mesh, logical-axis sharding rules, and replica slices.

The mesh has named axes (by default `replica`, `fsdp`, `tensor`). Parameters and activations
carry logical axis names (`embed`, `heads`, ...); a rules table maps each logical name to a mesh
axis (or None = replicated). Rollout and spot training use *slices*: sub-meshes along `replica`
that keep every axis name (with `replica` of size 1), so the same rules apply on a slice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

REPLICA_AXIS = "replica"
# Outer to inner. Config dicts do not keep insertion order, so meshes are built in this order;
# replica first makes each slice a contiguous group of devices. Other names go last.
AXIS_ORDER = (REPLICA_AXIS, "data", "fsdp", "sequence", "expert", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None). Order of the table is irrelevant.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", (REPLICA_AXIS, "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed_in", None),  # the drafter's fc input (token embedding + features)
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
)


def resolve_axis_sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
  """Orders the axes (AXIS_ORDER), fills one -1 entry with the remaining devices, checks.

  Raises ValueError naming the axes and the device count when the shape cannot fit.
  """
  sizes = {name: axes[name] for name in sorted(
      axes, key=lambda n: AXIS_ORDER.index(n) if n in AXIS_ORDER else len(AXIS_ORDER))}
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"mesh.axes: at most one axis may be -1, got {free} in {sizes}")
  bad = {n: s for n, s in sizes.items() if s != -1 and s < 1}
  if bad:
    raise ValueError(f"mesh.axes: sizes must be positive or -1, got {bad}")
  fixed = math.prod(s for s in sizes.values() if s != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f"mesh.axes={sizes}: the fixed axes ({fixed} devices) do not divide the "
                       f"{num_devices} available devices")
    sizes[free[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"mesh.axes={sizes} needs {fixed} devices but {num_devices} are available; "
                     f"set one axis to -1 to take the rest")
  return sizes


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all) with the named axis sizes (one may be -1)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_axis_sizes(axes, len(devices))
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes.keys()),
                       axis_types=(AxisType.Auto,) * len(sizes), devices=devices)


def replica_slices(mesh: Mesh) -> list[Mesh]:
  """Splits the mesh along `replica` into sub-meshes with the same axis names (replica=1)."""
  if REPLICA_AXIS not in mesh.axis_names:
    return [mesh]
  axis = mesh.axis_names.index(REPLICA_AXIS)
  return [Mesh(np.expand_dims(np.take(mesh.devices, i, axis=axis), axis), mesh.axis_names,
               axis_types=mesh.axis_types)
          for i in range(mesh.devices.shape[axis])]


def logical_to_mesh_spec(logical: PartitionSpec, shape: Sequence[int] | None, mesh: Mesh,
                         rules=DEFAULT_RULES) -> PartitionSpec:
  """Maps a logical PartitionSpec to mesh axes.

  Mesh axes missing from `mesh`, already used by an earlier dimension, or not dividing the
  dimension's size (when `shape` is given) are dropped, so that e.g. 2 KV heads on a tensor
  axis of 4 are replicated instead of failing.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for dim, name in enumerate(logical):
    target = table.get(name) if name is not None else None
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    kept = []
    size = None if shape is None else shape[dim]
    for axis in targets:
      if axis not in mesh.shape or axis in used:
        continue
      n = mesh.shape[axis]
      prod = math.prod(mesh.shape[a] for a in kept) * n
      if size is not None and size % prod:
        continue
      kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def logical_shardings(logical_tree, mesh: Mesh, rules=DEFAULT_RULES, shapes=None):
  """A pytree of NamedSharding for a pytree of logical PartitionSpecs (optionally with shapes,
  a matching pytree of arrays or ShapeDtypeStructs used for the divisibility check)."""
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
  if shapes is None:
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_mesh_spec(s, None, mesh, rules)),
                        logical_tree, is_leaf=is_spec)
  return jax.tree.map(
      lambda s, x: NamedSharding(mesh, logical_to_mesh_spec(s, x.shape, mesh, rules)),
      logical_tree, shapes, is_leaf=is_spec)


def shard_pytree(tree, logical_tree, mesh: Mesh, rules=DEFAULT_RULES):
  """Places every array of `tree` with the sharding its logical axes ask for on `mesh`."""
  return jax.device_put(tree, logical_shardings(logical_tree, mesh, rules, shapes=tree))
