"""The drafter-ablation protocol that experiments/drafter_ttt.py and
notebooks/drafter_ablation.ipynb share: the policy answers the training prompts (one response
each at temperature 1.0, as the warm-up job samples them), a drafter trains on the samples of
those responses for a fixed number of updates (the warm-up's `train_drafter`), and an engine
decodes the held-out prompts after an untimed call that compiles its programs."""

from __future__ import annotations

import time

import jax
import numpy as np

from tlt_jax.components import make_engine
from tlt_jax.drafter_training.warmup import train_drafter
from tlt_jax.speculative.sampling import SamplingParams


def policy_responses(config, cfg, params, mesh, eos: int, pad: int, prompts,
                     max_new_tokens: int, seed: int):
  """The policy's own responses to `prompts`, one each at temperature 1.0 (the engine's
  result: tokens, lengths)."""
  sampler = make_engine(config, cfg, params, mesh, eos, pad, max_new_tokens=max_new_tokens,
                        max_batch=min(64, 1 << (len(prompts) - 1).bit_length()))
  return sampler.generate(prompts, 1, SamplingParams(1.0), jax.random.key(seed))


def train(drafter_params, policy_params, samples, model_cfg, settings: dict, opt_config,
          steps: int, window: int, batch_rows: int, seed: int, state=None):
  """(trained drafter params, summary) after `steps` updates from `drafter_params` ({family:
  params}; or from `state`, an optimizer state to continue). The summary: training seconds
  (first-step compile included), steps, the first loss, and the loss, top-1 and top-1-ahead
  means over the last 10% of steps (batch-to-batch noise smoothed), where the family reports
  them."""
  t0 = time.perf_counter()
  trained, history = train_drafter(drafter_params, policy_params, samples, model_cfg, settings,
                                   opt_config, steps, window=window, batch_rows=batch_rows,
                                   seed=seed, progress=False, state=state)
  tail = history[-max(1, len(history) // 10):]
  summary = {"train_s": time.perf_counter() - t0, "steps": len(history),
             "loss_first": history[0]["loss"]}
  summary.update({f"{k}_last": float(np.mean([h[k] for h in tail]))
                  for k in ("loss", "top1", "top1_ahead") if k in history[-1]})
  return trained, summary


def decode(engine, prompts, samples: int, sampling: SamplingParams, seed: int):
  """The engine's result for `prompts` x `samples`, measured after an untimed call on the
  first prompt that compiles its programs."""
  engine.generate(prompts[:1], samples, sampling, jax.random.key(seed))
  return engine.generate(prompts, samples, sampling, jax.random.key(seed))
