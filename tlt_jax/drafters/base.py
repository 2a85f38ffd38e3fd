"""What every drafter is: the interface the speculative step drives, and what it proposes.

A drafter is a pytree (a `flax.struct.dataclass`: weights as leaves, config as static fields)
with these methods, all pure and jittable; `policy` is a `tlt_jax.models.policy.Policy`:

  init_state(cfg, batch, capacity) -> state or None   (cfg: the policy's ModelConfig)
      Its per-row state for `batch` rows of up to `capacity` tokens (row-first arrays with
      `row_axes()` / `logical_axes()`, like a KVCache); None for a stateless drafter, which
      then gets no prefill or catch-up calls.
  prefill(policy, state, prompts [B, P], lengths [B], hidden [B, P, F]) -> state
      Reads the prompts and the policy's features of them.
  catch_up(policy, state, tokens [B, A], prev_features [B, A, F], count [B]) -> state
      Appends the first count[b] pairs (x_s, f_{s-1}) of committed tokens (a plain step's one
      token, or an SD iteration's accepted path). After a `propose` of its own the drafter
      already holds the root pair, and the pairs start after it.
  propose(policy, state, ctx: DraftContext, strategy, limits) -> (Candidates, state)
      Candidates for the next tokens after ctx.root, at most `candidate_count(depth, topk)`
      of them. limits: None, or int32 [2] (depth, verify_tokens) of a smaller strategy run in
      `strategy`'s shapes: candidates deeper than limits[0] must score -inf.
  candidate_count(depth, topk) -> int  (a staticmethod)
  reads_corpus: bool  (a class attribute) whether it reads DraftContext.corpus, which the
      engine then builds for its programs
  loss(policy, batch, **options) -> (scalar, metrics)  (trained drafters only)

The registry in `tlt_jax.drafters` names them; a strategy's `drafts` says which propose.
Candidates of several drafters are merged into one tree (`tlt_jax.speculative.tree`), and
verification never reads a drafter's scores or probabilities: whatever is drafted, the
emitted tokens are those of plain decoding.
"""

from __future__ import annotations

import flax.struct
import jax


@flax.struct.dataclass
class Candidates:
  """Draft candidates below one root, in topological order (a parent before its children).

  tokens [B, C] int32 policy token ids; parents [B, C] int32: the parent's index among these
  candidates, -1 for a child of the root; scores [B, C] float32: a parent never scores below
  its children (the tree keeps the best-scored candidates), -inf for no candidate.
  """
  tokens: jax.Array
  parents: jax.Array
  scores: jax.Array


@flax.struct.dataclass
class DraftContext:
  """What a drafter may read at one SD iteration.

  root [B] int32: the newest token (sampled, in no cache yet); features [B, F]: the policy's
  features of the token before it; active [B] bool: running rows; out [B, N] int32 and
  num_out [B] int32: each row's generated tokens so far (root included, 0 past num_out);
  corpus [B, S, L] int32 or None: other responses a row may copy from (its group's finished
  siblings, earlier responses to its prompt), -1 past their ends.
  """
  root: jax.Array
  features: jax.Array
  active: jax.Array
  out: jax.Array
  num_out: jax.Array
  corpus: jax.Array | None = None
