"""JSONL loading (GSM8K / MATH / DAPO records), the prompt-length check, the resumable
iterator."""

import json

import pytest

from tlt_jax.rl.data import PromptIterator, example_from_record, load_examples, load_jsonl
from tlt_jax.rl.tasks import ArithmeticTask

RECORDS = [
    {"question": "Tom has 3 apples and buys 1,200 more. How many?",
     "answer": "He has 3 + 1200 = 1203 apples.\n#### 1,203"},
    {"problem": "Compute 3/4 as a fraction.", "solution": r"It is $\boxed{\frac{3}{4}}$.",
     "level": "Level 1"},
    {"prompt": "What is 2-5?", "answer": r"\boxed{-3}"},
    {"prompt": [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "What is 6*7?"}],
     "reward_model": {"ground_truth": "42", "style": "rule"}},
]


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
  path = tmp_path_factory.mktemp("data") / "mixed.jsonl"
  path.write_text("\n".join(json.dumps(r) for r in RECORDS) + "\n\n")
  return str(path)


def test_load_jsonl_keeps_the_final_answer(jsonl):
  examples = load_jsonl(jsonl)
  assert [e.answer for e in examples] == ["1,203", r"\frac{3}{4}", "-3", "42"]
  assert examples[0].prompt.startswith("Tom has")
  assert examples[0].solution.endswith("#### 1,203")  # GSM8K's worked solution is kept
  assert examples[1].solution.startswith("It is") and examples[1].metadata == {"level": "Level 1"}
  assert examples[3].prompt == "What is 6*7?"
  assert len(load_jsonl(jsonl, limit=2)) == 2
  assert load_jsonl(jsonl, limit=0) == []


def test_bad_records_name_file_and_line(tmp_path):
  path = tmp_path / "bad.jsonl"
  path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({"question": "q"}) + "\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:2: no answer"):
    load_jsonl(str(path))
  path.write_text("{not json\n")
  with pytest.raises(ValueError, match=r"bad.jsonl:1: not valid JSON"):
    load_jsonl(str(path))
  with pytest.raises(ValueError, match="no prompt field"):
    example_from_record({"answer": "1"})
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_jsonl(str(tmp_path / "missing.jsonl"))


def test_data_files_for_the_jobs(tmp_path, jsonl):
  """What task.data_path / eval_data_path read, and the config around them."""
  from tests.conftest import repo_config
  from tlt_jax.components import task_examples, training_set, validate_config
  from tlt_jax.config import ConfigError
  assert [e.answer for e in load_examples(jsonl)] == ["1,203", r"\frac{3}{4}", "-3", "42"]
  (tmp_path / "empty.jsonl").write_text("\n\n")
  with pytest.raises(ValueError, match=r"empty.jsonl' has no records"):
    load_examples(str(tmp_path / "empty.jsonl"))
  with pytest.raises(ValueError, match="Parquet.*convert it to JSON lines"):
    load_examples(str(tmp_path / "train.parquet"))

  config = repo_config("default", "runlocal")
  config.unlock()
  config.task.data_path = jsonl
  with pytest.raises(ConfigError, match="set task.eval_data_path or rl.num_eval_examples=0"):
    validate_config(config)
  config.task.eval_data_path = str(tmp_path / "missing.jsonl")
  with pytest.raises(ConfigError, match="task.eval_data_path=.*missing.jsonl' does not exist"):
    validate_config(config)
  config.task.eval_data_path = jsonl
  validate_config(config)
  assert [e.answer for e in training_set(config, 10 ** 6)] == ["1,203", r"\frac{3}{4}", "-3",
                                                                "42"]
  assert [e.answer for e in task_examples(config, 2, start=1, eval_split=True)] == [
      r"\frac{3}{4}", "-3"]
  config.task.data_path = str(tmp_path / "empty.jsonl")
  with pytest.raises(ConfigError, match="task.data_path: data file .* has no records"):
    training_set(config, 10)


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
  path = tmp_path / "latin1.jsonl"
  path.write_bytes(json.dumps(RECORDS[0]).encode() + b'\n{"question": "caf\xe9", "answer": "1"}\n')
  with pytest.raises(ValueError, match=r"latin1.jsonl:2: not UTF-8 \(byte 0xe9, the line's byte "
                                       r"18\); re-encode the file as UTF-8"):
    load_examples(str(path))
  path.write_bytes('{"question": "caf\u00e9 \u00fcber", "answer": "1"}\n'.encode())
  assert load_examples(str(path))[0].prompt == "caf\u00e9 \u00fcber"


def test_prompt_lengths_are_checked_at_the_start(tmp_path):
  """Every record of the data files, and the arithmetic task's longest prompt, against
  rollout.max_prompt_len, before anything is compiled."""
  from tests.conftest import repo_config
  from tlt_jax.components import check_prompt_lengths, load_tokenizer_for
  from tlt_jax.config import ConfigError
  from tlt_jax.rl.tokenizer import prompt_ids
  config = repo_config("default", "runlocal")
  config.unlock()
  tokenizer = load_tokenizer_for(config)
  check_prompt_lengths(config, tokenizer)  # the shipped config's task fits
  longest = max(len(prompt_ids(tokenizer, p))
                for p in ArithmeticTask(**_task_args(config)).longest_prompts())
  drawn = ArithmeticTask(**_task_args(config)).examples(2000)
  assert max(len(prompt_ids(tokenizer, e.prompt)) for e in drawn) <= longest
  config.rollout.max_prompt_len = longest - 1
  with pytest.raises(ConfigError, match=rf"rollout.max_prompt_len={longest - 1} is below the "
                                        rf"arithmetic task's longest prompt, {longest} tokens"):
    check_prompt_lengths(config, tokenizer)

  config.rollout.max_prompt_len = 64
  short, long_ = "What is 2+2?", "Add one. " * 40
  n = len(prompt_ids(tokenizer, long_))
  (tmp_path / "train.jsonl").write_text("\n".join(
      json.dumps({"question": q, "answer": "4"}) for q in (short, short)) + "\n")
  (tmp_path / "heldout.jsonl").write_text("\n\n".join(
      json.dumps({"question": q, "answer": "4"}) for q in (short, long_)) + "\n")
  config.task.data_path = str(tmp_path / "train.jsonl")
  config.task.eval_data_path = str(tmp_path / "heldout.jsonl")
  with pytest.raises(ConfigError, match=rf"task.eval_data_path: .*heldout.jsonl:3: the prompt "
                                        rf"has {n} tokens, more than rollout.max_prompt_len=64"):
    check_prompt_lengths(config, tokenizer)
  with pytest.raises(ConfigError, match="arithmetic task's longest prompt"):
    check_prompt_lengths(config, tokenizer, data_files=False)  # the built-in task at 20 steps
  config.task.max_ops = 6
  check_prompt_lengths(config, tokenizer, data_files=False)  # ... and at 6


def _task_args(config):
  t = config.task
  return dict(max_ops=t.max_ops, max_value=t.max_value, max_operand=t.max_operand,
              max_multiplier=t.max_multiplier)


def test_iterator_shuffles_per_epoch_and_visits_everything():
  it = PromptIterator(list(range(10)), seed=0)
  first, second = it.take(10), it.take(10)
  assert sorted(first) == sorted(second) == list(range(10))
  assert first != second and first != list(range(10))
  assert PromptIterator(list(range(10)), seed=0).take(20) == first + second
  assert PromptIterator(list(range(5)), seed=0, shuffle=False).take(7) == [0, 1, 2, 3, 4, 0, 1]


def test_iterator_resume_gives_the_same_order():
  reference = PromptIterator(list(range(7)), seed=3).take(30)
  it = PromptIterator(list(range(7)), seed=3)
  head = it.take(12)
  state = json.loads(json.dumps(it.state_dict()))  # what a checkpoint stores
  assert state == {"epoch": 1, "index": 5}
  resumed = PromptIterator(list(range(7)), seed=3)
  resumed.load_state_dict(state)
  assert head + resumed.take(18) == reference
  with pytest.raises(ValueError, match="bad iterator state"):
    resumed.load_state_dict({"epoch": 0, "index": 8})
