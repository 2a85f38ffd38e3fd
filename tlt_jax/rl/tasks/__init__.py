"""Tasks behind one interface (`base.Task` documents it, and how to add one): the built-in
arithmetic chains and reasoning_gym's procedural problems, each registered by name
(`register_task`); `task.name` selects one."""

from __future__ import annotations

# Imported in this order, they register in it (the config's sections follow it).
from tlt_jax.rl.tasks.arithmetic import ArithmeticTask, TaskSlice, sample_num_ops
from tlt_jax.rl.tasks.base import TASKS, Task, register_task
from tlt_jax.rl.tasks.example import Example
from tlt_jax.rl.tasks.reasoning_gym import ReasoningGymSettings, ReasoningGymTask


def make_task(task, seed: int) -> Task:
  """The task the config's task section names (task.name), for problems of `seed`."""
  if task.name not in TASKS:
    raise ValueError(f"task.name={task.name!r} is not allowed; allowed values: {tuple(TASKS)}")
  return TASKS[task.name].from_config(task, seed)


__all__ = ["ArithmeticTask", "Example", "ReasoningGymSettings", "ReasoningGymTask", "TASKS",
           "Task", "TaskSlice", "make_task", "register_task", "sample_num_ops"]
