"""Multi-step arithmetic word problems with a line-per-step solution and a verifiable answer.

  prompt:   "Start with 7. Add 5. Multiply by 3. Subtract 4. What is the result?"
  solution: "7+5=12\n12*3=36\n36-4=32\n#### 32"

Built so that a tiny model can learn it and still has room to improve: every intermediate value
stays in [0, max_value] (an operation is only drawn when its result stays in range, so there is
no modular wrap-around to learn), operands are small, and each line repeats the previous result,
so one step only needs the line above and the matching instruction. The number of operations is
heavy-tailed (see `sample_num_ops`), so solution lengths are long-tailed like reasoning
rollouts: most problems take a few lines, a few take ten times as many, and accuracy falls with
length because every step is a chance to slip.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar

import numpy as np

from tlt_jax.knobs import build_from
from tlt_jax.rl.tasks.base import Task, register_task
from tlt_jax.rl.tasks.example import Example

OPS = ("add", "subtract", "multiply")
_SYMBOL = {"add": "+", "subtract": "-", "multiply": "*"}
_WORDS = {"add": "Add {k}.", "subtract": "Subtract {k}.", "multiply": "Multiply by {k}."}
_APPLY = {"add": operator.add, "subtract": operator.sub, "multiply": operator.mul}


def sample_num_ops(rng: np.random.Generator, min_ops: int, max_ops: int, body_p: float,
                   tail_prob: float, tail_alpha: float) -> int:
  """A number of operations from a truncated geometric body mixed with a truncated Zipf tail.

  With probability 1 - tail_prob: min_ops + Geometric(body_p) - 1 (mean about 1 / body_p
  above min_ops - 1); with probability tail_prob: n in [min_ops, max_ops] with
  P(n) proportional to (n - min_ops + 1) ** -tail_alpha. Both are cut at max_ops
  (geometric draws past it are redrawn, so the cap does not pile up mass at max_ops)."""
  if rng.random() < tail_prob:
    support = np.arange(min_ops, max_ops + 1)
    weights = (support - min_ops + 1.0) ** -tail_alpha
    return int(rng.choice(support, p=weights / weights.sum()))
  while True:
    n = min_ops + int(rng.geometric(body_p)) - 1
    if n <= max_ops:
      return n


@register_task("arithmetic")
@dataclasses.dataclass(frozen=True)
class ArithmeticTask(Task):
  """Generator of arithmetic chains; held-out accuracy is broken down by number of operations.

  Attributes:
    seed: the data set's seed; problem i depends only on (seed, i), so a data set is a seed
      plus a range of indices: resumable, shardable, and the same on every machine.
    min_ops, max_ops: bounds on the number of operations.
    body_p, tail_prob, tail_alpha: the operation-count distribution (`sample_num_ops`).
    max_value: every value (start, intermediate, answer) is in [0, max_value].
    max_operand: add/subtract operands are in [1, max_operand].
    max_multiplier: multiply operands are in [2, max_multiplier].
    instruction: a sentence appended to every prompt ('' = none), e.g. how to state the answer
      for a model that was not fine-tuned on the task.
    ops: the operations drawn (of "add", "subtract", "multiply"): fewer make easier problems
      for a model that was never taught the task.
  """
  seed: int = 0
  min_ops: int = 1
  max_ops: int = 24
  body_p: float = 0.4
  tail_prob: float = 0.1
  tail_alpha: float = 0.5
  max_value: int = 99
  max_operand: int = 9
  max_multiplier: int = 5
  instruction: str = ""
  ops: tuple[str, ...] = OPS
  breakdown_name: ClassVar[str] = "ops"

  def __post_init__(self):
    object.__setattr__(self, "ops", tuple(self.ops))  # a config's list reads as a tuple
    if not self.ops or any(op not in OPS for op in self.ops) or len(set(self.ops)) < len(
        self.ops):
      raise ValueError(f"task.ops={self.ops} must name each operation at most once, from {OPS}")
    if not 1 <= self.min_ops <= self.max_ops:
      raise ValueError(f"task operations: need 1 <= min_ops <= max_ops, got min_ops="
                       f"{self.min_ops}, max_ops={self.max_ops}")
    if not 0.0 < self.body_p <= 1.0:
      raise ValueError(f"task.body_p={self.body_p} must be in (0, 1]")
    if not 0.0 <= self.tail_prob <= 1.0:
      raise ValueError(f"task.tail_prob={self.tail_prob} must be in [0, 1]")
    if self.tail_alpha < 0:
      raise ValueError(f"task.tail_alpha={self.tail_alpha} must be >= 0")
    if self.max_operand < 1 or self.max_multiplier < 2:
      raise ValueError(f"task operands: need max_operand >= 1 and max_multiplier >= 2, got "
                       f"{self.max_operand} and {self.max_multiplier}")
    if self.max_value < max(self.max_operand, 2 * self.max_multiplier):
      raise ValueError(f"task.max_value={self.max_value} is too small for the operands; use at "
                       f"least {max(self.max_operand, 2 * self.max_multiplier)}")

  @classmethod
  def from_config(cls, task, seed: int) -> ArithmeticTask:
    """From the config's task section (its top-level keys are this task's)."""
    return build_from(cls, task, seed=seed)

  def breakdown(self, example: Example):
    return example.metadata.get("num_ops")

  def _allowed(self, value: int) -> list[tuple[str, int]]:
    """Every (op, operand) of task.ops whose result stays in [0, max_value]."""
    out = [("add", k) for k in range(1, self.max_operand + 1) if value + k <= self.max_value]
    out += [("subtract", k) for k in range(1, self.max_operand + 1) if value - k >= 0]
    out += [("multiply", k) for k in range(2, self.max_multiplier + 1)
            if value * k <= self.max_value]
    return [(op, k) for op, k in out if op in self.ops]

  def example(self, index: int) -> Example:
    """Problem number `index` (any int >= 0) of this task."""
    if index < 0:
      raise ValueError(f"example index must be >= 0, got {index}")
    rng = np.random.default_rng([self.seed, index])
    n = sample_num_ops(rng, self.min_ops, self.max_ops, self.body_p, self.tail_prob,
                         self.tail_alpha)
    while True:  # with some operations left out, a chain can run out of room: draw again
      value = int(rng.integers(0, self.max_value + 1))
      words, lines = [f"Start with {value}."], []
      for _ in range(n):
        # Pick the operation first, then its operand, so that the operations are about
        # equally common whatever the current value allows.
        allowed = self._allowed(value)
        if not allowed:
          break
        ops = sorted({op for op, _ in allowed}, key=OPS.index)
        op = ops[int(rng.integers(len(ops)))]
        ks = [k for o, k in allowed if o == op]
        k = ks[int(rng.integers(len(ks)))]
        new = apply_op(value, op, k)
        words.append(_WORDS[op].format(k=k))
        lines.append(f"{value}{_SYMBOL[op]}{k}={new}")
        value = new
      if len(lines) == n:
        break
    words += ["What is the result?"] + [self.instruction] * bool(self.instruction)
    solution = "\n".join(lines + [f"#### {value}"])
    return Example(prompt=" ".join(words), answer=str(value), solution=solution,
                   metadata={"task": "arithmetic", "seed": self.seed, "index": index, "num_ops": n})

  def longest_prompts(self) -> list[str]:
    """Prompts at least as long as any this task makes, one per operation: max_ops of
    it with the widest start value and operand. Not problems the task draws (a chain may leave
    [0, max_value]); the longest tokenization of the three bounds its prompts' token counts
    for tokenizers that split words apart before merging (byte-level BPEs such as Qwen's and
    this project's)."""
    widest = {"add": self.max_operand, "subtract": self.max_operand,
              "multiply": self.max_multiplier}
    return [" ".join([f"Start with {self.max_value}."]
                     + [_WORDS[op].format(k=widest[op])] * self.max_ops
                     + ["What is the result?"] + [self.instruction] * bool(self.instruction))
            for op in OPS]


def apply_op(value: int, op: str, operand: int) -> int:
  """The result of one step; raises ValueError for an unknown op."""
  if op not in _APPLY:
    raise ValueError(f"unknown op {op!r}; allowed: {OPS}")
  return _APPLY[op](value, operand)


@dataclasses.dataclass(frozen=True)
class TaskSlice:
  """Problems [start, start + size) of a task as a lazy sequence (generated on access), so a
  data set of millions of problems costs nothing until it is read."""
  task: Task
  size: int
  start: int = 0

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, i: int) -> Example:
    if not -self.size <= i < self.size:
      raise IndexError(f"index {i} out of range for {self.size} problems")
    return self.task.example(self.start + (i % self.size))
