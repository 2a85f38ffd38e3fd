"""RL algorithms behind one interface (`base.Grpo` documents it, and how to add one): GRPO
and DAPO; `rl.algorithm` selects one and `rl.<name>` holds its knobs."""

from __future__ import annotations

from collections.abc import Mapping

from tlt_jax.knobs import build_from
from tlt_jax.rl.algorithms.base import Grpo
from tlt_jax.rl.algorithms.dapo import Dapo, DapoSettings
from tlt_jax.rl.grpo import GrpoConfig

ALGORITHMS = {"grpo": Grpo, "dapo": Dapo}


def make_algorithm(name: str, loss: GrpoConfig, max_new_tokens: int,
                   settings: Mapping | None = None) -> Grpo:
  """The algorithm rl.algorithm=`name`; settings: its section rl.<name> (None: defaults)."""
  if name not in ALGORITHMS:
    raise ValueError(f"rl.algorithm={name!r} is not allowed; allowed values: {tuple(ALGORITHMS)}")
  cls = ALGORITHMS[name]
  return cls(loss=loss, max_new_tokens=max_new_tokens,
             settings=cls.Settings() if settings is None else build_from(cls.Settings, settings))


__all__ = ["ALGORITHMS", "Dapo", "DapoSettings", "Grpo", "make_algorithm"]
