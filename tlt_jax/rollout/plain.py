"""Plain batched decoding in one compiled program: prefill, then decode until every row stops.

`generate_plain` is `start` followed by one `decode_loop` of plain steps (the same pure steps
and sampler the rollout engine runs), jitted as a whole: no host round trip per token. It ends
when every sequence has produced EOS or `max_new_tokens` tokens. Evaluation uses it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models import ModelConfig, init_cache
from tlt_jax.speculative.decoding import decode_loop, start
from tlt_jax.speculative.sampling import SamplingParams

# Prompts are right-padded to a multiple of this, so ragged batches of similar length share one
# compiled program.
PROMPT_LEN_MULTIPLE = 32


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "eos_id", "sp"))
def _generate(params, tokens, lengths, cache, key, *, cfg: ModelConfig, max_new_tokens: int,
              eos_id: int, sp: SamplingParams):
  """tokens [B, T] int32 right-padded, lengths [B], an empty cache of T + N slots ->
  (out [B, N] int32, num [B] int32): row b's new tokens are out[b, :num[b]], EOS included.

  The cache comes in as an argument: built inside, its zeros would be compile-time constants
  that XLA spends seconds constant-folding through the prefill's attention.
  """
  state = start(params, tokens, lengths, cache, key, sp, max_new_tokens, eos_id, cfg)
  state, _, _ = decode_loop(params, None, state, key, jnp.int32(1), jnp.int32(max_new_tokens),
                            sp, eos_id, cfg)
  return state.out, state.num_out


def generate_plain(params: dict, cfg: ModelConfig, prompt_ids: Sequence[Sequence[int]],
                   max_new_tokens: int, eos_id: int, sampling: SamplingParams, key: jax.Array,
                   pad_id: int = 0, include_eos: bool = False) -> list[list[int]]:
  """A completion for every prompt with plain batched decoding.

  Args:
    params: policy parameters (any sharding; the batch follows jit's propagation).
    prompt_ids: B prompts of token ids, ragged (each non-empty); right-padded with pad_id to a
      multiple of PROMPT_LEN_MULTIPLE.
    max_new_tokens: the most tokens generated per prompt (EOS counts).
    eos_id: generation of a row stops after this token.
    sampling: the target distribution (temperature 0 = greedy); prompt i is request i, so
      its tokens are those the rollout engine would sample for request i with this key.
    include_eos: keep the EOS token at the end of finished completions (default: dropped, so a
      completion is exactly the response text's tokens).
  Returns:
    B lists of new token ids; a completion without EOS ran out of max_new_tokens.
  """
  if not prompt_ids:
    return []
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
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
                       max_new_tokens=int(max_new_tokens), eos_id=int(eos_id), sp=sampling)
  out, num = np.asarray(out), np.asarray(num)
  result = []
  for row, n in zip(out, num):
    row = row[:n].tolist()
    if not include_eos and row and row[-1] == eos_id:
      row = row[:-1]
    result.append(row)
  return result
