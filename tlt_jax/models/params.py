"""Parameter specs: shape, logical axes and initialiser of every weight, in one table per model.

Models are pure functions over plain nested dicts of arrays. A spec tree (the same nesting,
`ParamSpec` leaves) describes them once; `init_from_specs` draws random weights and
`logical_axes_from_specs` gives the PartitionSpec tree that `tlt_jax.mesh` maps to a mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

INIT_STDDEV = 0.02


@dataclasses.dataclass(frozen=True)
class ParamSpec:
  """shape, logical axis names (one per dimension), init: 'normal' (stddev 0.02), 'ones',
  'zeros' or 'index' (int32 0, 1, ..., for a fixed index map that is never trained)."""
  shape: tuple[int, ...]
  axes: tuple[str | None, ...]
  init: str = "normal"

  def __post_init__(self):
    if len(self.shape) != len(self.axes):
      raise ValueError(f"param spec {self.shape} needs one axis name per dimension, got "
                       f"{self.axes}")

  def stacked(self, n: int, axis: str = "layers") -> "ParamSpec":
    """The same weight for n layers, stacked on a new leading axis."""
    return ParamSpec((n, *self.shape), (axis, *self.axes), self.init)


def _is_spec(x) -> bool:
  return isinstance(x, ParamSpec)


def init_from_specs(specs, rng: jax.Array, dtype) -> dict:
  """Random weights for a spec tree (normal(0.02) kernels, unit norms, zero biases)."""
  leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
  keys = jax.random.split(rng, len(leaves))

  def one(spec: ParamSpec, key):
    if spec.init == "index":
      return jnp.arange(spec.shape[0], dtype=jnp.int32)
    if spec.init == "ones":
      return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
      return jnp.zeros(spec.shape, dtype)
    return (INIT_STDDEV * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)
  return jax.tree.unflatten(treedef, [one(s, k) for s, k in zip(leaves, keys)])


def logical_axes_from_specs(specs) -> dict:
  """The PartitionSpec of logical axis names of every weight in a spec tree."""
  return jax.tree.map(lambda s: PartitionSpec(*s.axes), specs, is_leaf=_is_spec)
