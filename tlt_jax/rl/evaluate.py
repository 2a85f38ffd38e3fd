"""Accuracy of a policy on a list of `Example`s, decoded by the rollout engine."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np

from tlt_jax.rl.rewards import RewardFn, answer_reward
from tlt_jax.rl.tasks.example import Example
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams


def evaluate(engine: RolloutEngine, tokenizer, examples: Sequence[Example],
             sampling: SamplingParams, samples: int = 1, key: jax.Array | None = None,
             answer_fn: RewardFn = answer_reward,
             breakdown: Callable[[Example], object] | None = None) -> dict:
  """Samples `samples` completions per example with the engine's current policy (temperature
  0 = greedy; SD, when the engine runs it, is exact) and scores their answers with `answer_fn`.

  Returns a dict over the N = len(examples) * samples completions (example i's from i * samples on):
  accuracy (float), num_examples, samples, correct (N bools), texts (decoded, special tokens
  dropped), lengths (N generated tokens, EOS included), finished (N bools: EOS before the token
  budget), response_len_mean, and accuracy_by ({group: [correct, total]}) over the groups
  `breakdown(example)` names (a task's `Task.breakdown`; None: left out; {} without one)."""
  if not examples:
    raise ValueError("evaluate needs at least one example")
  key = jax.random.key(0) if key is None else key
  ids = [prompt_ids(tokenizer, ex.prompt) for ex in examples]
  # Its tail programs queue to compile behind the rollout's: an evaluation runs rarely.
  result = engine.generate(ids, samples, sampling, key, log_requests=(), compile_priority=1)
  texts = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
  repeated = [ex for ex in examples for _ in range(samples)]
  correct = [bool(ok) for ok in answer_fn([ex.prompt for ex in repeated], texts,
                                             answer=[ex.answer for ex in repeated],
                                             metadata=[ex.metadata for ex in repeated])]
  by: dict = {}
  for ex, ok in zip(repeated, correct):
    if breakdown is not None and (group := breakdown(ex)) is not None:
      cell = by.setdefault(group, [0, 0])
      cell[0] += int(ok)
      cell[1] += 1
  lengths = [int(n) for n in result.lengths]
  return {"accuracy": float(np.mean(correct)), "num_examples": len(examples),
          "samples": samples, "correct": correct, "texts": texts, "lengths": lengths,
          "finished": [f == "eos" for f in result.finish_reasons],
          "response_len_mean": float(np.mean(lengths)),
          "accuracy_by": dict(sorted(by.items()))}


def heldout_accuracy(engine: RolloutEngine, tokenizer, examples: Sequence[Example],
                     sampling: SamplingParams, samples: int, answer_fn: RewardFn = answer_reward,
                     breakdown: Callable[[Example], object] | None = None) -> dict:
  """Held-out accuracy with the rollout engine: greedy (SD is exact, so it is unchanged), and
  with `samples` samples per problem at the rollout temperature (what the reward measures,
  without the noise of each step's prompt mix). One eval.jsonl row, without the step; with
  a breakdown (`evaluate`), the greedy accuracy per group too (greedy_accuracy_by). Both run
  the rollout's programs (greedy keeps the rollout's top-k and top-p, and the temperature is
  the programs' argument), so the first evaluation compiles them before the first RL step and
  queues the tail's programs to compile ahead."""
  row, key = {}, jax.random.key(1)
  for name, sp, n in (("greedy", dataclasses.replace(sampling, temperature=0.0), 1),
                      ("sampled", sampling, samples)):
    if n:
      res = evaluate(engine, tokenizer, examples, sp, samples=n, key=key, answer_fn=answer_fn,
                     breakdown=breakdown)
      row[f"{name}_accuracy"] = res["accuracy"]
      if name == "greedy" and res["accuracy_by"]:
        row["greedy_accuracy_by"] = {str(k): v for k, v in res["accuracy_by"].items()}
      row[f"{name}_response_len_mean"] = res["response_len_mean"]
  row["accuracy"] = row["greedy_accuracy"]
  return row
