"""A bounded pool of ahead-of-time compiled executables, keyed by what changes their shapes.

The rollout compiles each (slice, program, batch bucket, strategy) once with
`jax.jit(...).lower(...).compile()` and reuses it for the rest of the run: across RL steps
too, since parameters are arguments, not constants. The pool counts compilations and their
seconds, so tests can assert that a rollout compiles nothing new and reports can show the cost.
"""

from __future__ import annotations

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

  def get(self, key: Hashable, fn: Callable, args: Sequence, donate_argnums=(),
          out_shardings: Callable | None = None, mesh: jax.sharding.Mesh | None = None
          ) -> object:
    """The executable for `key`, compiling fn for `args` (arrays or ShapeDtypeStructs with
    shardings) on first use. `out_shardings(output_shapes)` pins the outputs' layout, so that
    a program's results can feed any other program of the pool. `mesh`: traced under
    `jax.set_mesh(mesh)`, so that the attention kernel runs per shard (kernels.per_shard)."""
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
      self.compile_seconds += time.perf_counter() - t0
      self.compiles += 1
      self._exes[key] = exe
    return exe

  def __contains__(self, key: Hashable) -> bool:
    return key in self._exes

  def __len__(self) -> int:
    return len(self._exes)

  def report(self) -> dict:
    """{'executables', 'compiles', 'compile_s', 'keys'} for logs and benchmarks."""
    return {"executables": len(self._exes), "compiles": self.compiles,
            "compile_s": self.compile_seconds, "keys": [repr(k) for k in self._exes]}


def with_output_layout(fn: Callable, out_shardings: Callable) -> Callable:
  """fn whose outputs are constrained to `out_shardings(outputs)`: the layout pinned inside
  the one trace that lowering does (asking jit for out_shardings would need the output
  shapes first, that is, a second trace of the whole program)."""
  def pinned(*args):
    out = fn(*args)
    return jax.lax.with_sharding_constraint(out, out_shardings(out))
  return pinned
