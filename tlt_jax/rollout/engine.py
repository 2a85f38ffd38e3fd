"""The rollout engine: batched generation that turns speculative once the batch runs dry.

`RolloutEngine.generate` serves a list of requests (prompts x samples) on every replica slice
of the mesh. Each slice runs its own batch of rows through compiled calls; between calls the
host (this module, the only place with side effects) reads the rows' done flags and decides:

  harvest   copy finished rows' tokens out;
  refill    while requests wait, prefill a group of them into rows freed by finished ones
            (continuous batching, so the batch stays full at GPU scale);
  compact   once none wait, gather the running rows into the smallest power-of-two bucket;
  step      a plain decode step, or, once running rows <= sd_threshold, one speculative
            iteration with the strategy the tuner picks for that batch size.

The drafter's cache is kept in step during plain decoding (one small drafter layer per step),
so switching to SD needs no re-prefill: the per-row last hidden state is already in the state.
Every program comes from an ExecutablePool keyed by (slice, program, bucket, strategy), so a
rollout never recompiles once its shapes have been seen.

With several processes (jax.distributed), each process drives its own slices; requests are
assigned to slices the same way on every process, and the finished tokens are gathered at the
end so that every process returns the whole result.

With `log_features`, the policy's features of (a chosen subset of) the sequences are kept on
the slice's devices as they are decoded (tlt_jax.rollout.feature_log), for drafter training.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.mesh import (DEFAULT_RULES, local_slices, logical_shardings,
                          replica_slices, to_mesh)
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import param_logical_axes
from tlt_jax.models.drafter import DrafterConfig, drafter_logical_axes, init_drafter_cache
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.rollout.feature_log import FeatureBlock, store_rows
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.state_ops import put_rows, take_rows
from tlt_jax.speculative.decoding import GenState, batch_first, plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import Tuner


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """max_batch: rows per slice (a power of two), bounded by cache memory.
  max_prompt_len / max_new_tokens: fix the cache capacity and the output width.
  sd_threshold: switch to SD when running rows <= this (0 = never).
  eos_id: end-of-sequence token (-1 = none); pad_id: prompt padding."""
  max_batch: int = 32
  max_prompt_len: int = 128
  max_new_tokens: int = 256
  sd_threshold: int = 8
  eos_id: int = -1
  pad_id: int = 0

  def __post_init__(self):
    if self.max_batch < 1 or self.max_batch & (self.max_batch - 1):
      raise ValueError(f"rollout.max_batch={self.max_batch} must be a power of two")
    for name in ("max_prompt_len", "max_new_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
    if self.sd_threshold < 0:
      raise ValueError(f"rollout.sd_threshold must be >= 0, got {self.sd_threshold}")

  @property
  def capacity(self) -> int:
    """Cache slots per row: prompt + generated tokens, rounded up to a multiple of 64 so the
    attention kernel never pads the cache."""
    return -(-(self.max_prompt_len + self.max_new_tokens) // 64) * 64


@dataclasses.dataclass
class StepRecord:
  """One compiled call of one slice."""
  slice: int
  mode: str                 # "prefill", "plain" or "sd"
  active: int               # running rows before the call
  bucket: int               # batch size of the program
  strategy: tuple | None    # SD strategy
  emitted: int              # tokens written to outputs by the call
  accept_mean: float        # SD: mean tokens per running row (accepted path + bonus)
  wall_s: float
  t_end_s: float            # since the start of generate()


@dataclasses.dataclass
class RolloutResult:
  """tokens[i]: request i's generated ids (EOS included if emitted); request i is sample
  i % num_samples of prompt i // num_samples. finish_reasons: 'eos' or 'length'."""
  tokens: list[list[int]]
  lengths: np.ndarray
  finish_reasons: list[str]
  timeline: list[StepRecord]
  slice_done_s: list[float]  # when each slice ran out of work, since the start
  wall_s: float
  pool: dict
  feature_blocks: list[FeatureBlock | None]  # per slice; None without feature logging
  t_start: float = 0.0       # time.perf_counter() at the start and the end of generate()
  t_end: float = 0.0


def _bucket(n: int, cap: int) -> int:
  return min(cap, 1 << max(0, (n - 1).bit_length()))


class RolloutEngine:
  """Generation on every replica slice of `mesh`; see the module docstring."""

  def __init__(self, cfg: ModelConfig, policy_params: dict, mesh: Mesh,
               econf: EngineConfig, drafter: tuple[DrafterConfig, dict] | None = None,
               tuner: Tuner | None = None, rules=DEFAULT_RULES, log_features: bool = False):
    """log_features: keep the policy's features of finished sequences on device (see
    generate's `log_requests`); costs a [rows, capacity, F] array per slice."""
    if drafter is not None and tuner is None:
      raise ValueError("speculative decoding needs a tuner (e.g. FixedTuner((4, 2, 8)))")
    self.cfg, self.econf, self.rules, self.tuner = cfg, econf, tuple(rules), tuner
    self.log_features = log_features
    self.dcfg = drafter[0] if drafter else None
    self.slices = replica_slices(mesh)
    self.local = local_slices(self.slices)  # the slices this process drives (all, with one)
    self.pool = ExecutablePool()
    self._policy_axes = param_logical_axes(cfg)
    self._drafter_axes = drafter_logical_axes(cfg, self.dcfg) if drafter else None
    self._drafter = [None] * len(self.slices)
    self.update_params(policy_params, drafter[1] if drafter else None)

  # ---------------------------------------------------------------- parameters

  def update_params(self, policy_params: dict | None = None, drafter_params: dict | None = None):
    """Places new weights on this process's slices (a reshard; nothing goes through the
    host). Other processes' slices hold None."""
    def place(tree, axes):
      return [to_mesh(tree, logical_shardings(axes, m, self.rules, tree))
              if s in self.local else None for s, m in enumerate(self.slices)]
    if policy_params is not None:
      self._policy = place(policy_params, self._policy_axes)
    if drafter_params is not None:
      if self.dcfg is None:
        raise ValueError("this engine was built without a drafter; pass drafter=(dcfg, params) "
                         "to RolloutEngine to use one")
      self._drafter = place(drafter_params, self._drafter_axes)

  def policy_on(self, s: int) -> dict:
    """The policy params as placed on slice s (what drafter training on that slice reads);
    None for a slice of another process."""
    return self._policy[s]

  def drafter_on(self, s: int) -> dict | None:
    return self._drafter[s]

  @property
  def speculative(self) -> bool:
    return self.dcfg is not None and self.econf.sd_threshold > 0

  # ---------------------------------------------------------------- compiled programs

  def _replicated(self, s: int):
    return NamedSharding(self.slices[s], P())

  def _layout(self, s: int):
    """out_shardings for the pool: states and caches by the logical axes they declare, every
    other array (step stats, feature stores) batch-first."""
    def declared(x):
      return isinstance(x, (GenState, KVCache))

    def shardings(shapes):
      axes = jax.tree.map(lambda x: x.logical_axes() if declared(x) else batch_first(x),
                          shapes, is_leaf=declared)
      return logical_shardings(axes, self.slices[s], self.rules, shapes)
    return shardings

  def _prefill_exe(self, s, prompts, lengths, key, sp):
    cfg, dcfg, ec = self.cfg, self.dcfg, self.econf
    b = prompts.shape[0]

    def empty_caches():
      return (init_cache(cfg, b, ec.capacity),
              init_drafter_cache(cfg, dcfg, b, ec.capacity) if dcfg else None)

    def fn(params, dparams, prompts, lengths, key, caches):
      return start(params, prompts, lengths, caches[0], key, sp, ec.max_new_tokens, ec.eos_id,
                   cfg, drafter_params=dparams, draft_cache=caches[1], dcfg=dcfg,
                   log_features=self.log_features)

    # The empty caches are made by their own program and passed in (donated): built inside
    # the prefill, they would be compile-time constants that XLA tries to fold through the
    # attention, which makes compiles slow.
    init = self.pool.get((s, "caches", b), empty_caches, (), out_shardings=self._layout(s))
    args = (self._policy[s], self._drafter[s], prompts, lengths, key, init())
    return self.pool.get((s, "prefill", b, prompts.shape[1], sp), fn, args, donate_argnums=(5,),
                         out_shardings=self._layout(s)), args

  def _step_exe(self, s, state, key, sp, strategy):
    cfg, dcfg, eos = self.cfg, self.dcfg, self.econf.eos_id
    b = state.root.shape[0]
    if strategy is None:
      fn = lambda params, dparams, state, key: plain_step(  # noqa: E731
          params, state, key, sp, eos, cfg, drafter_params=dparams, dcfg=dcfg)
    else:
      fn = lambda params, dparams, state, key: sd_step(  # noqa: E731
          params, dparams, state, key, sp, eos, strategy, cfg, dcfg)
    args = (self._policy[s], self._drafter[s], state, key)
    key_ = (s, "sd" if strategy else "plain", b, strategy, sp)
    return self.pool.get(key_, fn, args, donate_argnums=(2,),
                         out_shardings=self._layout(s)), args

  def _store_exe(self, s, rows: int):
    """An empty feature store [rows, C, F] on slice s."""
    shape = (rows, self.econf.capacity, self.cfg.feature_size)
    return self.pool.get((s, "store", rows), lambda: jnp.zeros(shape, self.cfg.jnp_dtype), (),
                         out_shardings=self._layout(s))

  def _harvest_exe(self, s, store, log, src):
    # store_rows(store, log, src, dst): dst has src's shape, so src stands in for it here.
    return self.pool.get((s, "harvest", store.shape[0], log.shape[0], src.shape[0]),
                         store_rows, (store, log, src, src), donate_argnums=(0,),
                         out_shardings=self._layout(s))

  def _rows_exe(self, s, name, fn, args, out_rows):
    return self.pool.get((s, name, args[0].root.shape[0], out_rows), fn, args,
                         donate_argnums=(0,) if name == "put" else (),
                         out_shardings=self._layout(s))

  # ---------------------------------------------------------------- generation

  def generate(self, prompts: list[list[int]], num_samples: int, sampling: SamplingParams,
               key: jax.Array, on_slice_idle=None, log_requests=None) -> RolloutResult:
    """Generates `num_samples` completions for each prompt (token-id lists).

    on_slice_idle: optional callback `fn(slice_index, mesh, feature_block)`, called from this
    host loop the moment a slice has no work left while others may still be decoding (spot
    training starts there). feature_block is the slice's FeatureBlock (None without feature
    logging). It must return quickly: the loop waits for it.
    log_requests: with log_features, the request ids (prompt i's sample j is request
    i * num_samples + j) whose features are kept; None = all.

    Deterministic for a given key and schedule; with a timing-driven tuner (BEG-MAB) the
    schedule, and so which random numbers a sampled row uses, can change between runs, not
    the distribution. Greedy outputs never change.
    """
    self._check_requests(prompts, num_samples)
    requests = [p for p in prompts for _ in range(num_samples)]
    n = len(requests)
    logged = set()
    if self.log_features:
      logged = set(range(n)) if log_requests is None else {int(r) for r in log_requests}
    # Slice s serves requests s, s + S, ...: the same split on every process.
    workers = [_SliceWorker(self, s, list(range(s, n, len(self.slices))), requests, sampling,
                            jax.random.fold_in(key, s), logged)
               for s in self.local]
    t0 = time.perf_counter()
    results: dict[int, tuple[list[int], str]] = {}
    timeline: list[StepRecord] = []
    slice_done = [0.0] * len(self.slices)
    blocks: list[FeatureBlock | None] = [None] * len(self.slices)
    while any(w.busy for w in workers):
      for w in workers:
        if w.busy:
          record = w.advance(t0)
          if record is not None:
            timeline.append(record)
          results.update(w.pop_finished())
          if not w.busy:
            slice_done[w.s] = time.perf_counter() - t0
            blocks[w.s] = w.feature_block()
            if on_slice_idle is not None:
              on_slice_idle(w.s, self.slices[w.s], blocks[w.s])
    if jax.process_count() > 1:
      results, slice_done = self._gather(results, slice_done, n)
    t_end = time.perf_counter()
    tokens = [results[i][0] for i in range(n)]
    return RolloutResult(tokens=tokens, lengths=np.asarray([len(t) for t in tokens]),
                         finish_reasons=[results[i][1] for i in range(n)], timeline=timeline,
                         slice_done_s=slice_done, wall_s=t_end - t0, pool=self.pool.report(),
                         feature_blocks=blocks, t_start=t0, t_end=t_end)

  def _gather(self, results: dict, slice_done: list[float], n: int):
    """Every process's finished requests and slice end times, on every process (one
    all-gather of [n, 1 + max_new_tokens] ids; -1 marks what another process served)."""
    from jax.experimental import multihost_utils
    width = self.econf.max_new_tokens
    table = np.full((n, 1 + width), -1, np.int32)
    for i, (toks, _) in results.items():
      table[i, 0] = len(toks)
      table[i, 1:1 + len(toks)] = toks
    done = np.full((len(self.slices),), -1.0, np.float32)  # float32: what JAX carries
    done[self.local] = [slice_done[s] for s in self.local]
    tables, dones = multihost_utils.process_allgather((table, done))
    merged = {}
    for i in range(n):
      owner = int(np.argmax(tables[:, i, 0]))
      toks = tables[owner, i, 1:1 + tables[owner, i, 0]].tolist()
      merged[i] = (toks, "eos" if toks and toks[-1] == self.econf.eos_id else "length")
    return merged, dones.max(axis=0).tolist()

  def _check_requests(self, prompts, num_samples):
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if not prompts:
      raise ValueError("no prompts to generate from")
    for i, p in enumerate(prompts):
      if len(p) == 0:
        raise ValueError(f"prompt {i} is empty")
      if len(p) > self.econf.max_prompt_len:
        raise ValueError(f"prompt {i} has {len(p)} tokens, more than rollout.max_prompt_len="
                         f"{self.econf.max_prompt_len}; raise it or truncate the prompt")
      bad = [t for t in p if not 0 <= t < self.cfg.vocab_size]
      if bad:
        raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): "
                         f"{bad[:5]}")


class _SliceWorker:
  """The host-side state machine of one slice: its queue, its rows and its GenState."""

  def __init__(self, engine: RolloutEngine, s: int, request_ids: list[int],
               requests: list[list[int]], sp: SamplingParams, key, logged: set[int]):
    self.e, self.s, self.sp, self.key = engine, s, sp, key
    self.requests = requests
    self.queue = list(request_ids)
    self.logged = logged
    n_logged = sum(r in logged for r in request_ids)
    # The feature store: logged rows land here as they finish, in finishing order.
    self.store = self.e._store_exe(s, _bucket(n_logged, 1 << 30))() if n_logged else None
    self.store_ids: list[int] = []
    self.store_seqs: list[np.ndarray] = []
    self.state: GenState | None = None
    self.rows: list[int] = []        # request id per row, -1 = free
    self.done = np.zeros((0,), bool)
    self.calls = 0
    self._finished: dict[int, tuple[list[int], str]] = {}

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r >= 0 for r in self.rows)

  def feature_block(self) -> FeatureBlock | None:
    if self.store is None:
      return None
    return FeatureBlock(features=self.store, request_ids=list(self.store_ids),
                        sequences=list(self.store_seqs),
                        prompt_lens=[len(self.requests[r]) for r in self.store_ids])

  def _harvest_features(self, rows: list[int]) -> None:
    """Copies the finished rows' feature logs into the store, on device."""
    rows = [i for i in rows if self.rows[i] in self.logged]
    if not rows:
      return
    k = _bucket(len(rows), 1 << 30)
    src = np.zeros((k,), np.int32)
    dst = np.full((k,), self.store.shape[0], np.int32)  # padding points past the store: dropped
    src[:len(rows)] = rows
    dst[:len(rows)] = np.arange(len(self.store_ids), len(self.store_ids) + len(rows))
    src, dst = self._put(src), self._put(dst)
    exe = self.e._harvest_exe(self.s, self.store, self.state.feature_log, src)
    self.store = exe(self.store, self.state.feature_log, src, dst)
    for i in rows:
      r = self.rows[i]
      self.store_ids.append(r)
      self.store_seqs.append(np.asarray(list(self.requests[r]) + self._finished[r][0], np.int32))

  def pop_finished(self):
    out, self._finished = self._finished, {}
    return out

  def _next_key(self):
    self.calls += 1
    return jax.random.fold_in(self.key, self.calls)

  def _put(self, x):
    return jax.device_put(x, self.e._replicated(self.s))

  def _prefill(self, request_ids: list[int], bucket: int) -> GenState:
    """A GenState of `bucket` rows with the requests prefilled; padding rows start done."""
    ec = self.e.econf
    width = _bucket(max(len(self.requests[r]) for r in request_ids), ec.max_prompt_len)
    prompts = np.full((bucket, width), ec.pad_id, np.int32)
    lengths = np.ones((bucket,), np.int32)
    for i, r in enumerate(request_ids):
      prompts[i, :len(self.requests[r])] = self.requests[r]
      lengths[i] = len(self.requests[r])
    exe, args = self.e._prefill_exe(self.s, self._put(prompts), self._put(lengths),
                                    self._next_key(), self.sp)
    state = exe(*args)
    pad = np.arange(bucket) >= len(request_ids)
    return state.replace(done=state.done | self._put(pad))

  def advance(self, t0) -> StepRecord | None:
    """One compiled call (prefill or step) plus the host bookkeeping around it."""
    ec = self.e.econf
    if self.state is None:
      ids = self.queue[:ec.max_batch]
      del self.queue[:len(ids)]
      bucket = _bucket(len(ids), ec.max_batch)
      t = time.perf_counter()
      self.state = self._prefill(ids, bucket)
      self.rows = ids + [-1] * (bucket - len(ids))
      return self._after_call(t0, t, "prefill", len(ids), bucket, None, None)

    free = [i for i, r in enumerate(self.rows) if r < 0]
    if self.queue and free:
      ids = self.queue[:len(free)]
      del self.queue[:len(ids)]
      group = _bucket(len(ids), ec.max_batch)
      t = time.perf_counter()
      fresh = self._prefill(ids, group)
      target = np.full((group,), len(self.rows), np.int32)  # past the batch: dropped
      target[:len(ids)] = free[:len(ids)]
      exe = self.e._rows_exe(self.s, "put", put_rows, (self.state, fresh, self._put(target)),
                             group)
      self.state = exe(self.state, fresh, self._put(target))
      for row, r in zip(free, ids):
        self.rows[row] = r
      return self._after_call(t0, t, "prefill", len(ids), group, None, None)

    running = [i for i, r in enumerate(self.rows) if r >= 0]
    bucket = _bucket(len(running), ec.max_batch)
    if not self.queue and bucket < len(self.rows):
      # Compact: running rows first, then finished rows as inert padding.
      idle = [i for i, r in enumerate(self.rows) if r < 0]
      order = np.asarray((running + idle)[:bucket], np.int32)
      exe = self.e._rows_exe(self.s, "take", take_rows, (self.state, self._put(order)), bucket)
      self.state = exe(self.state, self._put(order))
      self.rows = [self.rows[i] for i in order]

    strategy = None
    if self.e.speculative and len(running) <= ec.sd_threshold:
      strategy = self.e.tuner.choose(len(running))
    t = time.perf_counter()
    exe, args = self.e._step_exe(self.s, self.state, self._next_key(), self.sp, strategy)
    self.state, stats = exe(*args)
    return self._after_call(t0, t, "sd" if strategy else "plain", len(running), len(self.rows),
                            strategy, stats)

  def _after_call(self, t0, t, mode, active, bucket, strategy, stats) -> StepRecord:
    # The one host sync per call: which rows are done, and the step's counts.
    done, stats = jax.device_get((self.state.done, stats))
    wall = time.perf_counter() - t
    emitted, accept = active if mode == "prefill" else 0, 0.0
    if stats is not None:
      emitted = int(stats.emitted.sum())
      accepted = stats.accepted
      live = accepted > 0
      accept = float(accepted[live].mean()) if live.any() else 0.0
      if strategy is not None:
        self.e.tuner.update(active, strategy, accept, wall)
    finished = [i for i, r in enumerate(self.rows) if r >= 0 and done[i]]
    if finished:
      out = np.asarray(self.state.out)
      num = np.asarray(self.state.num_out)
      for i in finished:
        toks = out[i, :num[i]].tolist()
        reason = "eos" if toks and toks[-1] == self.e.econf.eos_id else "length"
        self._finished[self.rows[i]] = (toks, reason)
      if self.store is not None:
        self._harvest_features(finished)
      for i in finished:
        self.rows[i] = -1
    if not any(r >= 0 for r in self.rows) and not self.queue:
      self.state = None
      self.rows = []
    return StepRecord(slice=self.s, mode=mode, active=active, bucket=bucket,
                      strategy=strategy.as_tuple() if strategy else None, emitted=emitted,
                      accept_mean=accept, wall_s=wall, t_end_s=time.perf_counter() - t0)
