"""A small byte-level BPE tokenizer for the built-in task, with chat special tokens and template.

Digits are split one per token before BPE, so numbers are spelled digit by digit (what lets a
tiny model learn carries); words and punctuation get merged. The result is a
`transformers.PreTrainedTokenizerFast` with a ChatML-style template, saved in Hugging Face
layout next to the policy, so prompts go through `apply_chat_template(...,
add_generation_prompt=True)` exactly as they do for a Hugging Face model with its own template.
"""

from __future__ import annotations

from collections.abc import Iterable

from tlt_jax.models.hf import transformers_lib

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of a turn; the EOS of generation
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 320):
  """Trains byte-level BPE on `texts`; returns a PreTrainedTokenizerFast.

  Args:
    texts: training text (prompts and solutions; chat roles are added here).
    vocab_size: the most tokens, special tokens and the 256 byte tokens included; training stops
      earlier when the text has no more pairs to merge, so `len(tokenizer)` may be smaller.
  """
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  PreTrainedTokenizerFast = transformers_lib().PreTrainedTokenizerFast

  min_size = 256 + len(SPECIAL_TOKENS)
  if vocab_size < min_size:
    raise ValueError(f"tokenizer.vocab_size={vocab_size} is too small: byte-level BPE needs "
                     f"at least {min_size} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=False)
  roles = ["system", "user", "assistant"]
  tok.train_from_iterator(list(texts) + roles, trainer=trainer)
  wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=IM_END,
                                    additional_special_tokens=[IM_START])
  wrapped.chat_template = CHAT_TEMPLATE
  return wrapped


def prompt_ids(tokenizer, prompt: str) -> list[int]:
  """The token ids of a user prompt through the chat template, ending in the assistant header."""
  ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                      add_generation_prompt=True, tokenize=True)
  if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
    ids = ids["input_ids"]
  return list(ids)


def response_ids(tokenizer, response: str) -> list[int]:
  """Token ids of an assistant response followed by the end-of-turn (EOS) token."""
  return tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
