"""Procedural problems from reasoning_gym (optional: pip install -e ".[reasoning]"), scored by
reasoning_gym's own checkers.

A mix of its data sets: problem i of the task is drawn from data set k with probability
weights[k] (a pure function of (seed, i)) and is that data set's problem i. The prompt is the
data set's question and an instruction to end with a '#### <answer>' line (task.instruction
replaces it); the answer on that line goes to the data set's `score_answer`, whose score in
[0, 1] is the reward (partial credit where the data set gives it) and whose 1.0 is a right
answer. The held-out accuracy is broken down by data set. The default mix has long-tailed
solution lengths, like reasoning rollouts (see `ReasoningGymSettings`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from tlt_jax.knobs import build_from
from tlt_jax.rl.answers import extract_hash_answer
from tlt_jax.rl.rewards import RewardFn
from tlt_jax.rl.tasks.base import Task, register_task
from tlt_jax.rl.tasks.example import Example, json_safe

ANSWER_FORMAT = "End your response with a line '#### <answer>'."


@dataclasses.dataclass(frozen=True)
class ReasoningGymSettings:
  """datasets: reasoning_gym data set names; weights: their shares of the problems (empty =
  equal); options: a JSON object {name: {reasoning_gym config key: value}} for their generators
  (the default makes the mix long-tailed; data sets outside the mix are ignored)."""
  datasets: tuple = ("chain_sum", "leg_counting")
  weights: tuple = ()
  options: str = json.dumps({"chain_sum": {"min_terms": 2, "max_terms": 12, "max_digits": 2},
                             "leg_counting": {"min_animals": 2, "max_animals": 15}})

  def __post_init__(self):  # lists from a config file become tuples (the task is hashed)
    object.__setattr__(self, "datasets", tuple(self.datasets))
    object.__setattr__(self, "weights", tuple(float(w) for w in self.weights))


MAX_DATASETS = 1024  # in one mix
SEED_BLOCK = 2 ** 32  # seeds (so problems) of one data set of one task seed; blocks never meet


def dataset_seed(task_seed: int, position: int) -> int:
  """The reasoning_gym seed of data set `position` of the task seeded `task_seed`. reasoning_gym
  draws problem i from seed + i, so data sets whose seeds lie closer than the problems drawn
  share problems (held-out ones would be training ones): each gets a block of SEED_BLOCK seeds."""
  return (task_seed * MAX_DATASETS + position) * SEED_BLOCK


def _import_reasoning_gym():
  try:
    import reasoning_gym
  except ImportError:
    raise ImportError("task.name='reasoning_gym' needs the optional 'reasoning-gym' package: "
                      "pip install -e \".[reasoning]\" (or pip install reasoning-gym)") from None
  return reasoning_gym


@register_task("reasoning_gym")
@dataclasses.dataclass(frozen=True)
class ReasoningGymTask(Task):
  """A mix of reasoning_gym data sets (see the module docstring)."""
  Settings: ClassVar[type] = ReasoningGymSettings
  breakdown_name: ClassVar[str] = "dataset"
  seed: int = 0
  settings: ReasoningGymSettings = ReasoningGymSettings()
  instruction: str = ""
  size: int = 1_000_000

  def __post_init__(self):
    s = self.settings
    if not s.datasets:
      raise ValueError("task.reasoning_gym.datasets is empty; name at least one reasoning_gym "
                       "data set, e.g. ('chain_sum',)")
    if len(s.datasets) > MAX_DATASETS:
      raise ValueError(f"task.reasoning_gym.datasets names {len(s.datasets)} data sets; at most "
                       f"{MAX_DATASETS} fit in one mix")
    if s.weights and (len(s.weights) != len(s.datasets) or min(s.weights) < 0
                      or sum(s.weights) <= 0):
      raise ValueError(f"task.reasoning_gym.weights={tuple(s.weights)} must be one "
                       f"non-negative weight per data set ({len(s.datasets)}), not all 0")
    try:
      options = json.loads(s.options)
    except json.JSONDecodeError as e:
      raise ValueError(f"task.reasoning_gym.options is not valid JSON ({e.msg})") from None
    if not isinstance(options, dict):
      raise ValueError("task.reasoning_gym.options must be a JSON object {data set: {...}}")
    if unknown := sorted(set(options) - set(_import_reasoning_gym().factory.DATASETS)):
      raise ValueError(f"task.reasoning_gym.options names {unknown}, which reasoning_gym does "
                       f"not have (options for data sets outside the mix are ignored)")
    self._datasets()  # unknown names and bad options fail here, not at the first problem

  @classmethod
  def from_config(cls, task, seed: int) -> ReasoningGymTask:
    """From the config's task section (task.reasoning_gym and task.instruction)."""
    return cls(seed=seed, instruction=task.instruction,
               settings=build_from(ReasoningGymSettings, task.reasoning_gym))

  @functools.cache
  def _datasets(self) -> dict[str, Any]:
    """{name: reasoning_gym data set}, each seeded by `dataset_seed`."""
    rg = _import_reasoning_gym()
    options = json.loads(self.settings.options)
    out = {}
    for k, name in enumerate(self.settings.datasets):
      try:
        out[name] = rg.create_dataset(name, size=self.size, seed=dataset_seed(self.seed, k),
                                      **options.get(name, {}))
      except (ValueError, TypeError, AssertionError, KeyError) as e:  # name, option, range
        raise ValueError(f"task.reasoning_gym: data set {name!r}: {e}") from None
    return out

  def example(self, index: int) -> Example:
    """Problem `index` (any int in [0, SEED_BLOCK): reasoning_gym draws problem i from seed +
    i, so `size`, the data sets' nominal length, is not a bound)."""
    if not 0 <= index < SEED_BLOCK:
      raise ValueError(f"example index must be in [0, 2**32), got {index}")
    names = self.settings.datasets
    weights = np.asarray(self.settings.weights or [1.0] * len(names), np.float64)
    rng = np.random.default_rng([self.seed, index])
    name = names[int(rng.choice(len(names), p=weights / weights.sum()))]
    entry = self._datasets()[name][index]
    meta = {k: v for k, v in dict(entry.get("metadata") or {}).items() if json_safe(v)}
    meta.update(source=name, index=index)
    prompt = f"{entry['question']}\n{self.instruction or ANSWER_FORMAT}"
    return Example(prompt=prompt, answer=str(entry["answer"]), metadata=meta)

  def stated_answer(self, completion: str, fallback: bool) -> str | None:
    """The answer a response states on its '#### ' line (fallback: else its last line)."""
    found = extract_hash_answer(completion)
    if found is None and fallback:
      lines = [line for line in completion.strip().splitlines() if line.strip()]
      found = lines[-1].strip() if lines else None
    return found

  def answer_reward(self, fallback: bool = False) -> RewardFn:
    """reasoning_gym's score of the stated answer, in [0, 1] (0 when none is stated)."""
    datasets = self._datasets()

    def reasoning_gym_reward(prompts: Sequence[str], completions: Sequence[str], *,
                             answer: Sequence[str], metadata: Sequence[dict],
                             **columns) -> list[float]:
      del prompts, columns
      out = []
      for c, a, meta in zip(completions, answer, metadata, strict=True):
        stated = self.stated_answer(c, fallback)
        out.append(0.0 if stated is None else float(datasets[meta["source"]].score_answer(
            stated, {"answer": a, "metadata": meta})))
      return out

    return reasoning_gym_reward

  def format_reward(self, bonus: float) -> RewardFn:
    """`bonus` for a response with a non-empty '#### ' line."""

    def reasoning_gym_format(prompts, completions, **columns) -> list[float]:
      del prompts, columns
      return [bonus if extract_hash_answer(c) else 0.0 for c in completions]

    return reasoning_gym_format
