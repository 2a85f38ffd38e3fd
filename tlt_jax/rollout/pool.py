"""A bounded pool of ahead-of-time compiled executables, keyed by what changes their shapes.

The rollout compiles each (slice, program, batch bucket, strategy) once with
`jax.jit(...).lower(...).compile()` and reuses it for the rest of the run: across RL steps
too, since parameters are arguments, not constants. The policy update (one per batch shape)
and the spot drafter update (one per slice) compile through pools of their own. A pool counts
compilations and their seconds per program kind (`bill`), so tests can assert that a rollout
compiles nothing new and runs can report what compiling cost (`merge_bills`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence

import jax

from tlt_jax.mesh import on_mesh


class ExecutablePool:
  """Compiled executables by key; `max_size` bounds the pool (an error, not an eviction, so a
  shape leak shows up instead of silently recompiling)."""

  def __init__(self, max_size: int = 512):
    self.max_size = max_size
    self._exes: dict[Hashable, object] = {}
    self.compiles = 0
    self.compile_seconds = 0.0
    self.bill: dict[str, dict[str, float]] = {}  # kind -> {"programs", "seconds"}
    self._lock = threading.Lock()  # the books, when threads compile (spot training's slices)

  def get(self, key: Hashable, fn: Callable, args: Sequence, donate_argnums=(),
          out_shardings: Callable | None = None, mesh: jax.sharding.Mesh | None = None,
          kind: str = "program") -> object:
    """The executable for `key`, compiling fn for `args` (arrays or ShapeDtypeStructs with
    shardings) on first use. `out_shardings(output_shapes)` pins the outputs' layout, so that
    a program's results can feed any other program of the pool. `mesh`: traced under
    `jax.set_mesh(mesh)`, so that the attention kernel runs per shard (kernels.per_shard).
    `kind`: the line of the bill its compile goes on."""
    exe = self._exes.get(key)
    if exe is None:
      if len(self._exes) >= self.max_size:
        raise RuntimeError(f"executable pool is full ({self.max_size}); new key {key!r}. "
                           f"Fewer batch buckets or strategies, or a larger pool")
      t0 = time.perf_counter()
      if out_shardings is not None:
        fn = with_output_layout(fn, out_shardings)
      with on_mesh(mesh):
        exe = jax.jit(fn, donate_argnums=donate_argnums).lower(*args).compile()
      seconds = time.perf_counter() - t0
      with self._lock:
        self.compile_seconds += seconds
        self.compiles += 1
        line = self.bill.setdefault(kind, {"programs": 0, "seconds": 0.0})
        line["programs"] += 1
        line["seconds"] += seconds
        self._exes[key] = exe
    return exe

  def __contains__(self, key: Hashable) -> bool:
    return key in self._exes

  def __len__(self) -> int:
    return len(self._exes)

  def report(self) -> dict:
    """{'executables', 'compiles', 'compile_s', 'bill', 'keys'} for logs and benchmarks."""
    return {"executables": len(self._exes), "compiles": self.compiles,
            "compile_s": self.compile_seconds, "bill": merge_bills([self]),
            "keys": [repr(k) for k in self._exes]}


def merge_bills(pools: Sequence[ExecutablePool]) -> dict[str, dict[str, float]]:
  """The pools' compiles per program kind, summed: kind -> {"programs", "seconds"}, kinds in
  alphabetical order. Every compile is on the critical path (the host waits for it)."""
  out: dict[str, dict[str, float]] = {}
  for pool in pools:
    for kind, line in pool.bill.items():
      total = out.setdefault(kind, {"programs": 0, "seconds": 0.0})
      total["programs"] += line["programs"]
      total["seconds"] += line["seconds"]
  return dict(sorted(out.items()))


def with_output_layout(fn: Callable, out_shardings: Callable) -> Callable:
  """fn whose outputs are constrained to `out_shardings(outputs)`: the layout pinned inside
  the one trace that lowering does (asking jit for out_shardings would need the output
  shapes first, that is, a second trace of the whole program)."""
  def pinned(*args):
    out = fn(*args)
    return jax.lax.with_sharding_constraint(out, out_shardings(out))
  return pinned
