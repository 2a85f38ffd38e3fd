"""The built-in task: deterministic, correct traces, bounded values, long-tailed step counts."""

import re

import numpy as np
import pytest

from tlt_jax.rl.tasks import ArithmeticTask, TaskSlice
from tlt_jax.rl.tasks.arithmetic import apply_op

_LINE = re.compile(r"^(\d+)([+\-*])(\d+)=(\d+)$")
_WORD = {"Add": "+", "Subtract": "-", "Multiply by": "*"}


def _replay(example):
  """Recomputes the answer from the prompt alone, and checks every solution line against it."""
  instructions = re.findall(r"(Add|Subtract|Multiply by) (\d+)\.", example.prompt)
  value = int(re.match(r"Start with (\d+)\.", example.prompt).group(1))
  *lines, final = example.solution.split("\n")
  assert len(lines) == len(instructions) == example.metadata["num_ops"]
  for line, (word, k) in zip(lines, instructions):
    a, sym, b, c = _LINE.match(line).groups()
    assert (int(a), sym, int(b)) == (value, _WORD[word], int(k))
    value = apply_op(value, {"+": "add", "-": "subtract", "*": "multiply"}[sym], int(b))
    assert int(c) == value
  assert final == f"#### {value}"
  return value


def test_same_seed_same_problems_other_seed_other_problems():
  a, b, c = ArithmeticTask(seed=3), ArithmeticTask(seed=3), ArithmeticTask(seed=4)
  assert a.examples(50) == b.examples(50)
  assert a.example(17) == a.examples(1, start=17)[0]  # random access, independent of order
  assert sum(x.prompt == y.prompt for x, y in zip(a.examples(50), c.examples(50))) < 10


def test_answers_recomputed_from_the_trace_and_values_stay_in_range():
  task = ArithmeticTask(seed=0, max_value=99, max_operand=9, max_multiplier=5)
  ops = set()
  for ex in task.examples(300):
    assert str(_replay(ex)) == ex.answer
    values = [int(v) for v in re.findall(r"\d+", ex.solution)]
    assert all(0 <= v <= 99 for v in values)
    ops.update(re.findall(r"[+\-*]", ex.solution))
    assert ex.prompt.endswith("What is the result?")
  assert ops == {"+", "-", "*"}


def test_an_instruction_ends_every_prompt_and_changes_nothing_else():
  plain, told = ArithmeticTask(seed=3), ArithmeticTask(seed=3, instruction="Give the number.")
  for a, b in zip(plain.examples(20), told.examples(20)):
    assert b.prompt == a.prompt + " Give the number."
    assert (b.answer, b.solution, b.metadata) == (a.answer, a.solution, a.metadata)
  assert all(p.endswith("result? Give the number.") for p in told.longest_prompts())


def test_step_counts_are_long_tailed_and_bounded():
  task = ArithmeticTask(seed=0, min_ops=1, max_ops=20)
  steps = np.array([e.metadata["num_ops"] for e in task.examples(3000)])
  assert steps.min() >= 1 and steps.max() <= 20
  median = np.median(steps)
  assert median <= 3
  assert steps.max() >= 8 * median  # a few problems are ~10x longer than the typical one
  assert 0.02 < np.mean(steps >= 10) < 0.2


def test_no_tail_gives_a_light_tail():
  task = ArithmeticTask(seed=0, max_ops=20, tail_prob=0.0, body_p=0.9)
  steps = [e.metadata["num_ops"] for e in task.examples(500)]
  assert max(steps) <= 6


def test_task_slice_is_a_lazy_sequence():
  task = ArithmeticTask(seed=5)
  data = TaskSlice(task, size=10, start=100)
  assert len(data) == 10 and data[0] == task.example(100) and data[-1] == task.example(109)
  with pytest.raises(IndexError):
    data[10]


def test_ops_draw_only_the_operations_named():
  every = ArithmeticTask(seed=2)
  assert every.examples(200) == ArithmeticTask(seed=2, ops=["add", "subtract", "multiply"]
                                               ).examples(200)  # a config's list reads the same
  adds = ArithmeticTask(seed=2, min_ops=1, max_ops=3, max_value=20, max_operand=9, ops=("add",))
  for ex in adds.examples(300):
    assert str(_replay(ex)) == ex.answer and set(re.findall(r"[+\-*]", ex.solution)) == {"+"}
    assert 1 <= ex.metadata["num_ops"] <= 3 and int(ex.answer) <= 20  # chains drawn again


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_ops=3, max_ops=2), "min_ops <= max_ops"),
    (dict(ops=("add", "divide")), "task.ops=.*from \\('add'"),
    (dict(ops=()), "task.ops"),
    (dict(body_p=0.0), "body_p"),
    (dict(max_value=5), "max_value=5 is too small"),
])
def test_bad_task_parameters_are_named(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ArithmeticTask(**kwargs)
