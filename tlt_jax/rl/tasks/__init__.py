"""Built-in tasks: generators of `Example`s with verifiable answers."""

from tlt_jax.rl.tasks.arithmetic import ArithmeticTask, TaskSlice, sample_num_steps
from tlt_jax.rl.tasks.example import Example

TASKS = {"arithmetic": ArithmeticTask}


def make_task(name: str, **kwargs) -> ArithmeticTask:
  """A built-in task by name (task.name); kwargs go to its constructor, which checks them."""
  if name not in TASKS:
    raise ValueError(f"task.name={name!r} is not allowed; allowed values: {tuple(TASKS)}")
  return TASKS[name](**kwargs)


__all__ = ["ArithmeticTask", "Example", "TASKS", "TaskSlice", "make_task", "sample_num_steps"]
