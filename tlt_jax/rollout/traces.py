"""One trace per program for every slice of one shape.

Rollout slices run the same programs on their own devices. Tracing and lowering a program
(the Python model code, then StableHLO) costs seconds on each slice; compiling its HLO is
shared through the compilation cache. `SharedTraces` traces and lowers a program once, as a
`jax.export.Exported` (device-independent: its shardings name positions in the mesh, not
devices), and each slice then lowers only a call of it for its own devices, which inlines the
exported module instead of tracing the model again.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence

import jax

from tlt_jax.mesh import on_mesh


# The exported programs never leave the process that made them, so jax.export's promise that
# a serialized program runs on later versions of JAX is not needed: the custom calls it would
# refuse for lack of that promise (the attention kernel's, lowered by Pallas to Triton on GPU)
# are allowed.
_IN_PROCESS_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(target)
                           for target in ("__gpu$xla.gpu.triton", "triton_kernel_call"))


def export_program(fn: Callable, args: Sequence, donate_argnums=(),
                   platforms: Sequence[str] | None = None) -> jax.export.Exported:
  """fn traced and lowered once for args (ShapeDtypeStructs or arrays with shardings), as an
  Exported that any devices of the same mesh shape can call (`Exported.call` inside a jit);
  platforms: those to lower for (None: this machine's)."""
  return jax.export.export(jax.jit(fn, donate_argnums=donate_argnums), platforms=platforms,
                           disabled_checks=_IN_PROCESS_CHECKS)(*args)


class SharedTraces:
  """Exported programs by (share key, mesh shape, argument signature); thread-safe (the
  compile-ahead thread and the host loop may ask for one program at once: the second waits for
  the first's trace)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._traces: dict[Hashable, concurrent.futures.Future] = {}
    self._warned: set[str] = set()
    self.traced = 0  # programs traced and exported
    self.reused = 0  # programs lowered from another slice's trace

  def program(self, share: Hashable, fn: Callable, args: Sequence, donate_argnums,
              mesh: jax.sharding.Mesh, kind: str) -> Callable | None:
    """A function that calls `fn`'s exported trace for args (arrays or ShapeDtypeStructs with
    shardings on `mesh`), traced on the first mesh of this shape that asked for `share`; None
    where `fn` cannot be exported (the caller traces it itself; warned once per kind)."""
    key = (share, mesh.axis_names, tuple(mesh.devices.shape), signature(args))
    with self._lock:
      future = self._traces.get(key)
      first = future is None
      if first:
        future = self._traces[key] = concurrent.futures.Future()
    if first:
      exported = None
      try:
        with on_mesh(mesh):
          exported = export_program(fn, args, donate_argnums)
      except Exception as e:  # noqa: BLE001 -- the program still runs, traced per slice
        self._warn(kind, e)
      finally:  # even when interrupted: another thread may be waiting for this trace
        future.set_result(exported)
    exported = future.result()
    if exported is None:
      return None
    with self._lock:
      self.traced += first
      self.reused += not first
    return exported.call

  def _warn(self, kind: str, error: Exception) -> None:
    with self._lock:
      if kind in self._warned:
        return
      self._warned.add(kind)
    warnings.warn(f"{kind}: traced on every slice, because exporting its trace failed: "
                  f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                  RuntimeWarning, stacklevel=3)


def signature(args) -> tuple:
  """What a trace depends on in args besides the function: the tree's structure and each
  leaf's shape, dtype, partition spec and memory kind (not its devices); non-array leaves by
  value."""
  leaves, tree = jax.tree.flatten(args)

  def leaf(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return ("value", x)
    sharding = getattr(x, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return (tuple(x.shape), str(x.dtype), None if spec is None else tuple(spec),
            getattr(sharding, "memory_kind", None))
  return (tree, tuple(leaf(x) for x in leaves))
