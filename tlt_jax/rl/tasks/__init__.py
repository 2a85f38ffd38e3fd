"""Tasks behind one interface (`base.Task` documents it): the built-in arithmetic chains and
reasoning_gym's procedural problems.

A new task is a module here (a frozen dataclass subclassing `Task`, with `from_config` and its
knobs in a `Settings` dataclass) and its line in `TASKS`; `task.name` selects it and
`task.<name>` holds its knobs.
"""

from __future__ import annotations

from tlt_jax.rl.tasks.arithmetic import ArithmeticTask, TaskSlice, sample_num_ops
from tlt_jax.rl.tasks.base import Task
from tlt_jax.rl.tasks.example import Example
from tlt_jax.rl.tasks.reasoning_gym import ReasoningGymSettings, ReasoningGymTask

TASKS = {"arithmetic": ArithmeticTask, "reasoning_gym": ReasoningGymTask}


def make_task(task, seed: int) -> Task:
  """The task the config's task section names (task.name), for problems of `seed`."""
  if task.name not in TASKS:
    raise ValueError(f"task.name={task.name!r} is not allowed; allowed values: {tuple(TASKS)}")
  return TASKS[task.name].from_config(task, seed)


__all__ = ["ArithmeticTask", "Example", "ReasoningGymSettings", "ReasoningGymTask", "TASKS",
           "Task", "TaskSlice", "make_task", "sample_num_ops"]
