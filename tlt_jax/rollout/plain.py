"""Plain batched decoding: prefill, then one token per sequence per step until all stop.

The whole decode loop is one jitted `jax.lax.while_loop` (no host round trip per token); it ends
when every sequence has produced EOS or `max_new_tokens` tokens. This is the baseline that the
rollout engine builds on, and what evaluation uses.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import ModelConfig, decode, init_cache, prefill

# Prompts are right-padded to a multiple of this, so ragged batches of similar length share one
# compiled program.
PROMPT_LEN_MULTIPLE = 32


def sample_next(logits: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
  """[B, V] float32 logits -> [B] int32 tokens: argmax at temperature 0, else a sample."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id", "temperature",
                                             "pad_id"))
def _generate(params, tokens, lengths, cache, key, *, cfg: ModelConfig, max_new_tokens: int,
              eos_id: int, temperature: float, pad_id: int):
  """tokens [B, T] int32 right-padded, lengths [B], an empty cache of T + N slots ->
  (out [B, N] int32, num [B] int32).

  out[b, :num[b]] are row b's new tokens, EOS included when it was produced; the rest is pad_id.
  The cache comes in as an argument: built inside, its zeros would be compile-time constants
  that XLA spends seconds constant-folding through the prefill's attention.
  """
  b = tokens.shape[0]
  logits, _, cache = prefill(params, tokens, lengths, cache, cfg)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  key, sub = jax.random.split(key)
  first = sample_next(last, sub, temperature)
  out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)
  done = first == eos_id

  def cond(state):
    step, _, done, _, _, _ = state
    return (step < max_new_tokens) & ~jnp.all(done)

  def body(state):
    step, tok, done, cache, out, key = state
    key, sub = jax.random.split(key)
    # Finished rows are still computed (the batch is dense) but never written to the cache.
    logits, _, cache = decode(params, tok, cache, cfg, active=~done)
    nxt = sample_next(logits, sub, temperature)
    nxt = jnp.where(done, pad_id, nxt)
    out = jax.lax.dynamic_update_slice(out, nxt[:, None], (0, step))
    return step + 1, nxt, done | (nxt == eos_id), cache, out, key

  state = (jnp.int32(1), first, done, cache, out, key)
  _, _, _, _, out, _ = jax.lax.while_loop(cond, body, state)
  # Row length: up to and including the first EOS, else all max_new_tokens.
  is_eos = out == eos_id
  num = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, max_new_tokens)
  return out, num.astype(jnp.int32)


def generate_plain(params: dict, cfg: ModelConfig, prompt_ids: Sequence[Sequence[int]],
                   max_new_tokens: int, eos_id: int, temperature: float, key: jax.Array,
                   pad_id: int = 0, include_eos: bool = False) -> list[list[int]]:
  """Samples a completion for every prompt with plain batched decoding.

  Args:
    params: policy parameters (any sharding; the batch follows jit's propagation).
    prompt_ids: B prompts of token ids, ragged (each non-empty); right-padded with pad_id to a
      multiple of PROMPT_LEN_MULTIPLE.
    max_new_tokens: the most tokens generated per prompt (EOS counts).
    eos_id: generation of a row stops after this token.
    temperature: 0 = greedy (argmax), else sampling from softmax(logits / temperature).
    key: PRNG key (unused when greedy).
    include_eos: keep the EOS token at the end of finished completions (default: dropped, so a
      completion is exactly the response text's tokens).
  Returns:
    B lists of new token ids; a completion without EOS ran out of max_new_tokens.
  """
  if not prompt_ids:
    return []
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
  if temperature < 0:
    raise ValueError(f"temperature={temperature} must be >= 0")
  lengths = np.array([len(p) for p in prompt_ids], np.int32)
  if lengths.min() < 1:
    raise ValueError(f"prompt {int(lengths.argmin())} is empty; every prompt needs a token")
  t = -(-int(lengths.max()) // PROMPT_LEN_MULTIPLE) * PROMPT_LEN_MULTIPLE
  if t + max_new_tokens > cfg.max_position_embeddings:
    raise ValueError(f"padded prompt length {t} + max_new_tokens {max_new_tokens} exceeds the "
                     f"model's max_position_embeddings={cfg.max_position_embeddings}")
  tokens = np.full((len(prompt_ids), t), pad_id, np.int32)
  for i, p in enumerate(prompt_ids):
    tokens[i, :len(p)] = p
  cache = init_cache(cfg, len(prompt_ids), t + max_new_tokens)
  out, num = _generate(params, tokens, lengths, cache, key, cfg=cfg,
                       max_new_tokens=int(max_new_tokens), eos_id=int(eos_id),
                       temperature=float(temperature), pad_id=int(pad_id))
  out, num = np.asarray(out), np.asarray(num)
  result = []
  for row, n in zip(out, num):
    row = row[:n].tolist()
    if not include_eos and row and row[-1] == eos_id:
      row = row[:-1]
    result.append(row)
  return result
