"""XLA flags every tlt_jax process runs with, added to `XLA_FLAGS` when the package is imported.

`--xla_gpu_exclude_nondeterministic_ops=true`: on one H100 with jax 0.11.2 (2026-11-26), the
jnp reference attention (`kernels.reference`), compiled by XLA with its default autotuning,
returned wrong values at some shapes: batch 1, 28 query / 4 KV heads of dim 128, a cache of
8192 slots and 2 or 8 new tokens (relative error 1.20-1.25 against the same function on the
CPU; with 9 or 12 it disagreed as much with the Pallas kernel), while 4, 7 and 16 new tokens,
or batch 2, were right. The kernel was right where it was checked against the CPU. This
flag (or `--xla_gpu_deterministic_ops=true`, or turning autotuning off) made the result right;
`--xla_gpu_enable_triton_gemm=false` did not. The reference attention
is what prefill and every training step run on GPU, so without it a GPU run could train on
wrong attention without any error. `python -m experiments.bench_tree_attention --numerics`
repeats the check.

`--xla_allow_excess_precision=false`: XLA may otherwise keep a bfloat16 (or float16) value in
float32 between two fused operations instead of rounding it, so a value's bits depend on
where XLA draws its fusions: the same layers run as a loop and as a `lax.scan` gave other
bfloat16 logits (CPU, jax 0.10.2). With it, every rounding the code writes happens, which
the shape-invariant numerics (`tlt_jax.kernels.numerics`) need; float32 programs do not change.

A setting of the same flag already in `XLA_FLAGS` wins (`...=false` turns this off). XLA
reads `XLA_FLAGS` when JAX starts its first backend, so the package must be imported before
anything runs on the GPU; `apply` warns when it was not.
"""

from __future__ import annotations

import logging
import os

# flag name (without the leading --) -> value
FLAGS = {"xla_gpu_exclude_nondeterministic_ops": "true", "xla_allow_excess_precision": "false"}


def with_flags(xla_flags: str, flags: dict[str, str] = FLAGS) -> str:
  """`xla_flags` (an XLA_FLAGS string) plus each of `flags` that it does not set already."""
  given = {word.lstrip("-").split("=", 1)[0] for word in xla_flags.split()}
  added = [f"--{name}={value}" for name, value in flags.items() if name not in given]
  return " ".join([xla_flags.strip(), *added]).strip()


def _gpu_backend_started() -> bool:
  """Whether this process already started a JAX GPU backend (XLA_FLAGS then come too late)."""
  try:
    from jax._src import xla_bridge
  except ImportError:  # pragma: no cover - depends on the installed jax
    return False
  return any(name in ("cuda", "rocm", "gpu") for name in getattr(xla_bridge, "_backends", {}))


def apply(environ=os.environ) -> str:
  """Adds `FLAGS` to environ['XLA_FLAGS'] and returns the new value. Warns when a JAX GPU
  backend already started in this process, so that the flags do not reach it."""
  before = environ.get("XLA_FLAGS", "")
  environ["XLA_FLAGS"] = with_flags(before)
  if environ["XLA_FLAGS"] != before and _gpu_backend_started():
    logging.getLogger(__name__).warning(
        "a JAX GPU backend started before tlt_jax was imported, so XLA_FLAGS=%r does not "
        "apply to it and XLA may miscompile the reference attention (see tlt_jax/xla_flags.py):"
        " import tlt_jax first, or set XLA_FLAGS before starting Python",
        environ["XLA_FLAGS"])
  return environ["XLA_FLAGS"]
