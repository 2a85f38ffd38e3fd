"""RL algorithms behind one interface (`base.Grpo` documents it, and how to add one): GRPO,
DAPO, Dr. GRPO and GSPO; `rl.algorithm` selects one and `rl.<name>` holds its own knobs."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tlt_jax.knobs import build_from
from tlt_jax.rl.algorithms.base import Grpo
from tlt_jax.rl.algorithms.dapo import Dapo, DapoSettings
from tlt_jax.rl.algorithms.dr_grpo import DrGrpo
from tlt_jax.rl.algorithms.gspo import Gspo, GspoSettings
from tlt_jax.rl.grpo import SHARED_KNOBS, GrpoConfig

ALGORITHMS = {"grpo": Grpo, "dapo": Dapo, "dr_grpo": DrGrpo, "gspo": Gspo}


def make_algorithm(name: str, loss: GrpoConfig, max_new_tokens: int,
                   settings: Mapping | None = None) -> Grpo:
  """The algorithm rl.algorithm=`name`; loss: the shared rl.* knobs; settings: its section
  rl.<name> (None: defaults). ValueError (one line) for an unknown name, or a shared knob the
  algorithm does not read set away from its default."""
  if name not in ALGORITHMS:
    raise ValueError(f"rl.algorithm={name!r} is not allowed; allowed values: {tuple(ALGORITHMS)}")
  cls = ALGORITHMS[name]
  check_shared_knobs(name, cls, loss)
  return cls(loss=loss, max_new_tokens=max_new_tokens,
             settings=cls.Settings() if settings is None else build_from(cls.Settings, settings))


def check_shared_knobs(name: str, cls: type, loss: GrpoConfig) -> None:
  """ValueError naming the first shared knob that algorithm `cls` (rl.algorithm=`name`) does
  not read but `loss` sets away from its default: a run must not look as if it used it."""
  unknown = set(cls.reads) - set(SHARED_KNOBS)
  if unknown:  # a typo in an algorithm's declaration
    raise ValueError(f"rl.algorithm={name!r} declares shared knobs that do not exist: "
                     f"{sorted(unknown)}; the shared knobs are {SHARED_KNOBS}")
  defaults = GrpoConfig()
  for knob in SHARED_KNOBS:
    value, default = getattr(loss, knob), getattr(defaults, knob)
    if knob not in cls.reads and value != default:
      own = f" and its own rl.{name}.*" if dataclasses.fields(cls.Settings) else ""
      reads = ", ".join(f"rl.{k}" for k in cls.reads) or "none of them"
      raise ValueError(f"rl.{knob}={value!r} is ignored by rl.algorithm={name!r} (of the shared "
                       f"loss knobs it reads {reads}{own}); leave rl.{knob} at its default "
                       f"{default!r} or choose another rl.algorithm")


__all__ = ["ALGORITHMS", "Dapo", "DapoSettings", "DrGrpo", "Grpo", "Gspo", "GspoSettings",
           "check_shared_knobs", "make_algorithm"]
