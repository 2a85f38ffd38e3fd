"""RL algorithms behind one interface (`base.Algorithm` documents it, and how to add one):
GRPO, DAPO, Dr. GRPO and GSPO, each registered by name (`register_algorithm`); `rl.algorithm`
selects one and `rl.<name>` holds its own knobs."""

from __future__ import annotations

from collections.abc import Mapping

from tlt_jax.knobs import build_from
from tlt_jax.rl.algorithms.base import ALGORITHMS, Algorithm, register_algorithm
# Imported in this order, they register in it (the config's sections follow it).
from tlt_jax.rl.algorithms.grpo import Grpo
from tlt_jax.rl.algorithms.dapo import Dapo, DapoSettings
from tlt_jax.rl.algorithms.dr_grpo import DrGrpo
from tlt_jax.rl.algorithms.gspo import Gspo, GspoSettings
from tlt_jax.rl.loss import LossConfig


def make_algorithm(name: str, loss: LossConfig, max_new_tokens: int,
                   settings: Mapping | None = None, group_size: int | None = None
                   ) -> Algorithm:
  """The algorithm rl.algorithm=`name`; loss: the shared rl.* knobs; settings: its section
  rl.<name> (None: defaults); group_size: rl.num_samples, checked against the algorithm's
  `min_group_size` (None: not checked). ValueError (one line) for an unknown name or too
  small a group. (A config that sets a shared knob the algorithm does not read is refused by
  `tlt_jax.components.unread_knobs`, with every other unread knob.)"""
  if name not in ALGORITHMS:
    raise ValueError(f"rl.algorithm={name!r} is not allowed; allowed values: {tuple(ALGORITHMS)}")
  cls = ALGORITHMS[name]
  if group_size is not None:
    cls.check_group_size(group_size, name)
  return cls(loss=loss, max_new_tokens=max_new_tokens,
             settings=cls.Settings() if settings is None else build_from(cls.Settings, settings))


__all__ = ["ALGORITHMS", "Algorithm", "Dapo", "DapoSettings", "DrGrpo", "Grpo", "Gspo",
           "GspoSettings", "make_algorithm", "register_algorithm"]
