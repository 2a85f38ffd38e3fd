"""Tasks behind one interface (`base.Task` documents it, and how to add one): the built-in
arithmetic chains and reasoning_gym's procedural problems; `task.name` selects one."""

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
