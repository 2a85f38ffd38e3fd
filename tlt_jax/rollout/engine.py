"""The rollout engine: batched generation that turns speculative once the batch runs dry.

`RolloutEngine.generate` serves a list of requests (prompts x samples) on every replica slice
of the mesh. Per slice, the scheduler (`tlt_jax.rollout.scheduler`, on the host, without JAX)
decides to start, refill, compact, or decode (plain, or SD with the tuner's strategy once few
rows run), and the slice's compiled programs (`tlt_jax.rollout.programs`) carry it out; a
decode call runs up to `iterations_per_call` iterations in one `lax.while_loop` and returns as
soon as the scheduler would decide differently. This module runs the loop: every busy slice
dispatches its next call, then each waits for its own result (one host sync per call), so
slices on different devices run at the same time.

Tokens are drawn with noise fixed by (the rollout key, request id, position in the response),
so the same key gives the same responses whatever the schedule, strategy, tuner or slice: a
speculative rollout returns exactly what a plain one does, under sampling too. The drafter's
cache is kept in step during plain decoding, so switching to SD needs no re-prefill. With
several processes (jax.distributed), each drives its own slices and the finished tokens are
gathered at the end. The engine builds only the drafters its tuner's strategies name (none
without SD), so a drafter that no strategy names costs nothing and compiles nothing.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from jax.sharding import Mesh

from tlt_jax.drafters import Drafter, drafters_named, reads_corpus
from tlt_jax.mesh import ROLLOUT_RULES, local_slices, replica_slices, to_slices
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.decoder import param_logical_axes
from tlt_jax.rollout.feature_log import FeatureBlock
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.programs import SlicePrograms
from tlt_jax.rollout.scheduler import (Compact, Decode, Refill, SliceScheduler, Start, batch_ladder,
                                      bucket)
from tlt_jax.speculative.decoding import GenState
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import Tuner


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """max_batch: rows per slice (a power of two), bounded by cache memory.
  max_prompt_len / max_new_tokens: fix the cache capacity and the output width.
  sd_threshold: switch to SD when running rows <= this (0 = never).
  iterations_per_call: decode iterations per compiled call, at most (a call also ends when the
  scheduler must act).
  eos_id: end-of-sequence token (-1 = none); pad_id: prompt padding.
  compile_ahead: compile the tail's decode programs in the background from a slice's first
  prefill on; the tuner chooses only strategies whose program is ready (the tail decodes
  plainly meanwhile), so no call waits for a compile. Tokens do not change.
  shared_sd_max_batch: at program batch sizes up to this (0: none), the tuner's arms of one
  top-k share one SD program shaped for their largest depth and verify_tokens, each drawing
  its own (padded) tree: fewer compiles for a costlier iteration
  (docs/results/shared_programs). Tokens and accept lengths do not change.
  corpus_rows: for suffix-drafter strategies, how many of a row's group's finished responses
  (the G - 1 siblings in GRPO; the most recent first) it may copy from.
  batch_sizes: the program batch sizes of a slice (max_batch is always one, and a size above
  it counts as max_batch; () = every power of two up to it): a batch starts, refills and
  compacts to the smallest that holds its rows, so fewer sizes mean fewer programs and more
  padded rows. Tokens do not change.
  prompt_widths: the prefill widths prompts are padded to (() = powers of two up to
  max_prompt_len, which is always one, and a width above it counts as max_prompt_len): one
  width, one prefill program per batch size.
  Each default is the config's (rollout.<knob>, rollout.speculative.shared_max_batch and
  .corpus_rows; eos_id and pad_id come from the tokenizer)."""
  max_batch: int = 64
  max_prompt_len: int = 128
  max_new_tokens: int = 256
  sd_threshold: int = 4
  iterations_per_call: int = 32
  eos_id: int = -1
  pad_id: int = 0
  compile_ahead: bool = True
  shared_sd_max_batch: int = 0
  corpus_rows: int = 8
  batch_sizes: tuple[int, ...] = ()
  prompt_widths: tuple[int, ...] = ()

  def __post_init__(self):
    if self.max_batch < 1 or self.max_batch & (self.max_batch - 1):
      raise ValueError(f"rollout.max_batch={self.max_batch} must be a power of two")
    for name, cap in (("batch_sizes", "max_batch"), ("prompt_widths", "max_prompt_len")):
      values = tuple(getattr(self, name))
      if any(not isinstance(v, int) or v < 1 for v in values):
        raise ValueError(f"rollout.{name}={values} must be whole numbers of at least 1")
      # Sizes past the cap count as the cap, which is always one: a config that names its
      # sizes keeps working when rollout.max_batch or max_prompt_len is lowered on the command
      # line. Kept hashable (a config's list becomes a tuple).
      limit = getattr(self, cap)
      object.__setattr__(self, name, tuple(sorted({min(v, limit) for v in values})))
    keys = {"corpus_rows": "speculative.corpus_rows",  # config keys that differ from the name
            "shared_sd_max_batch": "speculative.shared_max_batch"}
    for name, low in (("max_prompt_len", 1), ("max_new_tokens", 1), ("iterations_per_call", 1),
                      ("sd_threshold", 0), ("corpus_rows", 1), ("shared_sd_max_batch", 0)):
      if (value := getattr(self, name)) < low:
        raise ValueError(f"rollout.{keys.get(name, name)} must be >= {low}, got {value}")

  @property
  def ladder(self) -> tuple[int, ...]:
    """The program batch sizes, ascending (`batch_ladder`)."""
    return batch_ladder(self.max_batch, self.batch_sizes)

  def batch_for(self, rows: int) -> int:
    """The program batch size that holds `rows` rows."""
    return bucket(rows, self.max_batch, self.ladder)

  def width_for(self, tokens: int) -> int:
    """The prefill width that holds a prompt of `tokens` tokens."""
    widths = tuple(sorted({*self.prompt_widths, self.max_prompt_len})) if self.prompt_widths else ()
    return bucket(tokens, self.max_prompt_len, widths)

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
  accept_mean: float        # decode: mean tokens per running row per iteration
  wall_s: float             # from dispatch until the results were on the host (no compiling)
  t_end_s: float            # since the start of generate()
  iterations: int = 0       # decode iterations the call ran
  row_iterations: int = 0   # iterations summed over the rows running in them
  host_s: float = 0.0       # host time of the call: choosing, dispatching, bookkeeping
  compiled: bool = False    # the program's first run (compiled now or ahead; tuner skips it)
  waited: bool = False      # a tail call decoded plainly: no SD program was compiled yet


@dataclasses.dataclass
class RolloutResult:
  """tokens[i]: request i's generated ids (EOS included if emitted); request i is sample
  i % num_samples of prompt i // num_samples. finish_reasons: 'eos' or 'length'.
  logprobs[i]: log q of each of tokens[i] under the distribution it was drawn from, as the
  trainer computes it (`tlt_jax.speculative.decoding.token_logp`)."""
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
  logprobs: list[list[float]] = dataclasses.field(default_factory=list)

  @property
  def call_s(self) -> float:
    """Summed wall time of the compiled calls (dispatch to results on the host)."""
    return float(sum(r.wall_s for r in self.timeline))

  @property
  def host_s(self) -> float:
    """Summed host time around the calls (scheduling, dispatch, harvesting)."""
    return float(sum(r.host_s for r in self.timeline))

  @staticmethod
  def concat(results: list[RolloutResult]) -> RolloutResult:
    """Several rollouts as one, requests in order (an RL step's rounds): their times add up,
    and each slice's end counts from the start of the first."""
    if len(results) == 1:
      return results[0]
    offsets = np.cumsum([0.0] + [r.wall_s for r in results[:-1]])
    return RolloutResult(
        tokens=[t for r in results for t in r.tokens],
        lengths=np.concatenate([r.lengths for r in results]),
        finish_reasons=[f for r in results for f in r.finish_reasons],
        timeline=[rec for r in results for rec in r.timeline],
        slice_done_s=[o + t for o, r in zip(offsets, results) for t in r.slice_done_s],
        wall_s=float(sum(r.wall_s for r in results)), pool=results[-1].pool,
        feature_blocks=[b for r in results for b in r.feature_blocks],
        t_start=results[0].t_start, t_end=results[-1].t_end,
        logprobs=[lp for r in results for lp in r.logprobs])


class GenerationStopped(Exception):
  """`generate` was asked to stop (its should_stop said so) between two compiled calls: what
  it had generated is dropped."""


def accept_length(result) -> float | None:
  """Mean tokens per running row per SD iteration of a RolloutResult (None without SD)."""
  sd = [r for r in result.timeline if r.mode == "sd" and r.row_iterations]
  if not sd:
    return None
  weights = np.asarray([r.row_iterations for r in sd], np.float64)
  return float(np.average([r.accept_mean for r in sd], weights=weights))


def sd_not_reached(result) -> str | None:
  """Why a rollout of an engine with SD ran no SD iteration (None when it ran some): its
  tail waited for programs compiling ahead, or never got down to the SD threshold."""
  if accept_length(result) is not None:
    return None
  waited = sum(r.waited for r in result.timeline)
  if waited:
    return (f"its SD programs were still compiling ahead (rollout.compile_ahead) in all "
            f"{waited} tail calls")
  return "the running rows never fell to rollout.sd_threshold"


class RolloutEngine:
  """Generation on every replica slice of `mesh`; see the module docstring."""

  def __init__(self, cfg: ModelConfig, policy_params: dict, mesh: Mesh,
               econf: EngineConfig, drafters: dict[str, Drafter] | None = None,
               tuner: Tuner | None = None, rules=ROLLOUT_RULES, log_features: bool = False):
    """drafters: name -> drafter (`tlt_jax.drafters.make_drafter`, a trained one with its
    weights in any layout): of these, SD builds the ones the tuner's strategies name, which
    must all be given; without SD (no tuner, or sd_threshold 0) none is built.
    rules: the rollout layout on each slice (`tlt_jax.mesh.ROLLOUT_RULES`: whole weights
    or tensor-parallel, no weight gathers while decoding); the params may come in any layout.
    log_features: keep the policy's features of finished sequences on device (see
    generate's `log_requests`); costs a [rows, capacity, F] array per slice."""
    drafters = dict(drafters or {})
    if drafters and tuner is None:
      raise ValueError("speculative decoding needs a tuner (e.g. FixedTuner((4, 2, 8)))")
    self.cfg, self.econf, self.rules, self.tuner = cfg, econf, tuple(rules), tuner
    used = drafters_named(tuner.strategies()) if self.speculative else ()
    missing = [name for name in used if name not in drafters]
    if missing:
      needs = sorted({s.as_tuple() for s in tuner.strategies()
                      if s is not None and set(s.drafts) & set(missing)})
      raise ValueError(f"the tuner's strategies {needs} draft with {missing}, which were not "
                       f"given (drafters has {sorted(drafters)}): pass them, or use strategies "
                       f"that need none of them (e.g. '4,1,5,suffix')")
    # The drafters SD builds, without their weights (the programs take those as arguments).
    self.drafters = {name: drafters[name].replace(params=None) if drafters[name].trained
                     else drafters[name] for name in used}
    self.log_features = log_features
    self.mesh, self.slices = mesh, replica_slices(mesh)
    self.local = local_slices(self.slices)  # the slices this process drives (all, with one)
    self.pool = ExecutablePool(max_size=512 * len(self.local))  # each slice keys its own
    self.programs = {s: SlicePrograms(s, self.slices[s], self.pool, cfg, self.drafters,
                                      econf.capacity, econf.max_new_tokens, econf.eos_id,
                                      self.rules, log_features, self.shared_shape,
                                      econf.corpus_rows, share_traces=len(self.local) > 1)
                     for s in self.local}
    self._policy_axes = param_logical_axes(cfg)
    self._drafter_axes = {name: type(d).logical_axes(d.settings, cfg)
                          for name, d in self.drafters.items() if d.trained}
    self._drafters_on = [dict(self.drafters) for _ in self.slices]
    self.update_params(policy_params, {name: drafters[name].params for name in used
                                       if drafters[name].trained})

  def update_params(self, policy_params: dict | None = None,
                    drafter_params: dict[str, dict] | None = None):
    """Places new weights on this process's slices in the rollout layout (one reshard from
    whatever layout they come in, e.g. training's FSDP over the whole mesh; nothing goes
    through the host). Other processes' slices hold None. drafter_params: name -> weights of
    trained drafters; those this engine does not draft with are ignored."""
    def place(tree, axes):
      return to_slices(tree, axes, self.mesh, self.local, self.rules)
    if policy_params is not None:
      self._policy = place(policy_params, self._policy_axes)
    for name, params in (drafter_params or {}).items():
      if name not in self._drafter_axes:
        continue
      for s, placed in enumerate(place(params, self._drafter_axes[name])):
        self._drafters_on[s][name] = self.drafters[name].replace(params=placed)

  def policy_on(self, s: int) -> dict:
    """The policy params as placed on slice s (drafter training there reads them); None for
    another process's slice."""
    return self._policy[s]

  def drafters_on(self, s: int) -> dict:
    """name -> drafter with its weights as placed on slice s (of another process's slice,
    None weights)."""
    return self._drafters_on[s]

  @property
  def capacity(self) -> int:
    """Tokens a sequence may hold (prompt + response; `EngineConfig.capacity`)."""
    return self.econf.capacity

  @property
  def speculative(self) -> bool:
    return self.tuner is not None and self.econf.sd_threshold > 0

  def tail_plan(self) -> list[tuple[int, object]]:
    """(batch bucket, strategy) of every decode program the tail may run, in the order the
    tail reaches them: most running rows first, each bucket's plain program (what the tail
    runs until an SD program is ready) before the tuner's arms."""
    ec, plan = self.econf, {}
    for running in range(min(ec.sd_threshold, ec.max_batch), 0, -1):
      for strategy in (None, *self.tuner.strategies_for(running)):
        plan[(ec.batch_for(running), strategy)] = None
    return list(plan)

  def compile_plan(self, sampling: SamplingParams, num_prompts: int, num_samples: int,
                   priority: int = 0) -> None:
    """Queues the compiles of every program that `generate` of `num_prompts` prompts x
    `num_samples` samples runs on this process's slices, compiled ahead
    (`ExecutablePool.compile_ahead`, at `priority`): each slice's first prefill (prompts
    padded to the widest prompt width), every batch size's plain decode program, the compactions
    between them and the tail's SD programs (`tail_plan`). More requests than a slice's rows
    (refills), narrower prompt widths and feature logging compile when first needed."""
    ec, n = self.econf, num_prompts * num_samples
    key = jax.random.key(0)
    for s in self.local:
      first = list(range(s, n, len(self.slices)))[:ec.max_batch]
      if not first:
        continue
      prog, batch = self.programs[s], ec.batch_for(len(first))
      distinct = bucket(len({r // num_samples for r in first}), batch)
      state = prog.start_ahead(*self._params_on(s), batch, distinct,
                               ec.width_for(ec.max_prompt_len), prog.put(key), sampling, priority)
      sizes = [b for b in ec.ladder if b <= batch]
      plan = [(b, None) for b in reversed(sizes)]
      if self.speculative:
        plan += [(b, st) for b, st in self.tail_plan() if b <= batch]
      prog.decode_ahead(*self._params_on(s), state, prog.put(key), sampling,
                        list(dict.fromkeys(plan)), priority)
      for i, b in enumerate(sizes):
        for smaller in sizes[:i]:
          prog.take_ahead(prog.resized(state, b), smaller, priority)

  def _params_on(self, s: int) -> tuple[dict, dict]:
    """(policy params, drafters) as placed on slice s."""
    return self.policy_on(s), self.drafters_on(s)

  def shared_shape(self, batch: int, strategy: Strategy) -> Strategy | None:
    """The strategy whose program runs `strategy` at program batch `batch`: with shared SD
    programs at this batch (EngineConfig.shared_sd_max_batch), the largest steps and
    verify_tokens among the tuner's arms of the same top-k that this batch may run; None
    (its own program) otherwise, or when no other arm shares its top-k."""
    ec = self.econf
    if batch > ec.shared_sd_max_batch:
      return None
    runs = [r for r in range(1, ec.sd_threshold + 1) if ec.batch_for(r) == batch]
    group = {strategy} | {s for running in runs for s in self.tuner.strategies_for(running)
                          if (s.topk, s.drafts) == (strategy.topk, strategy.drafts)}
    if len(group) < 2:
      return None
    return Strategy(max(s.depth for s in group), strategy.topk,
                    max(s.verify_tokens for s in group), strategy.drafts)

  def close(self) -> None:
    """Drops the compiles still queued ahead (at the end of a job: nothing will use them)."""
    self.pool.close()

  def generate(self, prompts: list[list[int]], num_samples: int, sampling: SamplingParams,
               key: jax.Array, on_slice_idle=None, log_requests=None,
               compile_priority: int | None = 0, should_stop=None) -> RolloutResult:
    """Generates `num_samples` completions for each prompt (token-id lists).

    key: the rollout's key. Request i (prompt i // num_samples, sample i % num_samples) draws
    the token at response position p with noise of (key, i, p) only, so the result depends on
    the key, the prompts and the policy, not on the schedule or whether SD ran.
    on_slice_idle: optional `fn(slice_index, mesh, feature_block)` (the slice's FeatureBlock,
    None without feature logging), called from this host loop the moment a slice has no work
    left (spot training starts there). It must return quickly: the loop waits for it.
    log_requests: with log_features, the request ids whose features are kept; None = all.
    compile_priority: compiling ahead, where this call's tail programs queue (lower first;
    `ExecutablePool.compile_ahead`): e.g. 1 for a held-out evaluation, behind the rollout's;
    None queues none (its tail decodes with the programs that are ready).
    should_stop: optional `fn() -> bool`, asked between compiled calls (a job's stop signal):
    True raises GenerationStopped there, within a call's time of the signal."""
    self._check_requests(prompts, num_samples)
    requests = [p for p in prompts for _ in range(num_samples)]
    n = len(requests)
    logged = set()
    if self.log_features:
      logged = set(range(n)) if log_requests is None else {int(r) for r in log_requests}
    # Every finished request so far on this process, in finishing order: also the corpus the
    # slices' suffix drafting copies from.
    results: dict[int, tuple[list[int], str, list[float]]] = {}
    # Slice s serves requests s, s + S, ...: the same split on every process.
    runs = [_SliceRun(self, s, list(range(s, n, len(self.slices))), requests, sampling, key,
                      logged, compile_priority, num_samples, results) for s in self.local]
    t0 = time.perf_counter()
    timeline: list[StepRecord] = []
    slice_done = [0.0] * len(self.slices)
    blocks: list[FeatureBlock | None] = [None] * len(self.slices)

    def idle(run: _SliceRun) -> None:
      slice_done[run.slice] = time.perf_counter() - t0
      blocks[run.slice] = run.feature_block()
      if on_slice_idle is not None:
        on_slice_idle(run.slice, self.slices[run.slice], blocks[run.slice])
    for run in runs:  # fewer requests than slices: a slice with none is idle from the start
      if not run.busy:
        idle(run)
    while any(r.busy for r in runs):
      if should_stop is not None and should_stop():
        raise GenerationStopped(f"{len(results)} of {n} responses done")
      pending = [(r, r.dispatch()) for r in runs if r.busy]
      for run, call in pending:
        timeline.append(run.complete(call, t0))
        results.update(run.pop_finished())
        if not run.busy:
          idle(run)
    if jax.process_count() > 1:
      results, slice_done = self._gather(results, slice_done, n)
    t_end = time.perf_counter()
    tokens = [results[i][0] for i in range(n)]
    return RolloutResult(tokens=tokens, lengths=np.asarray([len(t) for t in tokens]),
                         finish_reasons=[results[i][1] for i in range(n)], timeline=timeline,
                         logprobs=[results[i][2] for i in range(n)],
                         slice_done_s=slice_done, wall_s=t_end - t0, pool=self.pool.report(),
                         feature_blocks=blocks, t_start=t0, t_end=t_end)

  def _gather(self, results: dict, slice_done: list[float], n: int):
    """Every process's finished requests and slice end times, on every process (one
    all-gather of [n, 1 + max_new_tokens] ids, -1 marking what another process served, and of
    their log-probs)."""
    from jax.experimental import multihost_utils
    table = np.full((n, 1 + self.econf.max_new_tokens), -1, np.int32)
    logps = np.zeros((n, self.econf.max_new_tokens), np.float32)
    for i, (toks, _, lp) in results.items():
      table[i, 0] = len(toks)
      table[i, 1:1 + len(toks)] = toks
      logps[i, :len(lp)] = lp
    done = np.full((len(self.slices),), -1.0, np.float32)  # float32: what JAX carries
    done[self.local] = [slice_done[s] for s in self.local]
    tables, all_logps, dones = multihost_utils.process_allgather((table, logps, done))
    merged = {}
    for i in range(n):
      owner = int(np.argmax(tables[:, i, 0]))
      length = tables[owner, i, 0]
      toks = tables[owner, i, 1:1 + length].tolist()
      merged[i] = (toks, self._reason(toks), all_logps[owner, i, :length].tolist())
    return merged, dones.max(axis=0).tolist()

  def _reason(self, tokens: list[int]) -> str:
    return "eos" if tokens and tokens[-1] == self.econf.eos_id else "length"

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
      if bad := [t for t in p if not 0 <= t < self.cfg.vocab_size]:
        raise ValueError(f"prompt {i} has token ids outside [0, {self.cfg.vocab_size}): "
                         f"{bad[:5]}")


@dataclasses.dataclass
class _Call:
  """A dispatched call: what it was, the host time spent choosing it, and when its device
  work began (compiling excluded: the pool keeps that account)."""
  mode: str
  active: int
  bucket: int
  strategy: object = None
  stats: object = None
  iterations: object = None
  tail: bool = False
  waited: bool = False  # a tail call decoded plainly for want of a compiled SD program
  host_s: float = 0.0
  t_start: float = 0.0
  cold: bool = False  # the call's program ran for the first time: it carries one-time costs
  # The pool's critical-path compile seconds when the call was dispatched: the host loop
  # compiles for other slices while this call runs, and that time is not this call's.
  compile_mark: float = 0.0


class _SliceRun:
  """One slice during one generate(): its scheduler, its GenState and what it has finished."""

  def __init__(self, engine: RolloutEngine, s: int, request_ids: list[int],
               requests: list[list[int]], sp: SamplingParams, key, logged: set[int],
               compile_priority: int | None, num_samples: int, finished_all: dict):
    """finished_all: every request finished so far on this process (request id -> (tokens,
    reason, log-probs)), shared by the slices and read for the corpus of suffix drafting."""
    ec = engine.econf
    self.engine, self.slice, self.sampling = engine, s, sp
    self.compile_priority, self.num_samples = compile_priority, num_samples
    self.requests, self.logged, self.finished_all = requests, logged, finished_all
    self.prog = engine.programs[s]
    # On the slice's devices: a program compiled ahead takes its arguments' placement, and one
    # for another slice than the key's device would not lower.
    self.key = self.prog.put(key)
    tuner = engine.tuner if engine.speculative else None
    self.sched = SliceScheduler(
        request_ids, ec.max_batch, ec.sd_threshold, ec.iterations_per_call,
        self._choose if tuner else None, ec.batch_sizes,
        choice_floor=(lambda running: tuner.bucket_range(tuner.bucket_of(running))[0])
        if tuner else None,
        iterations_for=tuner.iterations_for if tuner else None)
    n_logged = sum(r in logged for r in request_ids)
    # The feature store: logged rows land here as they finish, in finishing order.
    self.store = self.prog.empty_store(bucket(n_logged, 1 << 30)) if n_logged else None
    self.store_ids: list[int] = []
    self.store_seqs: list[np.ndarray] = []
    self.state: GenState | None = None
    self._waiting = False  # the last choice found no SD program compiled
    self._finished: dict[int, tuple[list[int], str]] = {}

  @property
  def busy(self) -> bool:
    return self.sched.busy

  def feature_block(self) -> FeatureBlock | None:
    if self.store is None:
      return None
    return FeatureBlock(features=self.store, request_ids=list(self.store_ids),
                        sequences=list(self.store_seqs),
                        prompt_lens=[len(self.requests[r]) for r in self.store_ids])

  def pop_finished(self):
    out, self._finished = self._finished, {}
    return out

  def _choose(self, running: int):
    """The tuner's strategy for `running` rows; compiling ahead, among the ready ones (when
    none is, the call is marked as waiting)."""
    tuner = self.engine.tuner
    self._waiting = False
    if not self.engine.econf.compile_ahead:
      return tuner.choose(running)
    batch = self.engine.econf.batch_for(running)
    ready = lambda s: self.prog.decode_ready(batch, s, self.sampling)  # noqa: E731
    self._waiting = not any(ready(s) for s in tuner.strategies_for(running) if s is not None)
    return tuner.choose(running, ready)

  def dispatch(self) -> _Call:
    """Carries out the scheduler's next decisions up to one prefill or decode call, and
    dispatches it (returns before the device is done)."""
    t_host = time.perf_counter()
    action = self.sched.next_action()
    compacted = None
    if isinstance(action, Compact):
      compacted = np.asarray(action.order, np.int32)
      action = self.sched.next_action()
    t_start = time.perf_counter()
    pool = self.engine.pool
    first_uses, compile_s = pool.first_uses, pool.compile_seconds
    if compacted is not None:
      self.state = self.prog.take_rows(self.state, compacted)
    if isinstance(action, Start):
      self.state = self._prefill(action.requests, action.batch, share=True)
      if (self.engine.speculative and self.engine.econf.compile_ahead
          and self.compile_priority is not None):
        self.prog.decode_ahead(*self._params(), self.state, self.key, self.sampling,
                               self.engine.tail_plan(), self.compile_priority)
      call = _Call("prefill", len(action.requests), action.batch)
    elif isinstance(action, Refill):
      fresh = self._prefill(action.requests, action.group, share=False)
      target = np.full((action.group,), self.sched.batch, np.int32)  # past the batch: dropped
      target[:len(action.rows)] = action.rows
      self.state = self.prog.put_rows(self.state, fresh, target)
      call = _Call("prefill", len(action.requests), action.group)
    else:
      assert isinstance(action, Decode), action
      self.state, stats, iterations = self.prog.decode(
          *self._params(), self.state, self.key, self.sampling, action.strategy,
          action.min_running, action.max_iterations, self._corpus(action.strategy))
      call = _Call("sd" if action.strategy is not None else "plain", action.running,
                   self.sched.batch, action.strategy, stats, iterations, action.tail,
                   waited=action.tail and action.strategy is None and self._waiting)
    call.host_s = t_start - t_host
    call.t_start = t_start + (pool.compile_seconds - compile_s)
    call.cold = pool.first_uses != first_uses
    call.compile_mark = pool.compile_seconds
    return call

  def _corpus(self, strategy) -> np.ndarray | None:
    """For a strategy whose drafters read one: [batch, corpus_rows, max_new_tokens] int32, per
    row its group's finished responses (the same prompt's other samples, most recent
    first), -1 padding; None otherwise."""
    if strategy is None or not reads_corpus(strategy.drafts):
      return None
    ec, ns = self.engine.econf, self.num_samples
    corpus = np.full((self.sched.batch, ec.corpus_rows, ec.max_new_tokens), -1, np.int32)
    for i, r in enumerate(self.sched.rows):
      if r < 0:
        continue
      done = [q for q in self.finished_all if q // ns == r // ns and q != r]  # finishing order
      for j, q in enumerate(reversed(done[-ec.corpus_rows:])):
        toks = self.finished_all[q][0][:ec.max_new_tokens]
        corpus[i, j, :len(toks)] = toks
    return corpus

  def _prefill(self, request_ids, batch: int, share: bool) -> GenState:
    """Prefills the requests into a fresh batch of `batch` rows. With `share` (a slice's first
    batch), requests with the same prompt (a GRPO group's samples) share one prefill row, the
    distinct prompts padded to a power-of-two count. A refill does not share: each distinct
    count would be a prefill program of its own per group size, for a few rows (sharing in
    refills, the tiny default's 16 steps compiled 73 prefill programs; without, 50)."""
    ec = self.engine.econf
    keys = [tuple(self.requests[r]) for r in request_ids]
    where = {p: i for i, p in enumerate(dict.fromkeys(keys))}  # prompt -> its prefill row
    width = ec.width_for(max(map(len, where)))
    prompts = np.full((bucket(len(where), batch) if share else batch, width), ec.pad_id,
                      np.int32)
    lengths = np.ones((prompts.shape[0],), np.int32)
    for p, i in where.items():
      prompts[i, :len(p)], lengths[i] = p, len(p)
    source = np.zeros((batch,), np.int32)
    source[:len(keys)] = [where[p] for p in keys]
    ids = np.full((batch,), -1, np.int32)
    ids[:len(keys)] = request_ids
    return self.prog.start(*self._params(), prompts, lengths, source, ids, self.key, self.sampling)

  def _params(self) -> tuple[dict, dict]:
    """(policy params, drafters) as placed on this slice."""
    return self.engine._params_on(self.slice)

  def complete(self, call: _Call, t0: float) -> StepRecord:
    """Waits for the call's results (the one host sync), harvests finished rows and tells
    the scheduler and the tuner."""
    done, num_out, stats, iterations = jax.device_get(
        (self.state.done, self.state.num_out, call.stats, call.iterations))
    t_ready = time.perf_counter()
    wall = t_ready - call.t_start - (self.engine.pool.compile_seconds - call.compile_mark)
    # A prefill emits each row's first token; a decode call always has stats.
    emitted, accept, iters, row_iterations = call.active, 0.0, 0, 0
    if stats is not None:
      iters = int(iterations)
      emitted = int(stats.emitted.sum())
      row_iterations = int(stats.iterations.sum())
      accept = float(stats.accepted.sum()) / row_iterations if row_iterations else 0.0
      tuner = self.engine.tuner
      if (call.tail and iters and not call.cold  # a program's first run would mislead it
          and tuner.knows(call.active, call.strategy)):  # not PLAIN for want of a ready arm
        tuner.update(call.active, call.strategy, accept, wall / iters, iters)
    rows = self.sched.rows
    finished = [i for i, r in enumerate(rows) if r >= 0 and done[i]]
    if finished:
      out, out_logp = (np.asarray(x) for x in jax.device_get((self.state.out,
                                                              self.state.out_logp)))
      for i in finished:
        toks = out[i, :num_out[i]].tolist()
        self._finished[rows[i]] = (toks, self.engine._reason(toks),
                                   out_logp[i, :num_out[i]].tolist())
      if self.store is not None:
        self._harvest_features(finished)
      self.sched.finished(finished)
    if not self.sched.busy:
      self.state = None
    t_end = time.perf_counter()
    strategy = call.strategy.as_tuple() if call.strategy is not None else None
    return StepRecord(slice=self.slice, mode=call.mode, active=call.active, bucket=call.bucket,
                      strategy=strategy, emitted=emitted, accept_mean=accept, wall_s=wall,
                      t_end_s=t_end - t0, iterations=iters, row_iterations=row_iterations,
                      compiled=call.cold, waited=call.waited,
                      host_s=call.host_s + (t_end - t_ready))

  def _harvest_features(self, rows: list[int]) -> None:
    """Copies the finished rows' feature logs into the store, on device."""
    rows = [i for i in rows if self.sched.rows[i] in self.logged]
    if not rows:
      return
    k = bucket(len(rows), 1 << 30)
    src = np.zeros((k,), np.int32)
    dst = np.full((k,), self.store.shape[0], np.int32)  # padding points past the store: dropped
    src[:len(rows)] = rows
    dst[:len(rows)] = np.arange(len(self.store_ids), len(self.store_ids) + len(rows))
    self.store = self.prog.harvest(self.store, self.state.feature_log, src, dst)
    for i in rows:
      r = self.sched.rows[i]
      self.store_ids.append(r)
      self.store_seqs.append(np.asarray(list(self.requests[r]) + self._finished[r][0], np.int32))
