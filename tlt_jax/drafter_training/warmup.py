"""Offline drafter warm-up on the policy's own generations (the EAGLE warm-up stage).

collect_samples: recompute the policy's features over prompt + completion (one batched
prefill per group), so the drafter trains on exactly what it will be fed while drafting.
train_drafter: packs the samples into windows once and runs jitted updates on random rows
(every trained drafter of the run in one update, `train_step`).
cached_responses: the policy's responses to train on, kept in a file that a like rerun reuses.
read_responses: responses the policy wrote elsewhere (a GPU lease's), to train on instead.
"""

from __future__ import annotations

import json
import lzma
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
                    completions: list[list[int]], batch_size: int = 32,
                    max_tokens: int = 16384, progress: bool = False) -> list[Sample]:
  """Samples (tokens, policy features) of prompt + completion pairs; training starts at the last
  prompt token, whose feature predicts the first completion token. As in the feature buffer, a
  sample ends before the last token: its feature predicts what follows the response (after its EOS),
  which is never drafted; the token itself is still the previous slot's label.

  Each prefill holds at most batch_size rows and, past one row, max_tokens padded tokens."""
  seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
  order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
  widest = -(-max(map(len, seqs)) // 16) * 16
  # The empty cache is an argument, not a constant XLA would fold through the attention.
  run = jax.jit(lambda params, toks, lens, cache: prefill(params, toks, lens, cache, cfg)[1])
  samples: list[Sample | None] = [None] * len(seqs)
  bar = tqdm(total=len(seqs), desc="drafter features", unit="response", disable=not progress)
  for group, rows, width in _length_batches([len(seqs[i]) for i in order], batch_size,
                                            max_tokens, widest):
    group = [order[j] for j in group]
    toks = np.zeros((rows, width), np.int32)
    lens = np.ones((rows,), np.int32)
    for row, i in enumerate(group):
      toks[row, :len(seqs[i])], lens[row] = seqs[i], len(seqs[i])
    feats = np.asarray(run(policy_params, jnp.asarray(toks), jnp.asarray(lens),
                           init_cache(cfg, rows, width)), np.float32)
    for row, i in enumerate(group):
      samples[i] = Sample(tokens=np.asarray(seqs[i][:-1], np.int32),
                          features=feats[row, :len(seqs[i]) - 1],
                          train_from=len(prompts[i]) - 1)
    bar.update(len(group))
  bar.close()
  return samples


def _length_batches(lengths: list[int], batch_size: int, max_tokens: int, widest: int):
  """(indices into lengths, rows, width) per prefill over ascending `lengths`: batches of
  similar lengths, each padded to a power-of-two width (at least 16, at most `widest`), of
  batch_size rows halved while they would take more than max_tokens: a long-tailed set
  computes about its own tokens in a few shapes, and its longest responses do not hold
  batch_size x the longest width at once."""
  def width_of(n):
    return min(widest, max(16, 1 << (n - 1).bit_length()))
  start = 0
  while start < len(lengths):
    rows = batch_size
    while rows > 1 and rows * width_of(lengths[min(start + rows, len(lengths)) - 1]) > max_tokens:
      rows //= 2
    end = min(start + rows, len(lengths))
    yield list(range(start, end)), rows, width_of(lengths[end - 1])
    start = end


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
                     path: str, job, made_by: dict, should_stop=None) -> list[list[int]]:
  """The policy's completions, one per (prompt, sample), from `engine` (a RolloutEngine);
  cached in `path` (JSONL, written when `job.writer`; `job.say` reports) with `made_by` (what
  else decides them: the policy, the token budget) in path + '.json'. The cache serves a
  rerun only when it holds these prompts and was made with these settings. should_stop: passed
  to the engine's generate (a stop signal ends the generation between two calls)."""
  n = len(prompts) * samples
  # As the file will hold it (tuples read back as lists), so that a like rerun matches it.
  made_by = json.loads(json.dumps(dict(made_by, samples=samples, temperature=temperature,
                                       seed=seed)))
  asked = [list(prompts[i // samples]) for i in range(n)]  # each request's prompt
  if os.path.isfile(path) and os.path.isfile(path + ".json"):
    with open(path) as f, open(path + ".json") as g:
      rows = [json.loads(line) for line in f]
      recorded = json.load(g)
    if recorded == made_by and [r["prompt"] for r in rows] == asked:
      job.say(f"reusing {n} responses from {path}")
      return [r["completion"] for r in rows]
    job.say(f"{path} holds other prompts or settings: generating again")
  result = engine.generate(prompts, samples, SamplingParams(temperature), jax.random.key(seed),
                           should_stop=should_stop)
  if job.writer:  # never a half-written cache, and its settings only once it is whole
    write_jsonl(path, ({"prompt": p, "completion": t} for p, t in zip(asked, result.tokens)))
    write_json(path + ".json", made_by)
  job.say(f"generated {n} responses ({int(result.lengths.sum())} tokens) in "
          f"{result.wall_s:.1f} s")
  return result.tokens


def read_responses(path: str) -> tuple[list[list[int]], list[list[int]]]:
  """(prompts, completions) token ids of a responses file: JSON lines of {"prompt",
  "completion"} (cached_responses' own, experiments/tail_accept.py's), or of a GPU lease's
  responses.jsonl.xz ({"prompt_ids", "token_ids", "precision", "variant"}: its
  default-precision baseline's responses, each once). ValueError naming the file and what it
  lacks."""
  opener = lzma.open if path.endswith(".xz") else open
  try:
    with opener(path, "rt") as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, EOFError, lzma.LZMAError, json.JSONDecodeError) as e:
    raise ValueError(f"{path}: not a readable responses file ({e})") from None
  if rows and "token_ids" in rows[0]:
    rows = [{"prompt": r["prompt_ids"], "completion": r["token_ids"]} for r in rows
            if r.get("precision", "default") == "default"
            and r.get("variant", "baseline") == "baseline"]
  if not rows or any("prompt" not in r or "completion" not in r for r in rows):
    raise ValueError(f"{path}: expected JSON lines with 'prompt' and 'completion' token ids "
                     f"(or a GPU lease's 'prompt_ids' and 'token_ids'), found "
                     f"{sorted(rows[0]) if rows else 'no rows'}")
  return [r["prompt"] for r in rows], [r["completion"] for r in rows]
