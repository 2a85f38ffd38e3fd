"""The policy as one argument: its weights and the config that shapes them."""

from __future__ import annotations

import flax.struct

from tlt_jax.models.config import ModelConfig


@flax.struct.dataclass
class Policy:
  """params: the policy's weights (a pytree, traced); cfg: its ModelConfig (static, part of
  the tree's structure, so a jitted function taking a Policy compiles per config)."""
  params: dict
  cfg: ModelConfig = flax.struct.field(pytree_node=False)
