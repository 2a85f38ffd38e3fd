"""Reward functions: `fn(prompts, completions, **columns) -> list[float]`.

`columns` are per-example data set columns, each a list as long as `completions` (e.g.
`answer=[...]`); a function takes what it needs and ignores the rest, so any set of them can be
summed with `combine_rewards`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from tlt_jax.rl.answers import answers_match, extract_answer, parse_number

RewardFn = Callable[..., list[float]]

# The built-in task's final line; the answer must be a plain number.
_FINAL_LINE = re.compile(r"^#### (\S+)$")


def make_answer_reward(fallback: bool = False) -> RewardFn:
  """The answer reward: 1.0 when the completion's final answer, stated in the task's format
  ('#### x' or '\\boxed{x}', `extract_answer`), matches `answer`, else 0.0: a response that
  skips the format earns nothing, even when its last number is right. fallback=True also takes
  a format-less response's last number (for a model that was never taught the format, e.g. a
  pretrained instruct model on the built-in task)."""

  def answer_reward(prompts: Sequence[str], completions: Sequence[str], *,
                    answer: Sequence[str], **columns) -> list[float]:
    del prompts, columns
    if len(answer) != len(completions):
      raise ValueError(f"reward column 'answer' has {len(answer)} entries for "
                       f"{len(completions)} completions; pass one entry per completion")
    return [float(answers_match(extract_answer(c, fallback=fallback), a))
            for c, a in zip(completions, answer)]

  answer_reward.__name__ = "answer_reward_or_last_number" if fallback else "answer_reward"
  return answer_reward


answer_reward = make_answer_reward()


def make_format_reward(bonus: float = 0.1) -> RewardFn:
  """A reward of `bonus` when the completion ends with a well-formed '#### <number>' line."""

  def format_reward(prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
    del prompts, columns
    out = []
    for c in completions:
      lines = c.rstrip().splitlines()
      m = _FINAL_LINE.match(lines[-1]) if lines else None
      out.append(bonus if m and parse_number(m.group(1)) is not None else 0.0)
    return out

  format_reward.__name__ = f"format_reward_{bonus:g}"
  return format_reward


format_reward = make_format_reward(0.1)


def combine_rewards(*fns: RewardFn, weights: Sequence[float] | None = None) -> RewardFn:
  """One reward function returning sum_i weights[i] * fns[i](...) per completion."""
  if not fns:
    raise ValueError("combine_rewards needs at least one reward function")
  weights = [1.0] * len(fns) if weights is None else list(weights)
  if len(weights) != len(fns):
    raise ValueError(f"combine_rewards got {len(fns)} functions but {len(weights)} weights")

  def combined(prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
    total = [0.0] * len(completions)
    for fn, w in zip(fns, weights):
      values = fn(prompts, completions, **columns)
      if len(values) != len(completions):
        raise ValueError(f"reward {getattr(fn, '__name__', fn)!r} returned {len(values)} "
                         f"values for {len(completions)} completions")
      total = [t + w * v for t, v in zip(total, values)]
    return total

  return combined


REWARDS = ("answer", "answer+format")


def make_reward(name: str, format_bonus: float = 0.1, answer_fallback: bool = False,
                task=None) -> RewardFn:
  """A reward by name: 'answer' (1 for a correct final answer; answer_fallback: a response
  without the format is judged by its last number, `make_answer_reward`) or 'answer+format'
  (plus format_bonus for a well-formed final line). task: a `tlt_jax.rl.tasks.Task` whose
  `answer_reward` and `format_reward` judge instead ('####' answers when None)."""
  if name not in REWARDS:
    raise ValueError(f"rl.reward={name!r} is not allowed; allowed values: {REWARDS}")
  if format_bonus < 0:
    raise ValueError(f"rl.format_bonus={format_bonus} must be >= 0")
  answer_of, format_of = ((make_answer_reward, make_format_reward) if task is None else
                          (task.answer_reward, task.format_reward))
  answer = answer_of(answer_fallback)
  return answer if name == "answer" else combine_rewards(answer, format_of(format_bonus))
