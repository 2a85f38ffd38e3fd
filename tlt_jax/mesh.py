"""Device mesh, logical-axis sharding rules, and replica slices.

The mesh has named axes (by default `replica`, `fsdp`, `tensor`). Parameters and activations
carry logical axis names (`embed`, `heads`, ...); a rules table maps each logical name to a mesh
axis (or None = replicated). Rollout and spot training use *slices*: sub-meshes along `replica`
that keep every axis name (with `replica` of size 1), so the same rules apply on a slice.

Multi-host: `initialize_distributed` starts JAX's own multi-process runtime
(`jax.distributed`) when the config or the environment asks for it. The mesh then spans every
process's devices, ordered by process, so that each replica slice lives in one process: that
process's host loop drives its slices' rollouts, and whole-mesh programs (the policy update)
run on all processes in lockstep. `to_mesh` and `stack_slices` move arrays between the global
mesh and a process's own slices without going through the host.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

REPLICA_AXIS = "replica"
# Outer to inner. Config dicts do not keep insertion order, so meshes are built in this order;
# replica first makes each slice a contiguous group of devices. Other names go last.
AXIS_ORDER = (REPLICA_AXIS, "data", "fsdp", "sequence", "expert", "tensor")

# Logical name -> mesh axis (or tuple of axes, or None). Order of the table is irrelevant.
# Two layouts of one set of weights (the rollout engine's `update_params` reshards from the
# first to the second once per RL step):
#   training (DEFAULT_RULES): weights, gradients and optimizer state fully sharded over every
#     data axis, `replica` included (FSDP over the whole mesh), tensor-parallel where set;
#   rollout (ROLLOUT_RULES, on each replica slice): whole weights per device, or
#     tensor-parallel within the slice, so no decode step gathers weights; a slice's rows are
#     split over its `fsdp` devices.
# A mesh axis must divide the dimension it splits (else `logical_to_mesh_spec` raises), unless
# the rule marks it optional with a trailing "?": it is then dropped (that dimension is
# replicated over it). Rows are optional (a batch bucket of 1 on a slice of 2 devices), and
# so are KV heads (fewer KV heads than tensor devices: each device keeps whole KV heads).
OPTIONAL = "?"
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", (REPLICA_AXIS + OPTIONAL, "fsdp" + OPTIONAL)),
    ("vocab", "tensor"),
    ("embed", (REPLICA_AXIS, "fsdp")),
    ("embed_in", None),  # the drafter's fc input (token embedding + features)
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor" + OPTIONAL),
    ("head_dim", None),
    ("layers", None),
    ("length", None),
)
ROLLOUT_RULES = tuple((name, None if name == "embed" else axes) for name, axes in DEFAULT_RULES)


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


def initialize_distributed(dist: Mapping) -> bool:
  """Starts `jax.distributed` if asked; returns True when this is a multi-process run.

  dist: the config's mesh.distributed section. The coordinator address, process count and
  process id come from it, else from the environment (JAX_COORDINATOR_ADDRESS,
  JAX_NUM_PROCESSES, JAX_PROCESS_ID); with `auto_detect`, JAX reads them from the cluster
  (SLURM, Open MPI, ...). Nothing set: a single process, and nothing is started. Must run
  before JAX starts its backends (before the first jax.devices()).
  """
  if jax.distributed.is_initialized():
    return jax.process_count() > 1
  address = dist["coordinator_address"] or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
  count = dist["num_processes"] or int(os.environ.get("JAX_NUM_PROCESSES", "0"))
  pid = dist["process_id"]
  if pid < 0:
    pid = int(os.environ.get("JAX_PROCESS_ID", "-1"))
  if not address and not dist["auto_detect"]:
    return False
  if not dist["auto_detect"] and (count < 1 or pid < 0):
    raise ValueError(
        f"mesh.distributed: coordinator {address!r} is set but the process count ({count}) or "
        f"this process's id ({pid}) is not; set mesh.distributed.num_processes and "
        f"process_id (or JAX_NUM_PROCESSES and JAX_PROCESS_ID), or auto_detect=True on a "
        f"cluster JAX knows (SLURM, Open MPI)")
  # CPU processes exchange collectives through gloo; GPU backends ignore this setting.
  jax.config.update("jax_cpu_collectives_implementation", dist["cpu_collectives"])
  jax.distributed.initialize(address or None, count if count > 0 else None,
                             pid if pid >= 0 else None)
  return jax.process_count() > 1


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh over `devices` (default: all, of every process) with the named axis sizes (one
  may be -1). With several processes the devices are ordered by process, so that a replica
  slice never spans two processes when the replica axis is a multiple of the process count."""
  if devices is None and jax.process_count() > 1:
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  devices = list(jax.devices() if devices is None else devices)
  sizes = resolve_axis_sizes(axes, len(devices))
  if jax.process_count() > 1:  # jax.make_mesh may reorder devices for the interconnect
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(sizes.values())),
                tuple(sizes.keys()), axis_types=(AxisType.Auto,) * len(sizes))
  return jax.make_mesh(tuple(sizes.values()), tuple(sizes.keys()),
                       axis_types=(AxisType.Auto,) * len(sizes), devices=devices)


def on_mesh(mesh: Mesh | None):
  """`jax.set_mesh(mesh)` for the programs traced inside (None: nothing set). Programs that
  may call the attention kernel are traced so, to run it per shard (kernels.per_shard)."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def is_local(mesh: Mesh) -> bool:
  """Whether every device of `mesh` belongs to this process."""
  return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


def local_slices(slices: Sequence[Mesh]) -> list[int]:
  """Indices of the slices this process drives. Raises if a slice spans processes: its host
  loop would have to be run by several processes in lockstep."""
  for s, m in enumerate(slices):
    owners = {d.process_index for d in m.devices.flat}
    if len(owners) > 1:
      raise ValueError(
          f"replica slice {s} spans processes {sorted(owners)}; make mesh.axes.replica a "
          f"multiple of the process count ({jax.process_count()}) so that each slice sits in "
          f"one process")
  return [s for s, m in enumerate(slices) if is_local(m)]


def data_parallel_size(mesh: Mesh) -> int:
  """Devices a batch's rows are split over: the product of the 'replica' and 'fsdp' axes."""
  return int(np.prod([mesh.shape[a] for a in ("replica", "fsdp") if a in mesh.shape]))


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

  Mesh axes missing from `mesh`, of size 1 or already used by an earlier dimension are
  dropped. When `shape` is given, an axis that does not divide its dimension raises a
  ValueError naming both, unless the rule marks it optional ("tensor?"): it is then dropped,
  e.g. 2 KV heads on a tensor axis of 4 are replicated.
  """
  table = dict(rules)
  used: set[str] = set()
  out = []
  for dim, name in enumerate(logical):
    target = table.get(name) if name is not None else None
    targets = (target,) if isinstance(target, str) else tuple(target or ())
    kept = []
    size = None if shape is None else shape[dim]
    for marked in targets:
      axis = marked.removesuffix(OPTIONAL)
      if axis not in mesh.shape or axis in used or mesh.shape[axis] == 1:
        continue
      n = mesh.shape[axis]
      prod = math.prod(mesh.shape[a] for a in kept) * n
      if size is not None and size % prod:
        if marked.endswith(OPTIONAL):
          continue
        raise ValueError(
            f"mesh axis {axis!r} ({n} devices{f', after {kept}' if kept else ''}) does not "
            f"divide dimension {dim} ('{name}', size {size}) of an array of shape "
            f"{tuple(shape)}; choose mesh.axes sizes whose product divides {size}, or mark "
            f"the rule optional, ('{name}', '{axis}{OPTIONAL}') in mesh.rules / "
            f"mesh.rollout_rules, to replicate that dimension over '{axis}' instead")
      kept.append(axis)
    used.update(kept)
    out.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
  return PartitionSpec(*out)


def row_axes(mesh, rows: int, rules=DEFAULT_RULES) -> tuple[str, ...]:
  """The axes of `mesh` (a Mesh or AbstractMesh) that split `rows` rows: the `batch` rule's,
  as far as they divide."""
  entry = logical_to_mesh_spec(PartitionSpec("batch"), (rows,), mesh, rules)[0]
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def constrain_rows(x: jax.Array) -> jax.Array:
  """x [B, ...] with its rows split over the axes that split rows (`row_axes`) and the rest
  whole, on the mesh the program is traced under (`on_mesh`); x as it is without a mesh or
  without such axes. The model puts its activations so: with FSDP weights, XLA's sharding
  propagation would otherwise follow the weights (split the hidden dimension) and compute
  every row on every device, the float32 logits included."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  rows = row_axes(mesh, x.shape[0])
  if not rows:
    return x
  spec = PartitionSpec(rows if len(rows) > 1 else rows[0], *([None] * (x.ndim - 1)))
  return jax.lax.with_sharding_constraint(x, spec)


def logical_shardings(logical_tree, mesh: Mesh, rules=DEFAULT_RULES, shapes=None):
  """A pytree of NamedSharding for a pytree of logical PartitionSpecs (optionally with shapes,
  a matching pytree of arrays or ShapeDtypeStructs used for the divisibility check; its
  error then names the leaf)."""
  is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
  if shapes is None:
    return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_mesh_spec(s, None, mesh, rules)),
                        logical_tree, is_leaf=is_spec)

  def sharding(path, s, x):
    try:
      return NamedSharding(mesh, logical_to_mesh_spec(s, x.shape, mesh, rules))
    except ValueError as e:
      raise ValueError(f"{jax.tree_util.keystr(path)}: {e}") from None
  return jax.tree_util.tree_map_with_path(sharding, logical_tree, shapes, is_leaf=is_spec)


def shard_pytree(tree, logical_tree, mesh: Mesh, rules=DEFAULT_RULES):
  """Places every array of `tree` with the sharding its logical axes ask for on `mesh`."""
  return to_mesh(tree, logical_shardings(logical_tree, mesh, rules, shapes=tree))


def to_mesh(tree, shardings):
  """`jax.device_put(tree, shardings)` that also works across processes:

  - an array of the global mesh onto a slice of this process: the slice's devices already
    hold a full copy (the array is not sharded over `replica`), which becomes the result
    without moving data;
  - a process-local array (or host data, the same on every process) onto the global mesh:
    each process places its own shards (the array goes through the host, once: loading);
  - anything within one process: jax.device_put.
  """
  return jax.tree.map(_to_sharding, tree, shardings)


def _to_sharding(x, sharding):
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if sharding.is_fully_addressable:
      return jax.device_put(_local_copy(x, sharding.mesh), sharding)
    return jax.device_put(x, sharding)
  if isinstance(x, jax.Array) and not sharding.is_fully_addressable:
    x = np.asarray(x)
  return jax.device_put(x, sharding)


def _local_copy(x: jax.Array, mesh: Mesh) -> jax.Array:
  """The copy of global array `x` that the devices of `mesh` (a slice of x's mesh, local to
  this process) hold, as an array on `mesh`."""
  spec = getattr(x.sharding, "spec", None)
  axes = {a for entry in (spec or ()) for a in (entry if isinstance(entry, tuple) else (entry,))}
  if spec is None or REPLICA_AXIS in axes:
    raise ValueError(f"an array sharded as {x.sharding} has no full copy on one replica slice; "
                     f"only arrays not split over '{REPLICA_AXIS}' can move to a slice")
  devices = set(mesh.devices.flat)
  shards = [s.data for s in x.addressable_shards if s.device in devices]
  return jax.make_array_from_single_device_arrays(x.shape, NamedSharding(mesh, spec), shards)


def to_slices(tree, logical_tree, mesh: Mesh, slice_ids: Sequence[int], rules=ROLLOUT_RULES
              ) -> list:
  """tree (any layout on `mesh`, or host data) as one copy per replica slice in the layout
  `rules` give: one reshard on the whole mesh (XLA's collectives, across processes too),
  then each slice's devices' shards taken as an array on that slice, without moving data.

  Returns a list over every slice of `mesh`: the copy for the ids in `slice_ids` (this
  process's slices), None for the others. `rules` must not split a leaf over `replica`
  (each slice needs a whole copy).
  """
  on_mesh = to_mesh(tree, logical_shardings(logical_tree, mesh, rules, tree))
  return [jax.tree.map(lambda x, m=m: _local_copy(x, m), on_mesh) if s in slice_ids else None
          for s, m in enumerate(replica_slices(mesh))]


def stack_slices(trees: Mapping[int, object], mesh: Mesh):
  """One array per leaf with a leading [replica] axis from per-slice pytrees.

  trees: slice index -> pytree placed on that slice of `mesh` (this process's slices; every
  process passes its own). The result is a global array sharded over `replica`, assembled
  from the slices' buffers, so a jitted reduction over axis 0 combines the slices' values
  with one collective.
  """
  slices = replica_slices(mesh)
  ordered = [trees[s] for s in sorted(trees)]

  def stack(*leaves):
    spec = leaves[0].sharding.spec
    sharding = NamedSharding(mesh, PartitionSpec(REPLICA_AXIS, *spec))
    shards = [jnp.expand_dims(sh.data, 0) for x in leaves for sh in x.addressable_shards]
    return jax.make_array_from_single_device_arrays((len(slices),) + leaves[0].shape,
                                                    sharding, shards)
  return jax.tree.map(stack, *ordered)


def host_copy(tree):
  """numpy copies of a pytree's arrays. Arrays that span processes are all-gathered, so every
  process must call this at the same point of the program."""
  if all(x.is_fully_addressable for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)):
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)
