"""Built-in tasks: generators of `Example`s with verifiable answers."""

from tlt_jax.rl.tasks.arithmetic import ArithmeticTask, TaskSlice, sample_num_steps
from tlt_jax.rl.tasks.example import Example

__all__ = ["ArithmeticTask", "Example", "TaskSlice", "sample_num_steps"]
