"""Generation state and the steps that advance it: a plain decode step, one
speculative-decoding iteration (draft a tree, verify, accept, commit), and `decode_loop`,
several of either in one compiled call. All are pure functions with no host sync inside.

Every token is drawn with the noise of its (request, response position) (see
`tlt_jax.speculative.sampling`), so the same rollout key gives the same tokens whichever
steps produced them.

Invariant between steps, per row with n committed tokens (prompt + generated so far):
  cache         policy KV of tokens x_0 .. x_{n-1}              (lengths n)
  drafts        each stateful drafter's state, e.g. EAGLE's KV of pairs (x_s, f_{s-1}),
                s < n (lengths n)
  root          x_n: sampled and emitted, not yet in either cache
  features      f_{n-1}: the policy's final-norm hidden state of x_{n-1}
  out/num_out   generated tokens so far (root included); done: EOS emitted or budget reached
  out_logp      log q of each generated token under the distribution it was drawn from,
                as the trainer scores it (`token_log_probs`): what the update's importance
                ratio compares with
  request       the row's request id: with the position in the response, it picks the noise
                that samples each token (-1 for padding rows)
  feature_log   optional [B, C, F]: f_i at slot i for every committed token i < n, written in
                the same compiled calls, so drafter training gets the policy's own features
                without a host round trip per token (C = the cache capacity)
  prompt        optional [B, W] int32: the row's prompt, -1 past its end (kept when a drafter
                reads it, W = C - max_new_tokens)
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from tlt_jax.drafters.base import DraftContext
from tlt_jax.models.decoder import commit, decode, prefill, verify
from tlt_jax.models.kv_cache import KVCache
from tlt_jax.models.policy import Policy
from tlt_jax.speculative.sampling import (SamplingParams, log_softmax, sample_tokens,
                                          support_logits, target_probs, token_noise)
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tree import build_draft_tree
from tlt_jax.speculative.verify import accept_tree


def batch_first(x) -> P:
  """Logical axes of an array whose leading axis is the batch: ('batch', None, ...); a scalar
  has none."""
  if not x.shape:
    return P()
  return P("batch", *([None] * (len(x.shape) - 1)))


@flax.struct.dataclass
class GenState:
  """The rows of a batch being generated (see the module docstring). Every array but the
  caches' K/V is batch-first; `row_axes` and `logical_axes` say so for every leaf."""
  cache: KVCache
  drafts: dict           # name -> state of each stateful drafter (`tlt_jax.drafters`)
  root: jax.Array        # [B] int32
  features: jax.Array    # [B, E]
  out: jax.Array         # [B, max_new_tokens] int32 (0 past num_out)
  out_logp: jax.Array    # [B, max_new_tokens] float32 (0 past num_out)
  num_out: jax.Array     # [B] int32
  done: jax.Array        # [B] bool
  request: jax.Array     # [B] int32
  feature_log: jax.Array | None = None  # [B, C, F] (see the module docstring)
  prompt: jax.Array | None = None       # [B, W] int32 (see the module docstring)

  def row_axes(self) -> "GenState":
    """The batch-row axis of every array (a GenState of ints)."""
    return jax.tree.map(lambda _: 0, self).replace(
        cache=self.cache.row_axes(),
        drafts={name: st.row_axes() for name, st in self.drafts.items()})

  def logical_axes(self) -> "GenState":
    """The logical axis names of every array (a GenState of PartitionSpecs): the caches'
    own, batch-first for the rest."""
    return jax.tree.map(batch_first, self).replace(
        cache=self.cache.logical_axes(),
        drafts={name: st.logical_axes() for name, st in self.drafts.items()})


@flax.struct.dataclass
class StepStats:
  """Per-row counts of one or more steps: emitted [B] tokens written to `out`; accepted [B]
  tokens gained per row (tree nodes accepted including the root: 1 per plain step);
  iterations [B]: how many iterations the row was running in."""
  emitted: jax.Array
  accepted: jax.Array
  iterations: jax.Array


def token_logp(logits: jax.Array, tokens: jax.Array, sp: SamplingParams) -> jax.Array:
  """log q(tokens) [...] float32 from logits [..., V] and tokens [...] int32, q the sampling
  distribution sp (temperature, top-k, top-p): computed as the trainer computes it
  (`tlt_jax.rl.loss.token_log_probs`, a log-softmax of the support's logits), so that where
  both see the same logits they report the same number."""
  logq = log_softmax(support_logits(logits, sp), sp)
  return jnp.take_along_axis(logq, tokens[..., None], axis=-1)[..., 0]


def _emit(state: GenState, tokens: jax.Array, count: jax.Array, eos_id: int,
          logps: jax.Array) -> tuple:
  """Appends up to count[b] of tokens [B, P] (and their log-probs [B, P]) to `out` and
  `out_logp`, stopping after EOS or at the budget."""
  p = tokens.shape[1]
  j = jnp.arange(p)[None, :]
  valid = (j < count[:, None]) & ~state.done[:, None]
  is_eos = valid & (tokens == eos_id) if eos_id >= 0 else jnp.zeros_like(valid)
  # Keep tokens up to and including the first EOS.
  after_eos = (jnp.cumsum(is_eos, axis=1) - is_eos) > 0
  room = state.out.shape[1] - state.num_out
  keep = valid & ~after_eos & (j < room[:, None])
  emitted = jnp.sum(keep, axis=1, dtype=jnp.int32)
  slots = jnp.where(keep, state.num_out[:, None] + j, state.out.shape[1])
  rows = jnp.arange(tokens.shape[0])[:, None]
  out = state.out.at[rows, slots].set(tokens, mode="drop")
  out_logp = state.out_logp.at[rows, slots].set(logps.astype(jnp.float32), mode="drop")
  num_out = state.num_out + emitted
  done = state.done | jnp.any(is_eos & keep, axis=1) | (num_out >= state.out.shape[1])
  return out, out_logp, num_out, done, emitted


def _log_features(log: jax.Array | None, feats: jax.Array, first: jax.Array,
                  count: jax.Array) -> jax.Array | None:
  """log [B, C, F] with feats [B, P, F] written at slots first[b] + j for j < count[b]."""
  if log is None:
    return None
  b, p = feats.shape[:2]
  j = jnp.arange(p)[None]
  slots = jnp.where(j < count[:, None], first[:, None] + j, log.shape[1])
  return log.at[jnp.arange(b)[:, None], slots].set(feats.astype(log.dtype), mode="drop")


def start(policy: Policy, prompts: jax.Array, lengths: jax.Array, cache: KVCache,
          key: jax.Array, sp: SamplingParams, max_new_tokens: int, eos_id: int,
          drafters: dict | None = None, draft_states: dict | None = None,
          log_features: bool = False, requests: jax.Array | None = None,
          source: jax.Array | None = None) -> GenState:
  """Prefills right-padded prompts [B, P] (lengths [B] >= 1) into an empty policy cache
  (fresh from init_cache, B rows) and samples the first token.

  key: the rollout's key; requests: [B] int32 request ids (default 0 .. B-1, -1 = padding):
    together they fix every token's noise.
  drafters: name -> drafter (`tlt_jax.drafters`); draft_states: name -> the empty state of
    each stateful one (its `init_state`), which reads the prompts here. When one of them
    `reads_prompt`, the state keeps each row's prompt (`GenState.prompt`).
  log_features: keep a feature_log [B, C, F] (C = the cache capacity), starting with the
  prompt's features.
  source: optional [B] int32 when prompts [U, P] and lengths [U] hold distinct prompts: row b
    starts from prompt source[b], so the samples of one prompt share one prefill.
  """
  cfg = policy.cfg
  sp = sp.with_numerics(cfg.numerics)
  logits, hidden, cache = prefill(policy.params, prompts, lengths, cache, cfg, fresh=True,
                                  last_logits=True, rows=source)
  if source is not None:
    prompts, lengths = prompts[source], lengths[source]
  b = prompts.shape[0]
  if requests is None:
    requests = jnp.arange(b, dtype=jnp.int32)
  root = sample_tokens(target_probs(logits, sp), key, requests, jnp.zeros((b,), jnp.int32), sp)
  root_logp = token_logp(logits, root, sp)
  drafts = {name: drafters[name].prefill(policy, st, prompts, lengths, hidden)
            for name, st in (draft_states or {}).items()}
  log = None
  if log_features:
    log = jnp.zeros((b, cache.k.shape[3], hidden.shape[-1]), hidden.dtype)
    log = _log_features(log, hidden, jnp.zeros_like(lengths), lengths)
  kept = None
  if any(d.reads_prompt for d in (drafters or {}).values()):
    width = max(cache.k.shape[3] - max_new_tokens, prompts.shape[1])  # one width per engine
    kept = jnp.where(jnp.arange(prompts.shape[1])[None] < lengths[:, None], prompts, -1)
    kept = jnp.pad(kept, ((0, 0), (0, width - prompts.shape[1])), constant_values=-1)
  last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
  state = GenState(cache=cache, drafts=drafts, root=root, features=last,
                   out=jnp.zeros((b, max_new_tokens), jnp.int32),
                   out_logp=jnp.zeros((b, max_new_tokens), jnp.float32),
                   num_out=jnp.zeros((b,), jnp.int32), done=jnp.zeros((b,), bool),
                   request=requests.astype(jnp.int32), feature_log=log,
                   prompt=None if kept is None else kept.astype(jnp.int32))
  out, out_logp, num_out, done, _ = _emit(state, root[:, None], jnp.ones((b,), jnp.int32),
                                          eos_id, root_logp[:, None])
  return state.replace(out=out, out_logp=out_logp, num_out=num_out, done=done)


def _catch_up(policy: Policy, drafters: dict, states: dict, tokens: jax.Array,
              prev_features: jax.Array, count: jax.Array, proposed=()) -> dict:
  """Every stateful drafter's state with the committed pairs (tokens [B, A], prev_features
  [B, A, F]; the first count[b] are real) appended; a drafter in `proposed` already holds
  the first pair (the root's), so it gets the rest."""
  new = {}
  for name, st in states.items():
    skip = 1 if name in proposed else 0
    new[name] = drafters[name].catch_up(policy, st, tokens[:, skip:], prev_features[:, skip:],
                                        jnp.maximum(count - skip, 0))
  return new


def plain_step(policy: Policy, state: GenState, key: jax.Array, sp: SamplingParams,
               eos_id: int, drafters: dict | None = None) -> tuple[GenState, StepStats]:
  """Commits the root, samples the token of the next position (key: the rollout's key).
  The stateful drafters' states are kept in step too (`drafters`: name -> drafter)."""
  sp = sp.with_numerics(policy.cfg.numerics)
  active = ~state.done
  act = active.astype(jnp.int32)
  logits, hidden, cache = decode(policy.params, state.root, state.cache, policy.cfg,
                                 active=active)
  drafts = _catch_up(policy, drafters or {}, state.drafts, state.root[:, None],
                     state.features[:, None], act)
  nxt = sample_tokens(target_probs(logits, sp), key, state.request, state.num_out, sp)
  log = _log_features(state.feature_log, hidden[:, None], state.cache.lengths, act)
  state = state.replace(cache=cache, drafts=drafts, feature_log=log,
                        root=jnp.where(active, nxt, state.root),
                        features=jnp.where(active[:, None], hidden, state.features))
  out, out_logp, num_out, done, emitted = _emit(state, nxt[:, None], act, eos_id,
                                                token_logp(logits, nxt, sp)[:, None])
  stats = StepStats(emitted=emitted, accepted=act, iterations=act)
  return state.replace(out=out, out_logp=out_logp, num_out=num_out, done=done), stats


def sd_step(policy: Policy, drafters: dict, state: GenState, key: jax.Array,
            sp: SamplingParams, eos_id: int, strategy: Strategy,
            limits: jax.Array | None = None, corpus: jax.Array | None = None
            ) -> tuple[GenState, StepStats]:
  """One speculative iteration: draft a tree with the drafters `strategy.drafts` names, verify
  it in one policy pass, accept exactly, commit the accepted path to the policy's cache and
  every drafter's state, emit the accepted tokens and the one after them. The tokens are
  those plain steps would emit with the same key (see `verify`), whatever was drafted.

  drafters: name -> drafter (`tlt_jax.drafters`).
  limits: optional int32 [2], (depth, verify_tokens) of a smaller strategy run in
    `strategy`'s shapes (`build_draft_tree`): the same tree, padded, so the same tokens and
    accept lengths as the smaller strategy's own program.
  corpus: optional [B, S, L] int32 responses the suffix drafter may copy from (-1 padding).
  """
  sp = sp.with_numerics(policy.cfg.numerics)
  active = ~state.done
  act = active.astype(jnp.int32)
  ctx = DraftContext(root=state.root, features=state.features, active=active, out=state.out,
                     num_out=state.num_out, corpus=corpus, prompt=state.prompt)
  tree, drafts = build_draft_tree(policy, drafters, state.drafts, ctx, strategy, limits)
  logits, hidden, tree_kv = verify(policy.params, tree.tokens, tree.depths, tree.mask,
                                   state.cache, policy.cfg)
  d = strategy.depth
  noise = None if sp.greedy else token_noise(
      key, state.request, state.num_out[:, None] + jnp.arange(d + 1)[None], logits.shape[-1],
      sp)
  acc = accept_tree(tree, target_probs(logits, sp), noise, d, sp)
  cache = commit(state.cache, tree_kv, acc.path, acc.num_nodes * act)

  # Drafter catch-up: the pairs (a_i, f of the node before a_i) of the accepted path, with the
  # policy's true features (a drafter that proposed holds the root pair already).
  path_tokens = jnp.take_along_axis(tree.tokens, acc.path, axis=1)  # [B, D+1]
  path_feats = jnp.take_along_axis(hidden, acc.path[:, :, None], axis=1)  # [B, D+1, E]
  prev_feats = jnp.concatenate([state.features[:, None].astype(path_feats.dtype),
                                path_feats[:, :-1]], axis=1)
  drafts = _catch_up(policy, drafters, drafts, path_tokens, prev_feats, acc.num_nodes * act,
                     proposed=strategy.drafts)

  last = acc.num_nodes - 1
  emitted_tokens = jnp.concatenate([path_tokens[:, 1:], acc.next_token[:, None]], axis=1)
  # Accepted children first, then the bonus token right after them.
  emitted_tokens = jnp.where(jnp.arange(d + 1)[None] == last[:, None],
                             acc.next_token[:, None], emitted_tokens)
  new_features = jnp.take_along_axis(path_feats, last[:, None, None], axis=1)[:, 0]
  # Each emitted token was drawn from q at its path node (the last at the deepest accepted).
  path_logits = jnp.take_along_axis(logits, acc.path[:, :, None], axis=1)  # [B, D+1, V]
  out, out_logp, num_out, done, emitted = _emit(
      state, emitted_tokens, acc.num_nodes * act, eos_id,
      token_logp(path_logits, emitted_tokens, sp))
  # Where EOS or the budget cut the path, the committed nodes past the cut are in no
  # response: only the features of tokens the response holds (all but its last) are logged.
  log = _log_features(state.feature_log, path_feats, state.cache.lengths,
                      jnp.minimum(acc.num_nodes, emitted) * act)
  state = state.replace(cache=cache, drafts=drafts, feature_log=log, out=out,
                        out_logp=out_logp, num_out=num_out, done=done,
                        root=jnp.where(active, acc.next_token, state.root),
                        features=jnp.where(active[:, None], new_features, state.features))
  stats = StepStats(emitted=emitted, accepted=acc.num_nodes * act, iterations=act)
  return state, stats


def decode_loop(policy: Policy, drafters: dict | None, state: GenState, key: jax.Array,
                min_running: jax.Array, max_iterations: jax.Array, sp: SamplingParams, eos_id: int,
                strategy: Strategy | None = None, limits: jax.Array | None = None,
                corpus: jax.Array | None = None) -> tuple[GenState, StepStats, jax.Array]:
  """Up to max_iterations plain steps (strategy None; the drafters' states are kept in step) or SD
  iterations with `strategy` (within it, `limits`; `corpus`: see `sd_step`), in one
  `lax.while_loop`, stopping as soon as fewer than min_running rows are running: the host only
  hears from the device when it has to act.

  min_running, max_iterations: int32 scalars (traced: changing them compiles nothing).
  Returns (state, StepStats summed over the iterations, iterations run [] int32).
  """
  b = state.root.shape[0]
  zeros = jnp.zeros((b,), jnp.int32)

  def step(state):
    if strategy is None:
      return plain_step(policy, state, key, sp, eos_id, drafters)
    return sd_step(policy, drafters, state, key, sp, eos_id, strategy, limits, corpus)

  def cond(carry):
    state, _, i = carry
    running = jnp.sum(~state.done, dtype=jnp.int32)
    return (i < max_iterations) & (running >= jnp.maximum(min_running, 1))

  def body(carry):
    state, total, i = carry
    state, stats = step(state)
    total = jax.tree.map(jnp.add, total, stats)
    return state, total, i + 1

  return jax.lax.while_loop(cond, body, (state, StepStats(zeros, zeros, zeros), jnp.int32(0)))
