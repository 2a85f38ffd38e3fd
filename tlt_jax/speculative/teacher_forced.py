"""What SD would accept on responses the policy has already written, without decoding them.

Every token is drawn with the noise of its (request, position) and accepted by the target-only
rule (`tlt_jax.speculative.verify`), so SD emits exactly plain decoding's tokens, and a drafted
node is accepted exactly when it is the token plain decoding draws there. An SD iteration whose
root is response token j therefore accepts 1 + d tree nodes, d the depth of the deepest node
whose path from the root spells response tokens j+1 .. j+d, at any temperature. Given a
response the policy wrote, the trees the drafters would propose at each of its positions say
what any strategy accepts there, with no policy pass per iteration: one prefill gives the
policy's features, one pass over the sequence gives each drafter's state, and the trees of
all positions are drafted in batches. Walking j <- j + 1 + d from the response's first token
gives the iterations SD would run on it.

What a row sees while drafting, as in the engine's tail: its prompt, its response so far, and
its group's other responses as they stand when it reaches position j in lockstep (those
already finished in full, the others up to j + 1 tokens), nothing else. A stateful drafter's
state must be causal and carry `lengths` (a KV cache, as EAGLE's): its state at a position is
the whole sequence's with `lengths` cut there. Features come from one prefill instead of the
engine's decode and verify passes: in float32 the same numbers up to rounding.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.drafters import drafter_class
from tlt_jax.drafters.base import DraftContext
from tlt_jax.models.decoder import prefill
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.policy import Policy
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tree import DraftTree, build_draft_tree


def matched_depth(tree: DraftTree, continuation: jax.Array, valid: jax.Array) -> jax.Array:
  """The depth of the deepest tree node whose path from the root spells the continuation.

  tree: T nodes per row (`DraftTree`); continuation [B, D + 1] int32: at index k the token k
  positions after the root (index 0 unused); valid [B, D + 1] bool: whether that token exists
  (the response goes on). Returns [B] int32 in [0, D]."""
  depth = jnp.maximum(tree.depths, 0)
  wanted = jnp.take_along_axis(continuation, depth, axis=1)                      # [B, T]
  exists = jnp.take_along_axis(valid, depth, axis=1)
  ok = (tree.depths == 0) | ((tree.depths > 0) & exists & (tree.tokens == wanted))
  # A node is on the response's path when it and every ancestor spell it.
  on_path = jnp.all(~tree.mask | ok[:, None, :], axis=2) & (tree.depths >= 0)
  return jnp.max(jnp.where(on_path, tree.depths, 0), axis=1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class ResponseDepths:
  """depths[j]: the matched depth d of an SD iteration rooted at response token j (0 at the
  last token, after which nothing is drafted)."""
  depths: np.ndarray

  def walk(self, start: int = 0) -> list[tuple[int, int]]:
    """The iterations SD runs from root position `start` to the response's end: (root
    position, tree nodes accepted = 1 + d)."""
    out, j, n = [], start, len(self.depths)
    while j < n - 1:
      a = 1 + int(self.depths[j])
      out.append((j, a))
      j += a
    return out


def _truncated(state, lengths: jax.Array):
  """A stateful drafter's whole-sequence state (one row) with its lengths cut to `lengths`."""
  if not isinstance(state, KVCache):
    raise TypeError(f"teacher-forced drafting needs a drafter state that is a KVCache (a "
                    f"causal cache with lengths), got {type(state).__name__}")
  return state.replace(lengths=jnp.reshape(lengths, (1,)).astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("strategy",))
def _positions(policy: Policy, drafters: dict, states: dict, strategy: Strategy, seq, feats,
               prompt_len, response_len, roots, corpus, prompt):
  """Matched depths [R] for roots [R] (response positions) of one sequence, each drafted as
  a batch of one row (vmap): nothing of another position leaks into a row's draft.

  seq [S] int32 prompt + response (0 after); feats [S, F]; corpus [R, C, N] int32 or None;
  prompt [W] int32 (-1 after its end) or None."""
  n = seq.shape[0]
  width = corpus.shape[2] if corpus is not None else n
  d = strategy.depth

  def one(j, rows):
    slot = prompt_len + j
    response = jax.lax.dynamic_slice_in_dim(jnp.pad(seq, (0, width)), prompt_len, width)
    out = jnp.where(jnp.arange(width) <= j, response, 0)
    ctx = DraftContext(root=seq[slot][None], features=feats[slot - 1][None],
                       active=jnp.ones((1,), bool), out=out[None],
                       num_out=(j + 1)[None].astype(jnp.int32),
                       corpus=None if rows is None else rows[None],
                       prompt=None if prompt is None else prompt[None])
    cut = {name: _truncated(st, slot) for name, st in states.items()}
    tree, _ = build_draft_tree(policy, drafters, cut, ctx, strategy)
    k = jnp.arange(d + 1)
    cont = jnp.take(seq, jnp.minimum(slot + k, n - 1))
    valid = (k >= 1) & (j + k < response_len)
    return matched_depth(tree, cont[None], valid[None])[0]

  return jax.vmap(one, in_axes=(0, None if corpus is None else 0))(roots, corpus)


@functools.partial(jax.jit, static_argnames=("names",))
def _sequence_states(policy: Policy, drafters: dict, names: tuple, seq, length):
  """The policy's features of one sequence [S, F] and each named stateful drafter's state over
  it (one row)."""
  cfg = policy.cfg
  tokens, lengths = seq[None], jnp.reshape(length, (1,)).astype(jnp.int32)
  _, feats, _ = prefill(policy.params, tokens, lengths, init_cache(cfg, 1, seq.shape[0]), cfg,
                        fresh=True)
  states = {}
  for name in names:
    empty = drafters[name].init_state(cfg, 1, seq.shape[0])
    states[name] = drafters[name].prefill(policy, empty, tokens, lengths, feats)
  return feats[0], states


def response_depths(policy: Policy, drafters: dict, strategy: Strategy, prompt: list[int],
                    response: list[int], group: list[list[int]] = (), width: int = 0,
                    rows: int = 64, corpus_rows: int = 8, first: int = 0) -> ResponseDepths:
  """The matched depth at every root position of `response` (see the module docstring).

  policy: a Policy; drafters: name -> drafter with weights (those `strategy.drafts` names
  must be there); prompt, response: token ids (the response as the policy wrote it, EOS
  included); group: the other responses to the same prompt (the suffix drafter's corpus, up
  to `corpus_rows` of them, as the engine's rollout.speculative.corpus_rows); width: the
  padded sequence length (0: prompt + response rounded up to 64), one compile per width;
  rows: positions drafted per compiled call (padded); first: draft roots from this response
  position on (the depths before it are left 0: a walk that starts there never reads them)."""
  if len(response) < 2:
    return ResponseDepths(np.zeros((len(response),), np.int32))
  used = {name: drafters[name] for name in strategy.drafts}
  p, r = len(prompt), len(response)
  s = width or -(-(p + r) // 64) * 64
  if p + r > s:
    raise ValueError(f"prompt + response is {p + r} tokens, more than width={s}")
  seq = np.zeros((s,), np.int32)
  seq[:p + r] = list(prompt) + list(response)
  stateful = tuple(name for name, dr in used.items()
                   if dr.init_state(policy.cfg, 1, 64) is not None)
  feats, states = _sequence_states(policy, used, stateful, jnp.asarray(seq), p + r)
  reads_corpus = any(drafter_class(name).reads_corpus for name in used)
  reads_prompt = any(drafter_class(name).reads_prompt for name in used)
  out_width = s - p if reads_corpus else 0
  kept = None
  if reads_prompt:
    kept = np.full((s,), -1, np.int32)
    kept[:p] = prompt
  depths = np.zeros((r,), np.int32)
  siblings = [list(g) for g in group][:corpus_rows]
  for start in range(first, r - 1, rows):
    roots = np.arange(start, start + rows)
    corpus = None
    if reads_corpus:
      corpus = np.full((rows, max(len(siblings), 1), out_width), -1, np.int32)
      for i, j in enumerate(roots):
        for c, sib in enumerate(siblings):  # finished in lockstep, or as far as this row
          take = sib[:min(len(sib), j + 1, out_width)]
          corpus[i, c, :len(take)] = take
    got = _positions(policy, used, states, strategy, jnp.asarray(seq), feats, p, r,
                     jnp.asarray(np.minimum(roots, r - 1), jnp.int32),
                     None if corpus is None else jnp.asarray(corpus),
                     None if kept is None else jnp.asarray(kept))
    take = min(rows, r - 1 - start)
    depths[start:start + take] = np.asarray(got)[:take]
  return ResponseDepths(depths)
