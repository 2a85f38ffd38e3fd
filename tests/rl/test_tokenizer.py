"""The task tokenizer: byte-level round trip, digit splitting, chat template, HF save/load."""

import pytest

from tlt_jax.models.hf import load_tokenizer
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rl.tokenizer import (IM_END, IM_START, PAD_TOKEN, prompt_ids, response_ids,
                                  train_tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
  examples = ArithmeticTask(seed=0).examples(300)
  return train_tokenizer([e.prompt for e in examples] + [e.solution for e in examples], 300)


def test_special_tokens_and_size(tokenizer):
  assert 259 < len(tokenizer) <= 300
  assert tokenizer.convert_ids_to_tokens([0, 1, 2]) == [PAD_TOKEN, IM_START, IM_END]
  assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD_TOKEN


@pytest.mark.parametrize("text", ["Start with 7. Add 5. What is the result?",
                                  "7+5=12\n12*3=36\n#### 36", "unseen wörds ✓ {}\t\\boxed{3}"])
def test_round_trip(tokenizer, text):
  ids = tokenizer.encode(text, add_special_tokens=False)
  assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens_and_words_are_merged(tokenizer):
  text = "Start with 5. Multiply by 123."
  tokens = tokenizer.tokenize(text)
  assert [t for t in tokens if t.isdigit()] == ["5", "1", "2", "3"]
  assert "Ġwith" in tokens and len(tokens) < len(text) // 2


def test_chat_template(tokenizer):
  ids = prompt_ids(tokenizer, "Start with 2. Add 1. What is the result?")
  assert tokenizer.decode(ids) == ("<|im_start|>user\nStart with 2. Add 1. What is the result?"
                                   "<|im_end|>\n<|im_start|>assistant\n")
  response = response_ids(tokenizer, "2+1=3\n#### 3")
  assert response[-1] == tokenizer.eos_token_id
  assert tokenizer.decode(response, skip_special_tokens=True) == "2+1=3\n#### 3"


def test_saved_in_hf_layout_and_reloaded(tokenizer, tmp_path):
  tokenizer.save_pretrained(tmp_path)
  again = load_tokenizer(str(tmp_path))
  text = "Start with 9. Subtract 4. What is the result?"
  assert prompt_ids(again, text) == prompt_ids(tokenizer, text)
  assert again.eos_token_id == tokenizer.eos_token_id
  assert again.pad_token_id == tokenizer.pad_token_id


def test_too_small_vocab_is_named():
  with pytest.raises(ValueError, match="vocab_size=100 is too small"):
    train_tokenizer(["a"], 100)
