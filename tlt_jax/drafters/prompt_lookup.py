"""Prompt lookup: drafts by copying what followed the row's last n-gram earlier in its own
prompt and response (prompt lookup decoding). Nothing to train, no state.

Reasoning answers quote their problem (numbers, names, expressions) and repeat their own
steps. For each row the drafter reads its prompt and its response as one sequence, takes the
last `max_ngram` tokens, and finds the longest earlier match of their tail (at least
`min_ngram` tokens); it proposes what followed, a chain of `depth` tokens (`copy_chain`,
shared with the suffix drafter: among the longest matches the most frequent next token, from
its first occurrence, whose continuation is the longest, as prompt lookup decoding takes the
first match). Unlike the suffix drafter it reads no other responses, so it
drafts from the first response of a group on, and reads the prompt, which the suffix drafter
never sees.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafters.base import (Candidates, DraftContext, Drafter, chain_count,
                                   register_drafter)
from tlt_jax.drafters.suffix import copy_chain
from tlt_jax.models.policy import Policy

if TYPE_CHECKING:  # the strategy module imports the drafter registry
  from tlt_jax.speculative.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class PromptLookupSettings:
  """max_ngram: the longest n-gram matched (tokens); min_ngram: shorter matches propose
  nothing. (Config section drafter.prompt_lookup.)"""
  max_ngram: int = 4
  min_ngram: int = 1

  def __post_init__(self):
    if not 1 <= self.min_ngram <= self.max_ngram:
      raise ValueError(f"drafter.prompt_lookup: need 1 <= min_ngram <= max_ngram, got "
                       f"min_ngram={self.min_ngram}, max_ngram={self.max_ngram}")


@register_drafter("prompt_lookup")
@flax.struct.dataclass
class PromptLookupDrafter(Drafter):
  """A chain copied from the row's own prompt and response (see the module docstring)."""
  Settings = PromptLookupSettings
  reads_prompt = True  # the generation state keeps each row's prompt for it
  settings: PromptLookupSettings = flax.struct.field(pytree_node=False,
                                                     default=PromptLookupSettings())

  candidate_count = staticmethod(chain_count)  # one chain of `depth` tokens

  def propose(self, policy: Policy, state, ctx: DraftContext, strategy: Strategy,
              limits: jax.Array | None = None) -> tuple[Candidates, None]:
    seq, total = _prompt_and_response(ctx)                                   # [B, L], [B]
    m = self.settings.max_ngram
    qpos = total[:, None] - m + jnp.arange(m)[None]                          # [B, M]
    query = jnp.where(qpos >= 0, jnp.take_along_axis(seq, jnp.maximum(qpos, 0), 1), -2)
    # A continuation must lie inside the sequence: the query's own end has none.
    valid = jnp.arange(seq.shape[1])[None] < total[:, None]
    return copy_chain(seq[:, None], valid[:, None], query, self.settings.min_ngram,
                      strategy.depth, policy.cfg.vocab_size, limits, earliest=True), state


def _prompt_and_response(ctx: DraftContext) -> tuple[jax.Array, jax.Array]:
  """Each row's prompt followed by its response so far, contiguous ([B, W + N] int32, -1
  after), and its length [B] (the response alone without a kept prompt)."""
  b, n = ctx.out.shape
  prompt = ctx.prompt if ctx.prompt is not None else jnp.full((b, 1), -1, jnp.int32)
  w = prompt.shape[1]
  plen = jnp.sum(prompt >= 0, axis=1, dtype=jnp.int32)
  j = jnp.arange(w + n)[None]
  from_out = jnp.take_along_axis(ctx.out, jnp.clip(j - plen[:, None], 0, n - 1), 1)
  from_prompt = jnp.take_along_axis(prompt, jnp.minimum(j, w - 1), 1)
  total = plen + ctx.num_out
  seq = jnp.where(j < plen[:, None], from_prompt, jnp.where(j < total[:, None], from_out, -1))
  return seq.astype(jnp.int32), total
