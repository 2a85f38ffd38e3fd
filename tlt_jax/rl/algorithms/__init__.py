"""RL algorithms behind one interface (`base.Algorithm` documents it, and how to add one):
GRPO, DAPO, Dr. GRPO and GSPO, each registered by name (`register_algorithm`); `rl.algorithm`
selects one and `rl.<name>` holds its own knobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tlt_jax.knobs import build_from
from tlt_jax.rl.algorithms.base import ALGORITHMS, Algorithm, register_algorithm
# Imported in this order, they register in it (the config's sections follow it).
from tlt_jax.rl.algorithms.grpo import Grpo
from tlt_jax.rl.algorithms.dapo import Dapo, DapoSettings
from tlt_jax.rl.algorithms.dr_grpo import DrGrpo
from tlt_jax.rl.algorithms.gspo import Gspo, GspoSettings
from tlt_jax.rl.loss import SHARED_KNOBS, LossConfig


def make_algorithm(name: str, loss: LossConfig, max_new_tokens: int,
                   settings: Mapping | None = None, group_size: int | None = None
                   ) -> Algorithm:
  """The algorithm rl.algorithm=`name`; loss: the shared rl.* knobs; settings: its section
  rl.<name> (None: defaults); group_size: rl.num_samples, checked against the algorithm's
  `min_group_size` (None: not checked). ValueError (one line) for an unknown name, too small
  a group, or a shared knob the algorithm does not read set away from its default."""
  if name not in ALGORITHMS:
    raise ValueError(f"rl.algorithm={name!r} is not allowed; allowed values: {tuple(ALGORITHMS)}")
  cls = ALGORITHMS[name]
  if group_size is not None:
    cls.check_group_size(group_size, name)
  check_shared_knobs(name, cls, loss)
  return cls(loss=loss, max_new_tokens=max_new_tokens,
             settings=cls.Settings() if settings is None else build_from(cls.Settings, settings))


def check_shared_knobs(name: str, cls: type, loss: LossConfig) -> None:
  """ValueError naming the first shared knob that algorithm `cls` (rl.algorithm=`name`) does
  not read but `loss` sets away from its default: a run must not look as if it used it."""
  unknown = set(cls.reads) - set(SHARED_KNOBS)
  if unknown:  # a typo in an algorithm's declaration
    raise ValueError(f"rl.algorithm={name!r} declares shared knobs that do not exist: "
                     f"{sorted(unknown)}; the shared knobs are {SHARED_KNOBS}")
  defaults = LossConfig()
  for knob in SHARED_KNOBS:
    value, default = getattr(loss, knob), getattr(defaults, knob)
    if knob not in cls.reads and value != default:
      own = f" and its own rl.{name}.*" if dataclasses.fields(cls.Settings) else ""
      reads = ", ".join(f"rl.{k}" for k in cls.reads) or "none of them"
      raise ValueError(f"rl.{knob}={value!r} is ignored by rl.algorithm={name!r} (of the shared "
                       f"loss knobs it reads {reads}{own}); leave rl.{knob} at its default "
                       f"{default!r} or choose another rl.algorithm")


__all__ = ["ALGORITHMS", "Algorithm", "Dapo", "DapoSettings", "DrGrpo", "Grpo", "Gspo",
           "GspoSettings", "check_shared_knobs", "make_algorithm", "register_algorithm"]
