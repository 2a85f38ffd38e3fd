"""Accuracy of a policy on a list of `Example`s, with plain decoding."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from tlt_jax.models import ModelConfig
from tlt_jax.rl.answers import answers_match, extract_answer
from tlt_jax.rl.tasks.example import Example
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.plain import generate_plain
from tlt_jax.speculative.sampling import SamplingParams


def sample_completions(params: dict, cfg: ModelConfig, tokenizer, prompts: Sequence[str],
                       max_new_tokens: int, batch_size: int, temperature: float = 0.0,
                       key: jax.Array | None = None) -> list[list[int]]:
  """Completion token ids (EOS dropped) for each prompt, through the chat template.

  Prompts are run in batches of similar length (sorted by prompt length, which for the built-in
  task tracks the number of steps), so a batch rarely waits on one long straggler; the last
  batch is padded by repeating a prompt so every batch has the same shape (one compilation).
  """
  key = jax.random.key(0) if key is None else key
  ids = [prompt_ids(tokenizer, p) for p in prompts]
  order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
  out: list[list[int] | None] = [None] * len(ids)
  for start in range(0, len(order), batch_size):
    chunk = order[start:start + batch_size]
    batch = [ids[i] for i in chunk]
    batch += [batch[-1]] * (batch_size - len(batch))
    key, sub = jax.random.split(key)
    completions = generate_plain(params, cfg, batch, max_new_tokens, tokenizer.eos_token_id,
                                 SamplingParams(temperature), sub,
                                 pad_id=tokenizer.pad_token_id)
    for i, c in zip(chunk, completions):
      out[i] = c
  return out  # type: ignore[return-value]


def evaluate(params: dict, cfg: ModelConfig, tokenizer, examples: Sequence[Example],
             max_new_tokens: int, batch_size: int, temperature: float = 0.0,
             key: jax.Array | None = None) -> dict:
  """Samples a completion per example and scores its final answer.

  Returns a dict: accuracy (float), num_examples, correct (list of bool), texts (decoded
  completions), lengths (completion tokens, EOS excluded), finished (list of bool: EOS seen
  before max_new_tokens), and accuracy_by_steps ({num_steps: [correct, total]}) for examples
  whose metadata has 'num_steps'.
  """
  if not examples:
    raise ValueError("evaluate needs at least one example")
  completions = sample_completions(params, cfg, tokenizer, [e.prompt for e in examples],
                                   max_new_tokens, batch_size, temperature, key)
  texts = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
  correct = [answers_match(extract_answer(t), e.answer) for t, e in zip(texts, examples)]
  by_steps: dict[int, list[int]] = {}
  for e, ok in zip(examples, correct):
    if "num_steps" in e.metadata:
      cell = by_steps.setdefault(int(e.metadata["num_steps"]), [0, 0])
      cell[0] += int(ok)
      cell[1] += 1
  return {"accuracy": float(np.mean(correct)), "num_examples": len(examples),
          "correct": correct, "texts": texts, "lengths": [len(c) for c in completions],
          "finished": [len(c) < max_new_tokens for c in completions],
          "accuracy_by_steps": dict(sorted(by_steps.items()))}
