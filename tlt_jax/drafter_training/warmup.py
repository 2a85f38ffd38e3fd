"""Offline drafter warm-up on the policy's own generations (the EAGLE warm-up stage).

collect_samples: recompute the policy's features over prompt + completion (one batched
prefill per group), so the drafter trains on exactly what it will be fed while drafting.
train_drafter: packs the samples into windows once and runs jitted updates on random rows
(every trained drafter of the run in one update, `train_step`).
cached_responses: the policy's responses to train on, kept in a file that a like rerun reuses.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from tlt_jax.drafter_training.train_step import (DrafterOptConfig, DrafterTrainState,
                                                 init_train_state, jit_train_step)
from tlt_jax.drafter_training.windows import Sample, pack_windows
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import prefill
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.run_log import write_json, write_jsonl
from tlt_jax.speculative.sampling import SamplingParams


def collect_samples(policy_params: dict, cfg: ModelConfig, prompts: list[list[int]],
                    completions: list[list[int]], batch_size: int = 32) -> list[Sample]:
  """Samples (tokens, policy features) of prompt + completion pairs; training starts at the last
  prompt token, whose feature predicts the first completion token. As in the feature buffer, a
  sample ends before the last token: its feature predicts what follows the response (after its EOS),
  which is never drafted; the token itself is still the previous slot's label."""
  seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
  # Batches of similar lengths, each padded to a power of two (at least 16, at most the
  # longest sequence's multiple of 16): a long-tailed set of responses computes about its own
  # tokens, in a few shapes, not one per length.
  order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
  widest = -(-max(map(len, seqs)) // 16) * 16
  # The empty cache is an argument, not a constant XLA would fold through the attention.
  run = jax.jit(lambda params, toks, lens, cache: prefill(params, toks, lens, cache, cfg)[1])
  samples: list[Sample | None] = [None] * len(seqs)
  for start in range(0, len(seqs), batch_size):
    group = order[start:start + batch_size]
    width = min(widest, max(16, 1 << (max(len(seqs[i]) for i in group) - 1).bit_length()))
    toks = np.zeros((batch_size, width), np.int32)
    lens = np.ones((batch_size,), np.int32)
    for row, i in enumerate(group):
      toks[row, :len(seqs[i])], lens[row] = seqs[i], len(seqs[i])
    feats = np.asarray(run(policy_params, jnp.asarray(toks), jnp.asarray(lens),
                           init_cache(cfg, batch_size, width)), np.float32)
    for row, i in enumerate(group):
      samples[i] = Sample(tokens=np.asarray(seqs[i][:-1], np.int32),
                          features=feats[row, :len(seqs[i]) - 1],
                          train_from=len(prompts[i]) - 1)
  return samples


def train_drafter(drafter_params: dict, policy_params: dict, samples: list[Sample],
                  cfg: ModelConfig, settings: dict, oc: DrafterOptConfig, steps: int,
                  window: int = 256, batch_rows: int = 8, seed: int = 0,
                  progress: bool = True, state: DrafterTrainState | None = None,
                  on_step=None, should_stop=None) -> tuple[dict, list[dict]]:
  """Updates on batches of `batch_rows` random windows until the train state has taken
  `steps` steps; returns (params, metrics per step as floats). Step s draws the same rows
  whether the run got there in one go or resumed on the way.

  drafter_params / settings: name -> each trained drafter's weights / Settings.

  state: resume from this train state (its `step` counts the steps already taken).
  on_step: optional `fn(step, state, metrics)` after each update (checkpoints, logs).
  should_stop: optional `fn() -> bool`, asked after on_step: True ends training there.
  """
  windows = pack_windows(samples, window)
  update = jit_train_step(cfg, settings, oc)
  state = init_train_state(drafter_params, oc) if state is None else state
  first = int(state.step)
  rng = np.random.default_rng([seed, 0])
  for _ in range(first):  # a resumed run skips the rows of the steps it has taken
    rng.integers(0, windows.tokens.shape[0], batch_rows)
  history = []
  bar = tqdm(range(first, steps), desc="drafter warm-up", disable=not progress,
             initial=first, total=steps)
  for step in bar:
    rows = rng.integers(0, windows.tokens.shape[0], batch_rows)
    batch = jax.tree.map(lambda x: jnp.asarray(x[rows]), windows)
    state, metrics = update(state, policy_params, batch)
    metrics = {k: float(v) for k, v in metrics.items()}
    history.append(metrics)
    bar.set_postfix(loss=f"{metrics['loss']:.3f}", top1=f"{metrics['top1']:.2f}")
    if on_step is not None:
      on_step(step + 1, state, metrics)
    if should_stop is not None and should_stop():
      break
  return state.params, history


def cached_responses(engine, prompts, samples: int, temperature: float, seed: int,
                     path: str, job, made_by: dict) -> list[list[int]]:
  """The policy's completions, one per (prompt, sample), from `engine` (a RolloutEngine);
  cached in `path` (JSONL, written when `job.writer`; `job.say` reports) with `made_by` (what
  else decides them: the policy, the token budget) in path + '.json'. The cache serves a
  rerun only when it holds these prompts and was made with these settings."""
  n = len(prompts) * samples
  made_by = dict(made_by, samples=samples, temperature=temperature, seed=seed)
  asked = [list(prompts[i // samples]) for i in range(n)]  # each request's prompt
  if os.path.isfile(path) and os.path.isfile(path + ".json"):
    with open(path) as f, open(path + ".json") as g:
      rows = [json.loads(line) for line in f]
      recorded = json.load(g)
    if recorded == made_by and [r["prompt"] for r in rows] == asked:
      job.say(f"reusing {n} responses from {path}")
      return [r["completion"] for r in rows]
    job.say(f"{path} holds other prompts or settings: generating again")
  result = engine.generate(prompts, samples, SamplingParams(temperature), jax.random.key(seed))
  if job.writer:  # never a half-written cache, and its settings only once it is whole
    write_jsonl(path, ({"prompt": p, "completion": t} for p, t in zip(asked, result.tokens)))
    write_json(path + ".json", made_by)
  job.say(f"generated {n} responses ({int(result.lengths.sum())} tokens) in "
          f"{result.wall_s:.1f} s")
  return result.tokens
