"""The phases of one GRPO step, in the order the main loop (tlt_jax.train) runs them: the
step's prompts, the rollout (with spot training of the drafter on idle slices), scoring, and
the step's metrics and saved responses."""

from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np

from tlt_jax.config import ConfigError
from tlt_jax.rl.rewards import RewardFn, answer_reward
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import RolloutEngine, RolloutResult, accept_length


def rl_prompts(tokenizer, examples: list, config: ml_collections.ConfigDict) -> list[list[int]]:
  """Chat-formatted prompt ids of problems (a step's, or any the engine will decode);
  ConfigError when one is longer than rollout.max_prompt_len."""
  prompts = [prompt_ids(tokenizer, ex.prompt) for ex in examples]
  longest = max(len(p) for p in prompts)
  if longest > config.rollout.max_prompt_len:
    raise ConfigError(f"a problem ({config.task.data_path or 'the built-in task'}) has "
                      f"{longest} prompt tokens, more than rollout.max_prompt_len="
                      f"{config.rollout.max_prompt_len}; raise it")
  return prompts


def rollout_key(step_key: jax.Array) -> jax.Array:
  """The sampling key of a step's rollout (the paired control decodes with it too)."""
  return jax.random.fold_in(step_key, 0)


@dataclasses.dataclass
class Rollout:
  """A step's responses (`result`), the rollout's wall time and the spot trainer's metrics
  of it ({} without one)."""
  result: RolloutResult
  seconds: float
  spot: dict


def rollout(engine: RolloutEngine, spot, prompts: list[list[int]], sampling, key: jax.Array,
            step: int, config: ml_collections.ConfigDict) -> Rollout:
  """The step's responses, with spot training of the drafter on the slices that finish
  first; the drafter's new weights go to the engine."""
  t0 = time.perf_counter()
  logged = None
  if spot is not None:
    spot.begin(step, engine.policy_on)
    keep = config.drafter.buffer.sequences_per_step
    n = len(prompts) * config.rl.num_samples
    if keep:
      logged = np.random.default_rng([config.seed, step]).choice(
          n, min(n, keep), replace=False).tolist()
  result = engine.generate(prompts, config.rl.num_samples, sampling, rollout_key(key),
                           on_slice_idle=spot.on_slice_idle if spot else None,
                           log_requests=logged)
  spot_metrics = {}
  if spot is not None:
    spot_metrics = spot.finish()
    if engine.speculative:
      engine.update_params(drafter_params=spot.params)
  return Rollout(result, time.perf_counter() - t0, spot_metrics)


@dataclasses.dataclass
class Scored:
  """The decoded responses, their rewards [B] float32 (the configured reward) and whether
  their answers are right [B] float (the answer alone)."""
  completions: list[str]
  rewards: np.ndarray
  correct: np.ndarray


def score(examples: list, result, tokenizer, reward_fn, num_samples: int,
          answer_fn: RewardFn = answer_reward) -> Scored:
  """Decodes the responses (response i answers examples[i // num_samples]) and scores them:
  rewards by `reward_fn`, right or wrong by `answer_fn` (`rewards.make_answer_reward`)."""
  completions = [tokenizer.decode(t, skip_special_tokens=True) for t in result.tokens]
  repeated = [ex for ex in examples for _ in range(num_samples)]
  prompts = [ex.prompt for ex in repeated]
  answers = [ex.answer for ex in repeated]
  rewards = np.asarray(reward_fn(prompts, completions, answer=answers,
                                 metadata=[ex.metadata for ex in repeated]), np.float32)
  correct = np.asarray(answer_fn(prompts, completions, answer=answers))
  return Scored(completions, rewards, correct)


def paired_control(control: RolloutEngine, examples: list, prompts: list[list[int]],
                   scored: Scored, tokenizer, sampling, key: jax.Array,
                   config: ml_collections.ConfigDict, reward_fn: RewardFn,
                   answer_fn: RewardFn) -> dict:
  """The initial policy (`control`, plain decoding) on the step's prompts with the step's
  rollout key, scored like the rollout: the step's reward and accuracy minus the initial
  policy's, and its seconds. Same key and policy give the same samples, so both differences
  are exactly 0 until the first update."""
  t0 = time.perf_counter()
  result = control.generate(prompts, config.rl.num_samples, sampling, rollout_key(key),
                            log_requests=())
  base = score(examples, result, tokenizer, reward_fn, config.rl.num_samples, answer_fn)
  return {"reward_initial": float(base.rewards.mean()),
          "reward_vs_initial": float(scored.rewards.mean() - base.rewards.mean()),
          "accuracy_vs_initial": float(scored.correct.mean() - base.correct.mean()),
          "control_s": time.perf_counter() - t0}


def step_metrics(step: int, scored: Scored, rollout: Rollout, update: dict,
                 sd_enabled: bool, update_s: float, step_s: float, compile_s: float) -> dict:
  """One line of metrics.jsonl (train_report.METRIC_KEYS and the update's losses)."""
  result, spot = rollout.result, rollout.spot
  lengths = result.lengths
  metrics = {
      "step": step, "reward_mean": float(scored.rewards.mean()),
      "accuracy": float(scored.correct.mean()),
      "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
      "rollout_s": rollout.seconds, "update_s": update_s, "step_s": step_s,
      "rollout_tokens": int(lengths.sum()), "sd_enabled": sd_enabled,
      "sd_accept_len_mean": accept_length(result),
      "drafter_steps": spot.get("drafter_steps", 0),
      "drafter_loss": spot.get("drafter_loss"),
      "drafter_tokens": spot.get("drafter_tokens", 0.0),
      "idle_slice_s": spot.get("idle_slice_s", _idle_slice_s(result)),
      "reclaimed_slice_s": spot.get("reclaimed_slice_s", 0.0),
      "compile_s": compile_s,
      "policy_loss": update["loss"], "grad_norm": update["grad_norm"],
      "clip_frac": update["clip_frac"], "nonfinite_updates": update.get("nonfinite", 0.0),
      "finished_eos": float(np.mean([f == "eos" for f in result.finish_reasons])),
  }
  if "kl" in update:
    metrics["kl"] = update["kl"]
  return metrics


def rollout_rows(step: int, scored: Scored, result, num_samples: int) -> list[dict]:
  """One rollouts.jsonl row per response of the step."""
  return [{"step": step, "prompt": i // num_samples, "sample": i % num_samples,
           "completion": scored.completions[i], "tokens": len(toks),
           "finish_reason": result.finish_reasons[i], "reward": float(scored.rewards[i]),
           "correct": bool(scored.correct[i])} for i, toks in enumerate(result.tokens)]


def _idle_slice_s(result) -> float:
  """Slice-seconds between each slice running out of work and the end of the rollout."""
  return float(sum(result.wall_s - t for t in result.slice_done_s))
