"""What a task is to the jobs: a frozen dataclass that gives problems by index (a pure
function of (seed, index)), prompts for the start-of-job length check, its answer check (a
RewardFn in [0, 1]), its format bonus, and what the held-out accuracy is broken down by.

The defaults below judge '#### x' / '\\boxed{x}' answers by `answers_match` (the built-in
task's and the data files' format). A task's knobs are its `Settings` dataclass, whose fields
and defaults make the config section `task.<name>`; `from_config(task_section, seed)` builds
the task, and adding one is a class decorated `@register_task("name")` (it joins `TASKS`), in
the package or in a module of your own that the config's `plugins` names.
"""

from __future__ import annotations

from typing import ClassVar

from tlt_jax.knobs import NoSettings
from tlt_jax.registry import register
from tlt_jax.rl.rewards import RewardFn, make_answer_reward, make_format_reward
from tlt_jax.rl.tasks.example import Example

# How many problems a task without a bound on its prompts measures for the length check.
PROMPTS_MEASURED = 256

# name -> task class (task.name), filled by `register_task`
TASKS: dict[str, type] = {}


def register_task(name: str):
  """Class decorator: registers a `Task` subclass as task.name=`name` (its knobs: the section
  task.<name>); ValueError for a name already registered."""
  return register(TASKS, name, "task")


class Task:
  """The interface (see the module docstring), with '####'-answer defaults."""
  Settings: ClassVar[type] = NoSettings
  breakdown_name: ClassVar[str] = "source"

  def example(self, index: int) -> Example:
    """Problem `index`, a pure function of (seed, index)."""
    raise NotImplementedError

  def examples(self, count: int, start: int = 0) -> list[Example]:
    """Problems start, start + 1, ..., start + count - 1."""
    return [self.example(i) for i in range(start, start + count)]

  def longest_prompts(self) -> list[str]:
    """Prompts for the length check: here those of the first PROMPTS_MEASURED problems."""
    return [ex.prompt for ex in self.examples(PROMPTS_MEASURED)]

  def answer_reward(self, fallback: bool = False) -> RewardFn:
    """1.0 for a response whose '#### x' / '\\boxed{x}' answer matches (fallback: a response
    without one is judged by its last number)."""
    return make_answer_reward(fallback)

  def format_reward(self, bonus: float) -> RewardFn:
    """`bonus` for a response ending in a '#### <number>' line."""
    return make_format_reward(bonus)

  def breakdown(self, example: Example):
    """The held-out accuracy's group of `example` (None: not counted in a group)."""
    return example.metadata.get("source")
