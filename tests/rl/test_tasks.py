"""Tasks (tlt_jax.rl.tasks): the interface's defaults, the reasoning_gym task (problems,
reasoning_gym's scoring through the configured reward, the breakdown, its config checks) and
both through the jobs' components."""

import sys

import numpy as np
import pytest

from tlt_jax.components import (answer_check, reward_from_config, scoring_task,
                                task_from_config, validate_config)
from tlt_jax.config import ConfigError, base_config
from tlt_jax.rl.evaluate import evaluate
from tlt_jax.rl.rewards import answer_reward
from tlt_jax.rl.tasks import (TASKS, ArithmeticTask, ReasoningGymSettings, ReasoningGymTask,
                              Task, TaskSlice)


def _gym_config(**settings):
  config = base_config()
  config.task.name = "reasoning_gym"
  for k, v in settings.items():
    config.task.reasoning_gym[k] = v
  return config


def _score(fn, examples, completions):
  return fn([e.prompt for e in examples], completions, answer=[e.answer for e in examples],
            metadata=[e.metadata for e in examples])


def test_reasoning_gym_problems_are_a_pure_function_of_seed_and_index():
  task = task_from_config(_gym_config())
  again = task_from_config(_gym_config())
  assert task.examples(6, start=10) == again.examples(6, start=10)
  held_out = task_from_config(_gym_config(), eval_split=True)
  assert [e.prompt for e in held_out.examples(20)] != [e.prompt for e in task.examples(20)]
  sources = [e.metadata["source"] for e in task.examples(200)]
  assert set(sources) == {"chain_sum", "leg_counting"}
  assert 60 < sources.count("chain_sum") < 140  # equal weights
  ex = task.example(0)
  assert ex.prompt.endswith("End your response with a line '#### <answer>'.")
  assert ex.solution is None and ex.metadata["index"] == 0
  only = task_from_config(_gym_config(weights=(0.0, 1.0)))
  assert {e.metadata["source"] for e in only.examples(30)} == {"leg_counting"}


def test_reasoning_gym_held_out_problems_are_not_training_problems():
  """reasoning_gym draws problem i from its seed + i: training and held-out data sets seeded
  close together would share problems (with seeds 1009 apart, held-out problem j was training
  problem 1009 + j whenever both drew the same data set)."""
  train = task_from_config(_gym_config())
  held_out = task_from_config(_gym_config(), eval_split=True)
  seen = {e.prompt for e in train.examples(1200)}
  assert not [e.prompt for e in held_out.examples(100) if e.prompt in seen]
  with pytest.raises(ValueError, match=r"example index must be in \[0, 2\*\*32\)"):
    train.example(2**32)


def test_reasoning_gym_chain_lengths_are_long_tailed():
  task = task_from_config(_gym_config(datasets=("chain_sum",)))
  terms = np.array([e.metadata["num_terms"] for e in task.examples(300)])
  assert terms.min() == 2 and terms.max() == 12


def test_reasoning_gym_answers_are_scored_by_its_checker_through_the_reward():
  config = _gym_config()
  task = task_from_config(config)
  examples = task.examples(4)
  right = [f"I count.\n#### {e.answer}" for e in examples]
  wrong = [f"#### {int(e.answer) + 1}" for e in examples]
  unstated = [e.answer for e in examples]  # the answer, but not on a '#### ' line
  reward = reward_from_config(config)  # answer + 0.1 for the format
  assert _score(reward, examples, right) == pytest.approx([1.1] * 4)
  assert _score(reward, examples, wrong) == pytest.approx([0.1] * 4)
  assert _score(reward, examples, unstated) == [0.0] * 4
  config.rl.answer_fallback = True  # a last line without '####' is the stated answer
  assert _score(answer_check(config), examples, unstated) == [1.0] * 4
  assert _score(answer_check(config), examples, wrong) == [0.0] * 4


def test_partial_credit_is_a_reward_but_not_a_right_answer():
  config = _gym_config(datasets=("spell_backward",), options="{}")
  ex = task_from_config(config).example(0)
  almost = "#### " + ex.answer[:-1] + ("a" if ex.answer[-1] != "a" else "b")
  partial = _score(task_from_config(config).answer_reward(), [ex], [almost])[0]
  assert 0 < partial < 1
  assert _score(answer_check(config), [ex], [almost]) == [0.0]


def test_the_breakdown_is_the_task_s_own():
  assert ArithmeticTask().breakdown(ArithmeticTask().example(3)) == \
      ArithmeticTask().example(3).metadata["num_ops"]
  gym = task_from_config(_gym_config())
  assert gym.breakdown(gym.example(0)) == gym.example(0).metadata["source"]
  assert (ArithmeticTask.breakdown_name, ReasoningGymTask.breakdown_name) == ("ops", "dataset")


def test_data_files_score_with_the_interface_defaults(tmp_path):
  config = base_config()
  config.task.data_path = str(tmp_path / "x.jsonl")
  task = scoring_task(config)
  assert type(task) is Task
  ex = ArithmeticTask().example(0)
  assert _score(task.answer_reward(), [ex], [f"#### {ex.answer}"]) == \
      _score(answer_reward, [ex], [f"#### {ex.answer}"]) == [1.0]


@pytest.mark.parametrize("settings,message", [
    (dict(datasets=("chain_sum", "no_such_set")), "data set 'no_such_set'"),
    (dict(datasets=()), "task.reasoning_gym.datasets is empty"),
    (dict(weights=(1.0,)), r"task.reasoning_gym.weights=\(1.0,\) must be one non-negative "
                           r"weight per data set \(2\)"),
    (dict(options="{bad"), "task.reasoning_gym.options is not valid JSON"),
    (dict(options='{"chainsum": {}}'), r"options names \['chainsum'\], which reasoning_gym "
                                       r"does not have"),
    (dict(options='{"chain_sum": {"max_terms": 1}}'), "data set 'chain_sum'"),
])
def test_reasoning_gym_config_errors_name_the_key(settings, message):
  with pytest.raises(ConfigError, match=message):
    validate_config(_gym_config(**settings))


def test_a_missing_reasoning_gym_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if absent
  with pytest.raises(ConfigError, match=r"pip install -e \"\.\[reasoning\]\""):
    validate_config(_gym_config(options="{}", datasets=("leg_counting",)))


def test_every_task_s_settings_are_a_config_section_with_its_defaults():
  config = base_config()
  assert config.task.reasoning_gym.to_dict() == {
      k: v for k, v in vars(ReasoningGymSettings()).items()}
  assert {"arithmetic", "reasoning_gym"} <= set(TASKS)  # and any a plug-in registers
  with pytest.raises(ConfigError, match="task.name='gsm8k' is not allowed"):
    config.task.name = "gsm8k"
    validate_config(config)


def test_sft_refuses_a_task_without_solutions(tmp_path):
  from tests.conftest import REPO
  import subprocess
  out = subprocess.run([sys.executable, "-m", "tlt_jax.sft", "--config",
                        "configs/default.py:runlocal", "--config.task.name=reasoning_gym",
                        "--workdir", str(tmp_path)], cwd=REPO, capture_output=True, text=True)
  assert out.returncode != 0
  assert "SFT trains on worked solutions, which task.name='reasoning_gym'" in out.stderr


class _Engine:
  """Answers every problem with its right answer for problems of even index; records each
  call's (temperature, compile_priority)."""

  def __init__(self):
    self.calls = []

  def generate(self, ids, samples, sampling, key, log_requests=(), compile_priority=0):
    from tlt_jax.rollout.engine import RolloutResult
    del ids, key, log_requests
    self.calls.append((sampling.temperature if sampling else None, compile_priority))
    tokens = [[1] if i % 2 == 0 else [2] for i in range(len(self.examples) * samples)]
    return RolloutResult(tokens=tokens, lengths=np.ones(len(tokens), int),
                         finish_reasons=["eos"] * len(tokens), timeline=[], slice_done_s=[],
                         wall_s=0.0, pool={}, feature_blocks=[])


class _Tokenizer:
  def __init__(self, examples):
    self.examples = examples

  def decode(self, tokens, skip_special_tokens=True):
    return "#### right" if tokens == [1] else "#### wrong"

  def apply_chat_template(self, *a, **k):
    return [0]


def test_evaluation_breaks_accuracy_down_by_the_task_s_groups():
  task = TaskSlice(ArithmeticTask(), 4).task
  examples = task.examples(4)
  examples = [type(e)(e.prompt, "right", e.solution, e.metadata) for e in examples]
  engine = _Engine()
  engine.examples = examples
  tokenizer = _Tokenizer(examples)
  result = evaluate(engine, tokenizer, examples, None, breakdown=task.breakdown,
                    answer_fn=lambda p, c, answer, **_: [float(x == "#### right") for x in c])
  steps = [e.metadata["num_ops"] for e in examples]
  expected: dict = {}
  for i, n in enumerate(steps):
    cell = expected.setdefault(n, [0, 0])
    cell[0] += i % 2 == 0
    cell[1] += 1
  assert result["accuracy_by"] == dict(sorted(expected.items()))
  assert result["accuracy"] == 0.5


@pytest.mark.parametrize("sampling", [(1.0, 0), (0.7, 5), (0.0, 0)])
def test_both_evaluations_queue_the_rollouts_programs_to_compile_ahead(sampling):
  """Greedy and sampled evaluation run the rollout's programs (the temperature is their
  argument; greedy keeps the rollout's top-k): both queue the tail's programs behind the
  rollout's (priority 1)."""
  from tlt_jax.rl.evaluate import heldout_accuracy
  from tlt_jax.speculative.sampling import SamplingParams
  temperature, top_k = sampling
  examples = ArithmeticTask().examples(2)
  engine = _Engine()
  engine.examples = examples
  heldout_accuracy(engine, _Tokenizer(examples), examples, SamplingParams(temperature, top_k),
                   2)
  assert engine.calls == [(0.0, 1), (temperature, 1)]
