"""A bounded pool of ahead-of-time compiled executables, keyed by what changes their shapes.

Each key (for the rollout: slice, program, batch bucket, strategy) is compiled once with
`jax.jit(...).lower(...).compile()` and reused for the rest of the run, across RL steps too:
parameters are arguments, not constants. A pool bills compiles and their seconds per program
kind (`bill`, `merge_bills`), so tests can assert that a rollout compiles nothing new and runs
can report what compiling cost.

`compile_ahead` compiles on background threads (one per process unless `set_compile_threads`
says more) while the host loop goes on (XLA compiles outside the GIL); `ready(key)` says when a
key can be used without waiting. The bill
keeps the two apart: `programs`/`seconds` were on the critical path (the caller waited),
`ahead_programs`/`ahead_seconds` were not.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.thread  # registers its exit hook before _Background's (see there)
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax

from tlt_jax.mesh import on_mesh
from tlt_jax.rollout.traces import SharedTraces


class ExecutablePool:
  """Compiled executables by key; `max_size` bounds the pool (an error, not an eviction, so a
  shape leak shows up instead of silently recompiling)."""

  def __init__(self, max_size: int = 512):
    self.max_size = max_size
    self._exes: dict[Hashable, object] = {}
    self.compiles = 0             # on the critical path: the caller waited
    self.compile_seconds = 0.0
    self.ahead_compiles = 0       # in the background (`compile_ahead`)
    self.ahead_seconds = 0.0
    self.first_uses = 0           # keys served for the first time, however compiled
    self.bill: dict[str, dict[str, float]] = {}  # kind -> {"programs", "seconds", "ahead_..."}
    self._lock = threading.Lock()  # the books, when threads compile (spot training's slices)
    self._used: set[Hashable] = set()
    self._ahead: dict[Hashable, concurrent.futures.Future] = {}
    self._failed: dict[Hashable, BaseException] = {}
    self.traces = SharedTraces()  # programs traced once for every mesh of one shape

  def get(self, key: Hashable, fn: Callable, args: Sequence, donate_argnums=(),
          out_shardings: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
          kind: str = "program", share: Hashable | None = None) -> object:
    """The executable for `key`, compiling fn for `args` (arrays or ShapeDtypeStructs with
    shardings) on first use. `out_shardings(output_shapes)` pins the outputs' layout, so that a
    program's results can feed any other program of the pool. `mesh`: traced under
    `jax.set_mesh(mesh)`, so that the attention kernel runs per shard (kernels.per_shard). `kind`:
    the line of the bill its compile goes on. `share`: the program's name among meshes of one
    shape (the same function for the same argument shapes on other devices): traced once for
    them all (`SharedTraces`), each mesh lowering a call of that trace. A key whose compile
    ahead is running is waited for (the wait is billed to the critical path); one still queued
    is compiled here instead."""
    with self._lock:  # both at once: a compile ahead moves its key from one to the other
      exe, future = self._exes.get(key), self._ahead.get(key)
    if exe is None:
      self._raise_failed(key)
      if future is not None and future.cancel():  # queued, not started: compile it now
        with self._lock:
          del self._ahead[key]
        future = None
      if future is not None:
        t0 = time.perf_counter()
        concurrent.futures.wait([future])
        self._raise_failed(key)
        self._book(kind, time.perf_counter() - t0, programs=0)
        exe = self._exes[key]
      else:
        self._check_room(key)
        exe, seconds = _compile(fn, args, donate_argnums, out_shardings, mesh, kind,
                                self.traces, share)
        with self._lock:
          self._exes[key] = exe
        self._book(kind, seconds)
    if key not in self._used:
      with self._lock:  # checked again: two threads may ask for one new key at once
        if key not in self._used:
          self._used.add(key)
          self.first_uses += 1
    return exe

  def compile_ahead(self, key: Hashable, fn: Callable, args: Sequence, donate_argnums=(),
                    out_shardings: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
                    kind: str = "program", priority: int = 0,
                    share: Hashable | None = None) -> None:
    """Queues `key`'s compile (arguments as in `get`) on the process's background compile
    thread, unless it is compiled or queued already; they run one at a time, the lowest
    `priority` first, then in the order asked. Arrays among `args` are queued abstract, so a
    queued compile does not keep them alive (the rollout's previous weights, after an update)."""
    with self._lock:
      if key in self._exes or key in self._ahead or key in self._failed:
        return
      self._check_room(key, queued=len(self._ahead))
      self._ahead[key] = _BACKGROUND.submit(priority, functools.partial(
          self._compile_ahead, key, fn, abstract_arrays(args), donate_argnums, out_shardings,
          mesh, kind, share))

  def _compile_ahead(self, key, fn, args, donate_argnums, out_shardings, mesh, kind,
                     share) -> None:
    try:
      exe, seconds = _compile(fn, args, donate_argnums, out_shardings, mesh, kind,
                              self.traces, share)
    except BaseException as e:  # noqa: BLE001 -- kept, and raised where the key is asked for
      with self._lock:
        self._failed[key] = e
        del self._ahead[key]
      return
    self._book(kind, seconds, ahead=True)
    with self._lock:
      self._exes[key] = exe
      del self._ahead[key]

  def ready(self, key: Hashable) -> bool:
    """Whether `key` is compiled (a call would not wait); raises if its compile ahead failed."""
    self._raise_failed(key)
    return key in self._exes

  def pending(self) -> int:
    """Compiles queued or running in the background."""
    return len(self._ahead)

  def close(self) -> None:
    """Drops this pool's queued compiles ahead (one already running finishes); the pool
    stays usable and compiles on demand."""
    with self._lock:
      for key, future in list(self._ahead.items()):
        if future.cancel():
          del self._ahead[key]

  def _check_room(self, key, queued: int = 0) -> None:
    if len(self._exes) + queued >= self.max_size:
      raise RuntimeError(f"executable pool is full ({self.max_size}); new key {key!r}. "
                         f"Fewer batch buckets or strategies, or a larger pool")

  def _raise_failed(self, key) -> None:
    error = self._failed.get(key)
    if error is not None:
      raise RuntimeError(f"compiling {key!r} ahead failed: {error}") from error

  def _book(self, kind: str, seconds: float, programs: int = 1, ahead: bool = False) -> None:
    prefix = "ahead_" if ahead else ""
    with self._lock:
      line = self.bill.setdefault(kind, {"programs": 0, "seconds": 0.0,
                                         "ahead_programs": 0, "ahead_seconds": 0.0})
      line[prefix + "programs"] += programs
      line[prefix + "seconds"] += seconds
      if ahead:
        self.ahead_compiles += programs
        self.ahead_seconds += seconds
      else:
        self.compiles += programs
        self.compile_seconds += seconds

  def __contains__(self, key: Hashable) -> bool:
    return key in self._exes

  def __len__(self) -> int:
    return len(self._exes)

  def __iter__(self):
    """The keys of the compiled executables."""
    return iter(list(self._exes))

  def report(self) -> dict:
    """{'executables', 'compiles', 'compile_s', 'ahead_compiles', 'ahead_s', 'bill', 'keys'}
    for logs and benchmarks (compiles / compile_s: on the critical path)."""
    return {"executables": len(self._exes), "compiles": self.compiles,
            "compile_s": self.compile_seconds, "ahead_compiles": self.ahead_compiles,
            "ahead_s": self.ahead_seconds, "bill": merge_bills([self]),
            "keys": [repr(k) for k in self._exes]}


def merge_bills(pools: Sequence[ExecutablePool]) -> dict[str, dict[str, float]]:
  """The pools' compiles per program kind, summed: kind -> {"programs", "seconds" (on the
  critical path: the host waited), "ahead_programs", "ahead_seconds" (in the background)},
  kinds in alphabetical order."""
  out: dict[str, dict[str, float]] = {}
  for pool in pools:
    for kind, line in pool.bill.items():
      total = out.setdefault(kind, dict.fromkeys(line, 0))
      for name, value in line.items():
        total[name] += value
  return dict(sorted(out.items()))


class _Background:
  """The threads that compile ahead for every pool of the process, the most urgent (lowest
  priority number, then first asked) first: one by default, one compile at a time beside the
  host loop (more would take cores from the programs that run); `set_compile_threads` for a
  host with cores to spare (a GPU host compiling a run's whole plan before it starts)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._heap: list = []
    self._order = itertools.count()
    self._executor: concurrent.futures.ThreadPoolExecutor | None = None
    self._threads = 1
    self._running: set[concurrent.futures.Future] = set()
    # Set at interpreter exit before the executor's threads are joined: threading runs these
    # hooks last registered first, so this one before that of concurrent.futures.thread
    # (imported above, at import time). The main thread still counts as alive then: asking
    # it let every queued compile run at exit (minutes, behind a crash).
    self._exiting = False
    threading._register_atexit(self._exit)

  def _exit(self) -> None:
    self._exiting = True

  def submit(self, priority: int, fn: Callable[[], None]) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    with self._lock:
      heapq.heappush(self._heap, (priority, next(self._order), future, fn))
      if self._executor is None:
        # Its threads are joined at exit: compiles in flight finish, queued ones are dropped.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=self._threads, thread_name_prefix="compile-ahead")
      self._executor.submit(self._run_next)  # one run per entry
    return future

  def set_threads(self, threads: int) -> None:
    """Compile on `threads` threads from now on (compiles queued or running are kept)."""
    if threads < 1:
      raise ValueError(f"rollout.compile_threads={threads} must be >= 1")
    with self._lock:
      old, changed, self._threads = self._executor, threads != self._threads, threads
      if old is None or not changed:
        return
      # A new executor takes over the queue: one run per entry still waiting, while the old
      # one's runs (each pops whatever is most urgent, or nothing) finish and its threads end.
      self._executor = concurrent.futures.ThreadPoolExecutor(
          max_workers=threads, thread_name_prefix="compile-ahead")
      for _ in self._heap:
        self._executor.submit(self._run_next)
    old.shutdown(wait=False)

  def _run_next(self) -> None:
    with self._lock:
      if not self._heap:
        return
      _, _, future, fn = heapq.heappop(self._heap)
      # Under the lock: `wait_idle` always sees it in one place or the other.
      self._running.add(future)
    try:
      if self._exiting:
        future.cancel()  # the interpreter is exiting: nobody will use the program
      if not future.set_running_or_notify_cancel():
        return  # cancelled while queued
      try:
        future.set_result(fn())
      except BaseException as e:  # noqa: BLE001 -- handed to whoever holds the future
        future.set_exception(e)
    finally:
      with self._lock:
        self._running.discard(future)

  def wait_idle(self) -> None:
    """Returns once no compile runs or waits in the queue."""
    while True:
      with self._lock:
        pending = [f for _, _, f, _ in self._heap if not f.done()]
        pending += [f for f in self._running if not f.done()]
      if not pending:
        return
      concurrent.futures.wait(pending)


_BACKGROUND = _Background()


def set_compile_threads(threads: int) -> None:
  """Compile ahead on `threads` threads (the process's; `rollout.compile_threads`)."""
  _BACKGROUND.set_threads(threads)


def wait_for_compiles_ahead() -> None:
  """Blocks until the compile in flight and those still queued (a closed pool's were dropped)
  have finished. Call it before removing or switching the persistent compilation cache, which a
  running compile would otherwise write to once it ends (`experiments/rl_runs.py` does)."""
  _BACKGROUND.wait_idle()


def abstract_arrays(tree):
  """`tree` with each jax.Array replaced by a ShapeDtypeStruct of its shape, dtype and
  sharding (what a compile needs of it)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                      if isinstance(x, jax.Array) else x, tree)


def _compile(fn, args, donate_argnums, out_shardings, mesh, kind,
             traces: SharedTraces | None = None,
             share: Hashable | None = None) -> tuple[object, float]:
  """(executable, seconds): fn lowered for args and compiled, as the program `jit_<kind>` (the
  name profiles and XLA dumps show, e.g. jit_rollout_decode_sd, jit_policy_update); with a
  `share` key, lowered as a call of its trace in `traces` (traced there on first use)."""
  t0 = time.perf_counter()
  if share is not None and mesh is not None:
    pinned = fn if out_shardings is None else with_output_layout(fn, out_shardings)
    fn = traces.program(share, pinned, abstract_arrays(args), donate_argnums, mesh, kind) or fn
  if out_shardings is not None:  # on this mesh (a shared trace pinned them on the first one)
    fn = with_output_layout(fn, out_shardings)

  def program(*args):
    return fn(*args)
  program.__name__ = program.__qualname__ = kind
  with on_mesh(mesh):
    exe = jax.jit(program, donate_argnums=donate_argnums).lower(*args).compile()
  return exe, time.perf_counter() - t0


def with_output_layout(fn: Callable, out_shardings: Callable) -> Callable:
  """fn whose outputs are constrained to `out_shardings(outputs)`: the layout pinned inside
  the one trace that lowering does (asking jit for out_shardings would need the output
  shapes first, that is, a second trace of the whole program)."""
  def pinned(*args):
    out = fn(*args)
    return jax.lax.with_sharding_constraint(out, out_shardings(out))
  return pinned
