"""Optimizer state placement shared by every trainer (SFT, GRPO, drafter)."""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def init_optimizer(tx: optax.GradientTransformation, params: dict, mesh: Mesh):
  """(opt_state, its shardings) for params already placed on `mesh`: moments follow their
  params; scalars (step counts), which jit would leave on one device, are replicated."""
  opt_state = jax.jit(tx.init)(params)
  sharding = jax.tree.map(lambda x: x.sharding if isinstance(x.sharding, NamedSharding)
                          and x.sharding.mesh == mesh else NamedSharding(mesh, P()), opt_state)
  return jax.device_put(opt_state, sharding), sharding
