"""The compiled programs of one rollout slice, from the engine's executable pool.

Each program is compiled ahead of time per (slice, program, shape bucket, strategy, sampling
support) and reused for the rest of the run (parameters are arguments, not constants; so is
the temperature, so greedy evaluation and sampled rollouts share programs). Outputs are laid
out on the slice by the logical axes that states and caches declare, so the result of any
program can feed any other. Calling a program dispatches it and returns at once; the engine
waits for results only when it needs them on the host.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.mesh import logical_shardings
from tlt_jax.models.config import ModelConfig
from tlt_jax.drafters import Drafter, reads_corpus
from tlt_jax.models.kv_cache import KVCache, init_cache
from tlt_jax.models.policy import Policy
from tlt_jax.rollout.feature_log import store_rows
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.rollout.state_ops import put_rows, take_rows
from tlt_jax.speculative.decoding import GenState, batch_first, decode_loop, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy


class SlicePrograms:
  """Programs of slice `s` (its sub-mesh `mesh`), compiled into the shared `pool`.

  drafters: name -> the drafters the programs are built for (their settings; the weights
  are each call's `drafters` argument, laid out on the slice), none for plain decoding only.
  capacity: cache slots per row; max_new_tokens: the output width; eos_id: end token.
  corpus_rows: responses per row that an SD program with the suffix drafter takes to copy
  from (its `corpus` argument, [batch, corpus_rows, max_new_tokens]).
  shared_shape(batch, strategy) -> Strategy | None: the larger strategy whose program runs
  `strategy` at this batch size (one program serves several strategies, each drawing its own
  tree within the larger one's shapes; see `build_draft_tree`), or None for its own program.
  share_traces: whether programs are traced once for every slice of the pool
  (`ExecutablePool.get`'s `share`; worth it where a process drives several slices).
  """

  def __init__(self, s: int, mesh: Mesh, pool: ExecutablePool, cfg: ModelConfig,
               drafters: dict[str, Drafter], capacity: int, max_new_tokens: int, eos_id: int,
               rules, log_features: bool,
               shared_shape: Callable[[int, Strategy], Strategy | None] | None = None,
               corpus_rows: int = 8, share_traces: bool = False):
    self.s, self.mesh, self.pool = s, mesh, pool
    self.cfg, self.drafters, self.rules = cfg, dict(drafters), rules
    self.capacity, self.max_new_tokens, self.eos_id = capacity, max_new_tokens, eos_id
    self.log_features = log_features
    self.shared_shape = shared_shape or (lambda batch, strategy: None)
    self.corpus_rows = corpus_rows
    self.share_traces = share_traces

  def put(self, x: np.ndarray) -> jax.Array:
    """A host array onto the slice, replicated."""
    return jax.device_put(x, NamedSharding(self.mesh, P()))

  def _layout(self, shapes):
    """out_shardings: states and caches by the logical axes they declare, every other array
    (step stats, feature stores) batch-first, scalars replicated."""
    def declared(x):
      return isinstance(x, (GenState, KVCache))
    axes = jax.tree.map(lambda x: x.logical_axes() if declared(x) else batch_first(x),
                        shapes, is_leaf=declared)
    return logical_shardings(axes, self.mesh, self.rules, shapes)

  def _key(self, key: tuple) -> tuple:
    """The pool's key of this slice's program `key` = (kind, shape and setting ...)."""
    return (self.s, *key)

  def _share(self, key: tuple) -> tuple | None:
    """The name that program `key` shares with the other slices' (None: traced here)."""
    return ("rollout", *key) if self.share_traces else None

  def _run(self, key, fn, args, donate=()):
    """Runs the pool's program for key = (kind, shape and setting ...) on this slice on args;
    its compile is billed as `rollout_<kind>` (SD decode calls as `rollout_decode_sd`)."""
    return self.pool.get(self._key(key), fn, args, donate_argnums=donate,
                         out_shardings=self._layout, mesh=self.mesh, kind=_bill_kind(key),
                         share=self._share(key))(*args)

  # ---------------------------------------------------------------- programs

  def start(self, params, drafters: dict, prompts: np.ndarray, lengths: np.ndarray,
            source: np.ndarray, requests: np.ndarray, key: jax.Array,
            sp: SamplingParams) -> GenState:
    """Prefills right-padded distinct prompts [U, P] (lengths [U]) into fresh caches of B
    rows: row b starts from prompt source[b] and serves requests[b] (-1 for padding rows,
    which start done). drafters: name -> drafter with its weights on the slice."""
    b = requests.shape[0]
    empty_caches, prefill = self._start_fns(b, sp)
    # The empty caches are made by their own program and passed in (donated): built inside
    # the prefill, they would be compile-time constants that XLA tries to fold through the
    # attention, which makes compiles slow.
    caches = self._run(("caches", b), empty_caches, ())
    args = (params, drafters, self.put(prompts), self.put(lengths), self.put(source),
            self.put(requests), key, caches, self._temperature(sp))
    return self._run(("prefill", b, *prompts.shape, sp.program_key), prefill, args, donate=(7,))

  def _start_fns(self, b: int, sp: SamplingParams):
    """(empty caches of b rows, the prefill program's function) of `start`."""
    cfg = self.cfg

    def empty_caches():
      states = {name: d.init_state(cfg, b, self.capacity) for name, d in self.drafters.items()}
      return (init_cache(cfg, b, self.capacity),
              {name: st for name, st in states.items() if st is not None})

    def prefill(params, drafters, prompts, lengths, source, requests, key, caches, temperature):
      state = start(Policy(params, cfg), prompts, lengths, caches[0], key,
                    sp.with_temperature(temperature),
                    self.max_new_tokens, self.eos_id, drafters=drafters,
                    draft_states=caches[1], log_features=self.log_features, requests=requests,
                    source=source)
      return state.replace(done=state.done | (requests < 0))
    return empty_caches, prefill

  def start_ahead(self, params, drafters: dict, batch: int, prompts: int, width: int,
                  key: jax.Array, sp: SamplingParams, priority: int = 0) -> GenState:
    """Queues the compiles of `start`'s programs for a batch of `batch` rows from `prompts`
    distinct prompts padded to `width` tokens (`ExecutablePool.compile_ahead`); returns the
    state it would make, abstract (jax.ShapeDtypeStruct leaves laid out on the slice), for
    `decode_ahead` and `take_ahead`."""
    empty_caches, prefill = self._start_fns(batch, sp)
    self.pool.compile_ahead(self._key(("caches", batch)), empty_caches, (),
                            out_shardings=self._layout, mesh=self.mesh,
                            kind=_bill_kind(("caches",)), priority=priority,
                            share=self._share(("caches", batch)))
    replicated = NamedSharding(self.mesh, P())

    def host(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)
    caches = self._laid_out(jax.eval_shape(empty_caches))
    args = (params, drafters, host((prompts, width), np.int32), host((prompts,), np.int32),
            host((batch,), np.int32), host((batch,), np.int32), key, caches,
            host((), np.float32))
    key_p = ("prefill", batch, prompts, width, sp.program_key)
    self.pool.compile_ahead(self._key(key_p), prefill, args, donate_argnums=(7,),
                            out_shardings=self._layout, mesh=self.mesh, kind=_bill_kind(key_p),
                            priority=priority, share=self._share(key_p))
    return self._laid_out(jax.eval_shape(prefill, *args))

  def resized(self, state: GenState, rows: int) -> GenState:
    """The abstract state of `rows` rows that `take_rows` would make of `state` (any state of
    this slice, abstract or not)."""
    return self._laid_out(jax.eval_shape(take_rows, state, jax.ShapeDtypeStruct((rows,),
                                                                               np.int32)))

  def _laid_out(self, shapes):
    """Abstract arrays `shapes` with the shardings this slice's programs give them."""
    return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                        shapes, self._layout(shapes))

  def _temperature(self, sp: SamplingParams) -> jax.Array:
    return self.put(np.float32(sp.temperature))

  def _decode_program(self, batch: int, strategy: Strategy | None, sp: SamplingParams):
    """(program key, the strategy that shapes the program, whether it takes `limits`)."""
    shape = None if strategy is None else self.shared_shape(batch, strategy)
    if shape is None:
      return ("decode", batch, strategy, sp.program_key), strategy, False
    return ("decode", batch, ("shared", shape), sp.program_key), shape, True

  def decode(self, params, drafters: dict, state: GenState, key: jax.Array, sp: SamplingParams,
             strategy: Strategy | None, min_running: int, max_iterations: int,
             corpus: np.ndarray | None = None):
    """Up to max_iterations plain steps or SD iterations (`decode_loop`) -> (state, stats,
    iterations); the state is donated. corpus: with a strategy whose drafters read one (the
    suffix drafter), [B, corpus_rows, max_new_tokens] int32 responses to copy from, -1
    padding (None: none)."""
    b = state.root.shape[0]
    key_b, shape, shared = self._decode_program(b, strategy, sp)
    args = (params, drafters, state, key, self.put(np.int32(min_running)),
            self.put(np.int32(max_iterations)), self._temperature(sp))
    if shared:
      args += (self.put(np.asarray([strategy.depth, strategy.verify_tokens], np.int32)),)
    if _copies(shape):
      if corpus is None:
        corpus = np.full(self._corpus_shape(b), -1, np.int32)
      args += (self.put(np.asarray(corpus, np.int32)),)
    return self._run(key_b, self._decode_fn(sp, shape, shared), args, donate=(2,))

  def _corpus_shape(self, batch: int) -> tuple[int, int, int]:
    return (batch, self.corpus_rows, self.max_new_tokens)

  def decode_ahead(self, params, drafters: dict, state: GenState, key: jax.Array,
                   sp: SamplingParams, plan, priority: int = 0) -> None:
    """Queues the decode programs of `plan` [(batch, strategy)] for compiling in the
    background (`ExecutablePool.compile_ahead`, at `priority`); state: any state of this slice
    (its rows are taken abstractly to each batch size)."""
    replicated = NamedSharding(self.mesh, P())
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    temperature = jax.ShapeDtypeStruct((), np.float32, sharding=replicated)
    for b, strategy in plan:
      key_b, shape, shared = self._decode_program(b, strategy, sp)
      if self._key(key_b) in self.pool:
        continue
      args = (params, drafters, self.resized(state, b), key, scalar, scalar, temperature)
      if shared:
        args += (jax.ShapeDtypeStruct((2,), np.int32, sharding=replicated),)
      if _copies(shape):
        args += (jax.ShapeDtypeStruct(self._corpus_shape(b), np.int32, sharding=replicated),)
      self.pool.compile_ahead(self._key(key_b), self._decode_fn(sp, shape, shared), args,
                              donate_argnums=(2,), out_shardings=self._layout, mesh=self.mesh,
                              kind=_bill_kind(key_b), priority=priority,
                              share=self._share(key_b))

  def decode_executable(self, batch: int, strategy: Strategy | None, sp: SamplingParams):
    """The compiled decode program that runs (batch, strategy, sp) (a `jax.stages.Compiled`:
    its `as_text()` is the optimised HLO), or None before it is compiled."""
    key = self._key(self._decode_program(batch, strategy, sp)[0])
    return self.pool.get(key, None, ()) if key in self.pool else None

  def decode_ready(self, batch: int, strategy: Strategy | None, sp: SamplingParams) -> bool:
    """Whether the decode program that runs (batch, strategy, sp) is compiled."""
    return self.pool.ready(self._key(self._decode_program(batch, strategy, sp)[0]))

  def _decode_fn(self, sp: SamplingParams, strategy: Strategy | None, shared: bool):
    """The decode program's function. After (params, drafters, state, key, min_running,
    max_iterations, temperature) come: for a shared program, the strategy it runs, limits =
    int32 [2] (steps, verify_tokens); with a drafter that reads a corpus, the corpus."""
    cfg, eos = self.cfg, self.eos_id

    def fn(params, drafters, state, key, min_running, max_iterations, temperature, *extra):
      limits = extra[0] if shared else None
      corpus = extra[-1] if _copies(strategy) else None
      return decode_loop(Policy(params, cfg), drafters, state, key,
                         min_running, max_iterations, sp.with_temperature(temperature), eos,
                         strategy=strategy, limits=limits, corpus=corpus)
    return fn

  def put_rows(self, state: GenState, fresh: GenState, rows: np.ndarray) -> GenState:
    """state with rows `rows` replaced by fresh's rows (out-of-range indices dropped)."""
    return self._run(("put", state.root.shape[0], fresh.root.shape[0]), put_rows,
                     (state, fresh, self.put(rows)), donate=(0,))

  def take_rows(self, state: GenState, order: np.ndarray) -> GenState:
    """A smaller state of state's rows `order`."""
    return self._run(("take", state.root.shape[0], len(order)), take_rows,
                     (state, self.put(order)))

  def take_ahead(self, state: GenState, rows: int, priority: int = 0) -> None:
    """Queues the compile of `take_rows` from `state` (any state of this slice, abstract or
    not) to a batch of `rows` rows."""
    key = ("take", state.root.shape[0], rows)
    order = jax.ShapeDtypeStruct((rows,), np.int32, sharding=NamedSharding(self.mesh, P()))
    self.pool.compile_ahead(self._key(key), take_rows, (state, order),
                            out_shardings=self._layout, mesh=self.mesh, kind=_bill_kind(key),
                            priority=priority, share=self._share(key))

  def empty_store(self, rows: int) -> jax.Array:
    """An empty feature store [rows, C, F] on the slice."""
    shape = (rows, self.capacity, self.cfg.feature_size)
    return self._run(("store", rows), lambda: jnp.zeros(shape, self.cfg.jnp_dtype), ())

  def harvest(self, store: jax.Array, log: jax.Array, src: np.ndarray,
              dst: np.ndarray) -> jax.Array:
    """store with rows dst set to log's rows src (dst past the store: dropped); donated."""
    return self._run(("harvest", store.shape[0], log.shape[0], len(src)), store_rows,
                     (store, log, self.put(src), self.put(dst)), donate=(0,))


def _copies(strategy: Strategy | None) -> bool:
  """Whether the strategy's program drafts with a drafter that reads a corpus (and so takes one)."""
  return strategy is not None and reads_corpus(strategy.drafts)


def _bill_kind(key: tuple) -> str:
  """`rollout_<program>`, SD decode calls as `rollout_decode_sd`."""
  return "rollout_" + key[0] + ("_sd" if key[0] == "decode" and key[2] is not None else "")
