"""Reward functions: exact answer, format bonus, composition."""

import pytest

from tlt_jax.rl.rewards import (answer_reward, combine_rewards, format_reward, make_answer_reward,
                                 make_format_reward, make_reward)

PROMPTS = ["p1", "p2", "p3", "p4"]
COMPLETIONS = ["3+4=7\n#### 7", "3+4=8\n#### 8", r"so \boxed{7}", "3+4=7\n#### 7 apples"]
ANSWERS = ["7", "7", "7.0", "7"]


def test_answer_reward():
  assert answer_reward(PROMPTS, COMPLETIONS, answer=ANSWERS) == [1.0, 0.0, 1.0, 0.0]


def test_answer_reward_needs_the_answer_format():
  """A right last number without a '####' line (or a \\boxed{}) earns nothing."""
  assert answer_reward(["p"] * 3, ["3+4=7", "so it is 7", "3+4=7\n#### 7"],
                       answer=["7"] * 3) == [0.0, 0.0, 1.0]


def test_format_reward_needs_a_final_hash_line_with_a_number():
  assert format_reward(PROMPTS, COMPLETIONS, answer=ANSWERS) == [0.1, 0.1, 0.0, 0.0]
  assert make_format_reward(0.5)(["p"], ["#### -1,200\n"]) == [0.5]
  assert format_reward(["p"], [""]) == [0.0]


def test_combined_and_weighted():
  both = combine_rewards(answer_reward, format_reward)
  assert both(PROMPTS, COMPLETIONS, answer=ANSWERS) == pytest.approx([1.1, 0.1, 1.0, 0.0])
  weighted = combine_rewards(answer_reward, format_reward, weights=[2.0, 10.0])
  assert weighted(PROMPTS, COMPLETIONS, answer=ANSWERS) == pytest.approx([3.0, 1.0, 2.0, 0.0])


def test_mismatched_columns_are_named():
  with pytest.raises(ValueError, match="column 'answer' has 1 entries for 4 completions"):
    answer_reward(PROMPTS, COMPLETIONS, answer=["7"])
  with pytest.raises(ValueError, match="2 functions but 1 weights"):
    combine_rewards(answer_reward, format_reward, weights=[1.0])


def test_answer_fallback_judges_a_formatless_response_by_its_last_number():
  """What a pretrained instruct model answers (configs/smollm2.py): no '####' line. The
  stated format still wins over a later number."""
  completions = ["The result is 7.", "6 + 1 = 7, so 8", "7", "Add 1 to 6.", "#### 7\nthen 9"]
  fallback = make_answer_reward(fallback=True)
  assert fallback(["p"] * 5, completions, answer=["7"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
  assert answer_reward(["p"] * 5, completions, answer=["7"] * 5) == [0.0] * 4 + [1.0]
  assert make_reward("answer", answer_fallback=True)(
      ["p"] * 5, completions, answer=["7"] * 5) == [1.0, 0.0, 1.0, 0.0, 1.0]
