"""The phases of one RL step, in the order the main loop (tlt_jax.train) runs them: the
step's samples (prompts, the rollout with spot training of the drafter on idle slices, and
scoring, in as many rounds as the algorithm asks for), the policy update, and the step's
metrics and saved responses."""

from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np

from tlt_jax.knobs import ConfigError
from tlt_jax.rl.algorithms import Algorithm
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.policy_update import PolicyUpdater
from tlt_jax.rl.rewards import RewardFn, answer_reward
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import RolloutEngine, RolloutResult, accept_length, sd_not_reached


def rl_prompts(tokenizer, examples: list, config: ml_collections.ConfigDict) -> list[list[int]]:
  """Chat-formatted prompt ids of problems (a step's, or any the engine will decode);
  ConfigError when one is longer than rollout.max_prompt_len."""
  prompts = [prompt_ids(tokenizer, ex.prompt) for ex in examples]
  longest = max(len(p) for p in prompts)
  if longest > config.rollout.max_prompt_len:
    raise ConfigError(f"a problem ({config.task.data_path or f'task {config.task.name}'}) has "
                      f"{longest} prompt tokens, more than rollout.max_prompt_len="
                      f"{config.rollout.max_prompt_len}; raise it")
  return prompts


def rollout_key(step_key: jax.Array, round_index: int = 0) -> jax.Array:
  """The sampling key of a step's rollout (the paired control decodes with it too), and of
  its later rounds."""
  key = jax.random.fold_in(step_key, 0)
  return jax.random.fold_in(key, round_index) if round_index else key


@dataclasses.dataclass
class Rollout:
  """A step's responses (`result`), the rollout's wall time and the spot trainer's metrics
  of it ({} without one)."""
  result: RolloutResult
  seconds: float
  spot: dict


def rollout(engine: RolloutEngine, spot, prompts: list[list[int]], sampling, key: jax.Array,
            step: int, config: ml_collections.ConfigDict, round_index: int = 0) -> Rollout:
  """The step's responses (of its round `round_index`), with spot training of the drafter on
  the slices that finish first; the drafter's new weights go to the engine."""
  t0 = time.perf_counter()
  logged = None
  if spot is not None:
    spot.begin(step, engine.policy_on)
    keep = config.drafter.buffer.sequences_per_step
    n = len(prompts) * config.rl.num_samples
    if keep:
      logged = np.random.default_rng([config.seed, step]).choice(
          n, min(n, keep), replace=False).tolist()
  result = engine.generate(prompts, config.rl.num_samples, sampling, rollout_key(key, round_index),
                           on_slice_idle=spot.on_slice_idle if spot else None, log_requests=logged)
  spot_metrics = spot.finish() if spot is not None else {}
  if spot is not None and engine.speculative:
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
  columns = {"answer": [ex.answer for ex in repeated], "metadata": [ex.metadata for ex in repeated]}
  return Scored(completions, np.asarray(reward_fn(prompts, completions, **columns), np.float32),
                np.asarray(answer_fn(prompts, completions, **columns)))


@dataclasses.dataclass
class StepSamples:
  """A step's problems, responses and scores over its rollout rounds (one unless the
  algorithm samples dynamically), merged in order, and `train_groups`: the indices of the
  groups (problems) the update trains on."""
  examples: list
  prompts: list[list[int]]
  rolled: Rollout
  scored: Scored
  train_groups: list[int]
  rounds: int


def sample_step(engine: RolloutEngine, spot, prompts_iter: PromptIterator, tokenizer,
                algorithm: Algorithm, reward_fn: RewardFn, answer_fn: RewardFn, sampling,
                key: jax.Array, step: int, config: ml_collections.ConfigDict) -> StepSamples:
  """Rounds of rl.prompts_per_step fresh problems, rolled out and scored, until the
  algorithm keeps that many groups (`keep_groups`) or has had `algorithm.rounds` rounds;
  the update takes the first rl.prompts_per_step groups kept."""
  rl, rounds = config.rl, []
  kept: list[int] = []
  for r in range(algorithm.rounds):
    examples = prompts_iter.take(rl.prompts_per_step)
    prompts = rl_prompts(tokenizer, examples, config)
    rolled = rollout(engine, spot, prompts, sampling, key, step, config, round_index=r)
    scored = score(examples, rolled.result, tokenizer, reward_fn, rl.num_samples, answer_fn)
    kept += [r * rl.prompts_per_step + g
             for g in np.flatnonzero(algorithm.keep_groups(scored.rewards, rl.num_samples))]
    rounds.append((examples, prompts, rolled, scored))
    if len(kept) >= rl.prompts_per_step:
      break
  return StepSamples(examples=[e for x in rounds for e in x[0]],
                     prompts=[p for x in rounds for p in x[1]],
                     rolled=merge_rollouts([x[2] for x in rounds]),
                     scored=Scored([c for x in rounds for c in x[3].completions],
                                   np.concatenate([x[3].rewards for x in rounds]),
                                   np.concatenate([x[3].correct for x in rounds])),
                     train_groups=[int(g) for g in kept[:rl.prompts_per_step]], rounds=len(rounds))


# Spot-training metrics that are means over the drafter's steps; the others add up.
_MEAN_OVER_STEPS = ("drafter_loss", "drafter_top1")


def merge_rollouts(rollouts: list[Rollout]) -> Rollout:
  """A step's rollout rounds as one: responses in order, seconds and spot metrics added up
  (the drafter's loss averaged over its steps), idle slice-seconds per round."""
  if len(rollouts) == 1:
    return rollouts[0]
  spot: dict = {"idle_slice_s": sum(r.spot.get("idle_slice_s", _idle_slice_s(r.result))
                                    for r in rollouts)}
  steps = [r.spot.get("drafter_steps", 0) for r in rollouts]
  for k in {k for r in rollouts for k in r.spot} - {"idle_slice_s"}:
    values = [r.spot.get(k) for r in rollouts]
    if k in _MEAN_OVER_STEPS:
      pairs = [(v, n) for v, n in zip(values, steps) if v is not None and n]
      spot[k] = (sum(v * n for v, n in pairs) / sum(n for _, n in pairs)) if pairs else None
    else:
      spot[k] = sum(v for v in values if v is not None)
  return Rollout(RolloutResult.concat([r.result for r in rollouts]),
                 sum(r.seconds for r in rollouts), spot)


def update_policy(updater: PolicyUpdater, algorithm: Algorithm, params: dict,
                  samples: StepSamples, pad_id: int, max_width: int,
                  config: ml_collections.ConfigDict) -> tuple[dict, dict]:
  """The step's policy update on its training groups: (new params, the update's metrics).
  With fewer groups than rl.prompts_per_step the batch is padded to the usual shape; with
  none, nothing is updated (the metrics are zeros)."""
  n = config.rl.num_samples
  rows = [g * n + i for g in samples.train_groups for i in range(n)]
  if not rows:
    return params, {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "nonfinite": 0.0,
                    "params_finite": 1.0}
  result = samples.rolled.result
  inputs = algorithm.response_inputs(samples.scored.rewards, result.lengths, n)
  params, metrics, _ = updater(params, [samples.prompts[r // n] for r in rows],
                               [result.tokens[r] for r in rows],
                               {k: take_rows(v, rows) for k, v in inputs.items()}, pad_id,
                               max_width=max_width, min_rows=config.rl.prompts_per_step * n,
                               rollout_logps=[result.logprobs[r] for r in rows]
                               if result.logprobs else None)
  return params, metrics


def take_rows(values, rows: list[int]):
  """values[rows] of an [N] array or of a list of N per-response arrays."""
  return values[rows] if isinstance(values, np.ndarray) else [values[r] for r in rows]


def paired_control(control: RolloutEngine, samples: StepSamples, tokenizer, sampling,
                   key: jax.Array, config: ml_collections.ConfigDict, reward_fn: RewardFn,
                   answer_fn: RewardFn) -> dict:
  """The initial policy (`control`, plain decoding) on the step's first-round prompts with
  their rollout key, scored like the rollout: the step's reward and accuracy minus the
  initial policy's, and its seconds. Same key and policy give the same samples, so both
  differences are exactly 0 until the first update."""
  t0 = time.perf_counter()
  rl = config.rl
  n = rl.prompts_per_step * rl.num_samples
  result = control.generate(samples.prompts[:rl.prompts_per_step], rl.num_samples, sampling,
                            rollout_key(key), log_requests=())
  base = score(samples.examples[:rl.prompts_per_step], result, tokenizer, reward_fn,
               rl.num_samples, answer_fn)
  rewards, correct = samples.scored.rewards[:n], samples.scored.correct[:n]
  return {"reward_initial": float(base.rewards.mean()),
          "reward_vs_initial": float(rewards.mean() - base.rewards.mean()),
          "accuracy_vs_initial": float(correct.mean() - base.correct.mean()),
          "control_s": time.perf_counter() - t0}


def step_metrics(step: int, samples: StepSamples, update: dict, algorithm: Algorithm,
                 sd_enabled: bool, update_s: float, step_s: float, compile_s: float) -> dict:
  """One line of metrics.jsonl (train_report.METRIC_KEYS, the update's losses and the
  algorithm's own metrics), over every response of the step's rounds."""
  scored, rollout = samples.scored, samples.rolled
  result, lengths = rollout.result, rollout.result.lengths
  metrics = {
      "step": step, "reward_mean": float(scored.rewards.mean()),
      "accuracy": float(scored.correct.mean()),
      "response_len_mean": float(lengths.mean()), "response_len_max": int(lengths.max()),
      "rollout_s": rollout.seconds, "update_s": update_s, "step_s": step_s,
      "rollout_tokens": int(lengths.sum()), "sd_enabled": sd_enabled,
      "sd_accept_len_mean": accept_length(result),
      **{k: rollout.spot.get(k, default) for k, default in (
          ("drafter_steps", 0), ("drafter_loss", None), ("drafter_nonfinite", 0),
          ("drafter_tokens", 0.0), ("idle_slice_s", _idle_slice_s(result)),
          ("reclaimed_slice_s", 0.0))},
      "compile_s": compile_s,
      "policy_loss": update["loss"], "grad_norm": update["grad_norm"],
      "clip_frac": update["clip_frac"], "nonfinite_updates": update.get("nonfinite", 0.0),
      "finished_eos": float(np.mean([f == "eos" for f in result.finish_reasons])),
  }
  if sd_enabled and metrics["sd_accept_len_mean"] is None:  # asked for SD, never reached it
    metrics["sd_not_reached"] = sd_not_reached(result)
  for k in ("kl", "rollout_logp_diff_mean", "rollout_logp_diff_max"):
    if k in update:
      metrics[k] = update[k]
  if algorithm.rounds > 1:
    metrics.update(rollout_rounds=samples.rounds, groups_trained=len(samples.train_groups))
  metrics.update(algorithm.step_metrics(scored.rewards, lengths))
  return metrics


def rollout_rows(step: int, scored: Scored, result, num_samples: int,
                 prompts: list[list[int]]) -> list[dict]:
  """One rollouts.jsonl row per response of the step, with its prompt's and its own token
  ids (two runs' responses compare exactly; a drafter trains on them)."""
  return [{"step": step, "prompt": i // num_samples, "sample": i % num_samples,
           "completion": scored.completions[i], "tokens": len(toks),
           "finish_reason": result.finish_reasons[i], "reward": float(scored.rewards[i]),
           "correct": bool(scored.correct[i]),
           "prompt_ids": [int(t) for t in prompts[i // num_samples]],
           "token_ids": [int(t) for t in toks]}
          for i, toks in enumerate(result.tokens)]


def timeline_rows(step: int, result) -> list[dict]:
  """One timeline.jsonl row per compiled call of the step's rollout (`StepRecord`: mode,
  running rows, program batch, strategy, tokens, accept length, seconds, when it ended)."""
  return [{"step": step, "call": i, **dataclasses.asdict(r)}
          for i, r in enumerate(result.timeline)]


def _idle_slice_s(result) -> float:
  """Slice-seconds between each slice running out of work and the end of the rollout."""
  return float(sum(result.wall_s - t for t in result.slice_done_s))
