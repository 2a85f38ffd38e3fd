"""The suffix drafter: drafts by copying what followed the current suffix elsewhere. Nothing
to train, no state, all on device.

In GRPO the G samples of one prompt share long stretches of text, and a long response often
repeats itself. For each row the drafter takes its last `max_match` tokens and looks for the
longest match that ends anywhere in its corpus: the row's own response, the other rows of
the batch, and `DraftContext.corpus` (its group's finished siblings, earlier responses to its
prompt). Every match is found by comparing all positions at once (B x R x N x max_match
comparisons per iteration, tiny beside a policy pass), so no index is built or kept on the
host. Among the longest matches the most frequent next token wins, and the drafter proposes
the continuation of its most recent occurrence as one chain of `depth` tokens.

Score of the chain's node at depth d: d * log(c), with c = (share of the longest matches that
continue with the chosen token) * L / (L + 1) for a match of L tokens: a unanimous long match
ranks near 0, the score of a certain EAGLE draft, and a short or split one below it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp

from tlt_jax.drafters.base import (Candidates, DraftContext, Drafter, chain_count,
                                   register_drafter)
from tlt_jax.models.policy import Policy

if TYPE_CHECKING:  # the strategy module imports the drafter registry
  from tlt_jax.speculative.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class SuffixSettings:
  """max_match: the longest suffix compared (tokens); min_match: shorter matches propose
  nothing. (Config section drafter.suffix.)"""
  max_match: int = 8
  min_match: int = 2

  def __post_init__(self):
    if not 1 <= self.min_match <= self.max_match:
      raise ValueError(f"drafter.suffix: need 1 <= min_match <= max_match, got "
                       f"min_match={self.min_match}, max_match={self.max_match}")


@register_drafter("suffix")
@flax.struct.dataclass
class SuffixDrafter(Drafter):
  """Copies what followed the best match of the row's last tokens elsewhere (see the module
  docstring); no weights, no state."""
  Settings = SuffixSettings
  reads_corpus = True  # the decode program takes DraftContext.corpus for it
  settings: SuffixSettings = flax.struct.field(pytree_node=False, default=SuffixSettings())

  candidate_count = staticmethod(chain_count)  # one chain of `depth` tokens

  @classmethod
  def example(cls, cfg, seed: int = 0, settings: SuffixSettings | None = None) -> SuffixDrafter:
    """By default matches of one token count: on short random corpora it then drafts often,
    and is often wrong."""
    del cfg, seed
    return cls(settings=SuffixSettings(min_match=1) if settings is None else settings)

  def propose(self, policy: Policy, state, ctx: DraftContext, strategy: Strategy,
              limits: jax.Array | None = None) -> tuple[Candidates, None]:
    """One chain per row: `depth` tokens copied from the best match (see the module
    docstring); rows without a match of min_match tokens get -inf scores."""
    corpus, valid = self._corpus(ctx)                 # [B, R, N] int32, bool
    m = self.settings.max_match
    # The row's last m tokens, newest last; positions before its response never match.
    qpos = ctx.num_out[:, None] - m + jnp.arange(m)[None]                      # [B, M]
    query = jnp.where(qpos >= 0, jnp.take_along_axis(ctx.out, jnp.maximum(qpos, 0), 1), -2)
    return copy_chain(corpus, valid, query, self.settings.min_match, strategy.depth,
                      policy.cfg.vocab_size, limits), state

  @staticmethod
  def _corpus(ctx: DraftContext) -> tuple[jax.Array, jax.Array]:
    """[B, R, N] token ids a row may copy from and where they are real: ctx.corpus's rows,
    then every row of the batch (its own included) up to its num_out."""
    b, n = ctx.out.shape
    batch = jnp.broadcast_to(ctx.out[None], (b, b, n))
    batch_valid = jnp.broadcast_to((jnp.arange(n)[None] < ctx.num_out[:, None])[None], (b, b, n))
    if ctx.corpus is None:
      return jnp.where(batch_valid, batch, -1), batch_valid
    extra = ctx.corpus
    if extra.shape[2] != n:  # responses are cut or padded to the output width
      extra = jnp.pad(extra, ((0, 0), (0, 0), (0, max(n - extra.shape[2], 0))),
                      constant_values=-1)[..., :n]
    corpus = jnp.concatenate([extra, jnp.where(batch_valid, batch, -1)], axis=1)
    return corpus, corpus >= 0


def copy_chain(corpus: jax.Array, valid: jax.Array, query: jax.Array, min_match: int,
               depth: int, vocab_size: int, limits: jax.Array | None = None,
               earliest: bool = False) -> Candidates:
  """One chain of `depth` tokens per row, copied from where the query's tail matches longest.

  corpus [B, R, N] int32 and valid [B, R, N] bool: the token sequences a row may copy from
  and where they hold tokens; query [B, M] int32: the row's last M tokens, newest last (a
  negative id never matches). Among the longest matches (at least min_match tokens) the
  most frequent next token wins, and the chain continues from its most recent occurrence (the
  last in (corpus row, position) order; with `earliest`, the first, whose continuation is the
  longest in a single sequence). The node at depth d scores d * log(c), c = (share of
  the longest matches that continue with the chosen token) * L / (L + 1) for a match of L
  tokens; rows without a match, and nodes past a sequence's end or deeper than limits[0],
  score -inf.
  """
  b, _, n = corpus.shape
  m = query.shape[1]
  # length[b, r, p]: how many tokens before position p match the query's tail.
  length = jnp.zeros(corpus.shape, jnp.int32)
  running = jnp.ones(corpus.shape, bool)
  for k in range(1, m + 1):
    before = jnp.pad(corpus, ((0, 0), (0, 0), (k, 0)), constant_values=-1)[..., :n]
    running = running & (before == query[:, m - k, None, None])
    length = length + running
  length = jnp.where(valid, length, 0)  # p must hold a continuation token
  best = jnp.max(length, axis=(1, 2))                                          # [B]
  longest = (length == best[:, None, None]) & (best >= min_match)[:, None, None]

  # The most frequent next token among the longest matches, and its share.
  first = jnp.where(longest, corpus, 0).reshape(b, -1)
  counts = jnp.zeros((b, vocab_size), jnp.int32).at[
      jnp.arange(b)[:, None], first].add(longest.reshape(b, -1).astype(jnp.int32))
  token = jnp.argmax(counts, axis=1)
  share = jnp.max(counts, axis=1) / jnp.maximum(jnp.sum(counts, axis=1), 1)
  # Its most recent occurrence: the last such position in (corpus row, position) order.
  chosen = longest.reshape(b, -1) & (first == token[:, None])
  at = (jnp.argmax(chosen, axis=1) if earliest else
        jnp.argmax(jnp.where(chosen, jnp.arange(chosen.shape[1])[None], -1), axis=1))
  row, pos = at // n, at % n

  j = jnp.arange(depth)[None]
  src = jnp.minimum(pos[:, None] + j, n - 1)
  rows_of = lambda x: jnp.take_along_axis(x, row[:, None, None], 1)[:, 0]  # noqa: E731
  tokens = jnp.take_along_axis(rows_of(corpus), src, 1)
  ok = jnp.take_along_axis(rows_of(valid), src, 1) & (pos[:, None] + j < n)
  ok = jnp.cumprod(ok, axis=1).astype(bool) & (best >= min_match)[:, None]
  if limits is not None:
    ok = ok & (j < limits[0])
  conf = share * best / (best + 1.0)
  scores = jnp.where(ok, (j + 1) * jnp.log(jnp.maximum(conf, 1e-6))[:, None], -jnp.inf)
  parents = jnp.broadcast_to(jnp.arange(-1, depth - 1, dtype=jnp.int32), (b, depth))
  return Candidates(tokens=jnp.where(ok, tokens, 0).astype(jnp.int32), parents=parents,
                    scores=scores.astype(jnp.float32))
