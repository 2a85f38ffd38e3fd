"""RL algorithms behind one interface (`base.Grpo` documents it): GRPO and DAPO.

A new algorithm is a module here (a frozen dataclass, usually a `Grpo` subclass, with its
knobs in a `Settings` dataclass) and its line in `ALGORITHMS`; `rl.algorithm` selects it and
`rl.<name>` holds its knobs.
"""

from __future__ import annotations

from collections.abc import Mapping

from tlt_jax.knobs import build_from
from tlt_jax.rl.algorithms.base import Grpo
from tlt_jax.rl.algorithms.dapo import Dapo, DapoSettings
from tlt_jax.rl.grpo import GrpoConfig

ALGORITHMS = {"grpo": Grpo, "dapo": Dapo}


def make_algorithm(name: str, loss: GrpoConfig, max_new_tokens: int,
                   settings: Mapping | None = None) -> Grpo:
  """The algorithm `name` (rl.algorithm) with the loss settings and its own knobs
  (`settings`: its config section rl.<name>; None = the defaults)."""
  if name not in ALGORITHMS:
    raise ValueError(f"rl.algorithm={name!r} is not allowed; allowed values: "
                     f"{tuple(ALGORITHMS)}")
  cls = ALGORITHMS[name]
  return cls(loss=loss, max_new_tokens=max_new_tokens,
             settings=cls.Settings() if settings is None else build_from(cls.Settings, settings))


__all__ = ["ALGORITHMS", "Dapo", "DapoSettings", "Grpo", "make_algorithm"]
