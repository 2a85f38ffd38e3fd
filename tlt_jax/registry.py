"""Registration of plug-ins (drafters, RL algorithms, tasks) by name: `register` is the one
way a class joins a registry, from the package or from a module of the user's own that the
config's `plugins` names (tlt_jax.plugins). The registries are `tlt_jax.drafters.DRAFTERS`,
`tlt_jax.rl.algorithms.ALGORITHMS` and `tlt_jax.rl.tasks.TASKS`; each family has its own
decorator (`register_drafter`, `register_algorithm`, `register_task`) over this one."""

from __future__ import annotations

from collections.abc import Callable


def register(registry: dict, name: str, what: str) -> Callable[[type], type]:
  """Class decorator: registry[name] = the class, which it returns unchanged. `what` names
  the kind of plug-in in errors. ValueError (one line) for a name that is not an identifier
  (it becomes a config section) or is registered already: two plug-ins must not share one."""
  if not isinstance(name, str) or not name.isidentifier():
    raise ValueError(f"{what} name {name!r} must be an identifier: it names the config "
                     f"section of its knobs")

  def add(cls: type) -> type:
    if name in registry:
      old = registry[name]
      raise ValueError(f"{what} {name!r} is registered already (by {old.__module__}."
                       f"{old.__qualname__}); give {cls.__module__}.{cls.__qualname__} another "
                       f"name")
    registry[name] = cls
    return cls
  return add
