"""Benchmark: Pallas prefix + tree attention (split-K where chosen) against the jnp reference.

Grid over batch size x prefix length x tree size (T verify tokens). For each point it reports
the kernel and reference times, their ratio, the kernel's number of prefix splits, and the
achieved bandwidth (bytes of prefix K and V read / time) as a fraction of two ceilings: the
device's datasheet peak HBM bandwidth, and the bandwidth of a large device-to-device copy
measured by this script (x + 1 over a 1 GiB buffer: read + write bytes / time), which is what
a streaming kernel can actually reach. Verification at small batch is memory-bound, so those
fractions say how much is left on the table.

Every GPU point is also checked: the kernel's output must be finite everywhere, and its relative
error (max |kernel - ref32| / max |ref32|) against the reference run in float32 on the first and
last sequence must stay within the dtype's tolerance. The bf16 reference's own error is recorded
next to it as the baseline.

On CPU only the reference runs; kernel entries are marked skipped (interpret mode measures the
interpreter, not the kernel).

The default grid (6 batches x 4 prefix lengths x 4 tree sizes = 96 points, 2 warmup + 10 timed
calls each) is sized for an 8-minute budget on one H100; the JSON records the run's wall_s.
Compiles dominate, so the grid has two prefix lengths fewer than a full power-of-two sweep,
inputs are sliced from one random draw instead of being drawn (and compiled) per point, and the
float32 check compiles once per (S, T) instead of per point. Use --iters / --batches /
--prefix-lens / --tree-sizes to shrink it further, and --k-splits 1 for an unsplit-kernel run to
compare against.

  python experiments/bench_tree_attention.py --out results/tree_attention.json \
      --write-crossovers tlt_jax/kernels/crossover.json
  python experiments/bench_tree_attention.py --quick --out /tmp/bt.json    # CPU smoke run

Writes the JSON and a PNG (time and bandwidth fraction vs prefix length, one column per T) next
to it; with --write-crossovers also the kernel-vs-reference crossover table the `impl="auto"`
dispatcher reads (merged into an existing file: the table for this device kind and dtype is
replaced).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import pathlib
import statistics
import sys
import time

# Runnable as a plain script from the repository root without installing the package.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tqdm import tqdm  # noqa: E402

from tlt_jax.compile_cache import enable_compilation_cache  # noqa: E402
from tlt_jax.kernels import crossover  # noqa: E402
from tlt_jax.kernels.reference import prefix_tree_attention_reference  # noqa: E402
from tlt_jax.kernels.tree_attention_pallas import (  # noqa: E402
    device_num_sms, kernel_plan, prefix_tree_attention_pallas)

# Peak HBM bandwidth in bytes/s by substring of `device_kind`; first match wins, so the more
# specific names come first. Datasheet numbers (SXM parts unless named).
PEAK_HBM_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100", 1.555e12),
)

FULL_GRID = dict(batches=(1, 2, 4, 8, 16, 32),
                 prefix_lens=(1024, 4096, 16384, 32768),
                 tree_sizes=(1, 8, 32, 64))
QUICK_GRID = dict(batches=(1, 2), prefix_lens=(1024, 2048), tree_sizes=(8, 16))
CPU_SKIP = "skipped: cpu: reference only"
# Max relative error of the kernel against the float32 reference (see `check_point`).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
COPY_BYTES = {"gpu": 1 << 30, "cpu": 64 << 20}


def peak_hbm_bytes_per_s(device: jax.Device) -> float | None:
  if device.platform != "gpu":
    return None
  for name, peak in PEAK_HBM_BYTES_PER_S:
    if name in device.device_kind:
      return peak
  return None


def make_inputs(key, batch, prefix_len, t, heads, kv_heads, head_dim, dtype):
  """Full-length prefixes (cache_lengths == S) and a causal (chain) draft tree."""
  k = jax.random.split(key, 5)
  normal = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(dtype)  # noqa: E731
  return (normal(k[0], (batch, t, heads, head_dim)),
          normal(k[1], (batch, kv_heads, prefix_len, head_dim)),
          normal(k[2], (batch, kv_heads, prefix_len, head_dim)),
          jnp.full((batch,), prefix_len, jnp.int32),
          normal(k[3], (batch, t, kv_heads, head_dim)),
          normal(k[4], (batch, t, kv_heads, head_dim)),
          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t)))


def slice_inputs(base, batch, prefix_len, t):
  """Inputs of one grid point cut from the largest ones (same layout as `make_inputs`)."""
  q, kc, vc, _, kn, vn, _ = base
  return (q[:batch, :t], kc[:batch, :, :prefix_len], vc[:batch, :, :prefix_len],
          jnp.full((batch,), prefix_len, jnp.int32), kn[:batch, :t], vn[:batch, :t],
          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t)))


def median_seconds(fn, args, warmup: int, iters: int) -> float:
  """Median wall time of fn(*args) after `warmup` calls (the first one compiles)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def copy_bytes_per_s(nbytes: int, warmup: int, iters: int) -> float:
  """Measured device-to-device copy bandwidth: (read + write bytes) / time of x + 1."""
  x = jnp.ones((nbytes // 4,), jnp.float32)
  seconds = median_seconds(jax.jit(lambda a: a + 1.0), (x,), warmup, max(iters, 5))
  return 2 * nbytes / seconds


def bench_point(fn, args, warmup, iters, kv_bytes, ceilings):
  """Returns (ms, {ceiling name: fraction of it or None}, status, output or None)."""
  try:
    seconds = median_seconds(fn, args, warmup, iters)
    out = fn(*args)
  except Exception as e:  # e.g. the reference running out of memory at batch 32 x 32k
    return None, {name: None for name in ceilings}, \
        f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}", None
  fractions = {name: kv_bytes / seconds / c if c else None for name, c in ceilings.items()}
  return seconds * 1e3, fractions, "ok", out


@functools.partial(jax.jit, static_argnames=("rows",))
def _check_rows(out, ref32, rows):
  """(max relative error over `rows` against ref32, whether every element of out is finite)."""
  picked = out[jnp.asarray(rows)].astype(jnp.float32)
  err = jnp.max(jnp.abs(picked - ref32)) / jnp.maximum(jnp.max(jnp.abs(ref32)), 1e-30)
  return err, jnp.all(jnp.isfinite(out))


def check_point(out, ref32, rows):
  """Returns dict(rel_err, finite) of one output against the float32 reference of `rows`."""
  if out is None:
    return dict(rel_err=None, finite=None)
  err, finite = _check_rows(out, ref32, rows)
  return dict(rel_err=float(err), finite=bool(finite))


def plot(results, path: pathlib.Path, title: str):
  tree_sizes = sorted({r["tree_size"] for r in results})
  batches = sorted({r["batch"] for r in results})
  fig, axes = plt.subplots(2, len(tree_sizes), figsize=(4.5 * len(tree_sizes), 7.5),
                           squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  panels = (("ms", "time (ms)", "log"),
            ("bw_fraction_of_copy", "prefix KV bandwidth / copy bandwidth", "linear"))
  for row, (suffix, ylabel, yscale) in enumerate(panels):
    for ax, t in zip(axes[row], tree_sizes):
      for i, batch in enumerate(batches):
        points = sorted((r for r in results if r["tree_size"] == t and r["batch"] == batch),
                        key=lambda r: r["prefix_len"])
        for impl, style, label in (("kernel", "-", "pallas"), ("reference", "--", "ref")):
          pts = [(r["prefix_len"], r[f"{impl}_{suffix}"]) for r in points
                 if r[f"{impl}_{suffix}"] is not None]
          if pts:
            ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[i % len(colors)],
                    label=f"B={batch} {label}")
      ax.set_xscale("log", base=2)
      ax.set_yscale(yscale)
      ax.set_xlabel("prefix length")
      ax.set_ylabel(ylabel)
      ax.set_title(f"T={t}")
      ax.grid(True, which="both", alpha=0.3)
  axes[0][-1].legend(fontsize=7, ncol=2)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  parser.add_argument("--quick", action="store_true", help="tiny grid for CPU smoke runs")
  parser.add_argument("--batches", type=int, nargs="+")
  parser.add_argument("--prefix-lens", type=int, nargs="+")
  parser.add_argument("--tree-sizes", type=int, nargs="+")
  # Default head layout: Qwen2.5-7B (28 query heads, 4 KV heads, head dim 128).
  parser.add_argument("--heads", type=int, default=28)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--block-k", type=int, default=64)
  parser.add_argument("--k-splits", type=int, default=None,
                      help="force this many prefix splits (default: the kernel's split rule)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--iters", type=int, default=10)
  parser.add_argument("--write-crossovers", type=pathlib.Path, default=None, metavar="PATH",
                      help="merge this run's kernel-vs-reference table into PATH (GPU runs)")
  args = parser.parse_args(argv)
  enable_compilation_cache()
  start_time = time.perf_counter()

  grid = dict(QUICK_GRID if args.quick else FULL_GRID)
  for name in ("batches", "prefix_lens", "tree_sizes"):
    if getattr(args, name):
      grid[name] = tuple(getattr(args, name))
  if args.quick:
    args.iters = min(args.iters, 3)

  device = jax.devices()[0]
  on_gpu = jax.default_backend() == "gpu"
  ceilings = dict(peak=peak_hbm_bytes_per_s(device),
                  copy=copy_bytes_per_s(COPY_BYTES["gpu" if on_gpu else "cpu"], args.warmup,
                                        args.iters))
  dtype = jnp.dtype(args.dtype)
  reference = jax.jit(prefix_tree_attention_reference)
  kernel = jax.jit(functools.partial(prefix_tree_attention_pallas, block_k=args.block_k,
                                     k_splits=args.k_splits))

  base = make_inputs(jax.random.key(0), max(grid["batches"]), max(grid["prefix_lens"]),
                     max(grid["tree_sizes"]), args.heads, args.kv_heads, args.head_dim, dtype)
  results = []
  points = list(itertools.product(grid["batches"], grid["prefix_lens"], grid["tree_sizes"]))
  for batch, prefix_len, t in tqdm(points, desc="tree attention"):
    inputs = slice_inputs(base, batch, prefix_len, t)
    kv_bytes = 2 * batch * args.kv_heads * prefix_len * args.head_dim * dtype.itemsize
    # The float32 reference of the first and last sequence: one compile per (S, T), and a batch
    # indexing mistake in the kernel shows up in the last one.
    rows = tuple(sorted({0, batch - 1}))
    ref32 = reference(*(x[jnp.asarray(rows)].astype(jnp.float32) if x.dtype == dtype
                        else x[jnp.asarray(rows)] for x in inputs))
    ref_ms, ref_frac, ref_status, ref_out = bench_point(reference, inputs, args.warmup,
                                                        args.iters, kv_bytes, ceilings)
    ref_check = check_point(ref_out, ref32, rows)
    plan = kernel_plan(inputs[0].shape, inputs[1].shape, dtype, block_k=args.block_k,
                       k_splits=args.k_splits)
    if on_gpu:
      ker_ms, ker_frac, ker_status, ker_out = bench_point(kernel, inputs, args.warmup,
                                                          args.iters, kv_bytes, ceilings)
      ker_check = check_point(ker_out, ref32, rows)
      ker_correct = (ker_status == "ok" and ker_check["finite"]
                     and ker_check["rel_err"] <= TOLERANCE[args.dtype])
    else:
      ker_ms, ker_frac, ker_status = None, dict.fromkeys(ceilings), CPU_SKIP
      ker_check, ker_correct = check_point(None, None, rows), None
    results.append(dict(
        batch=batch, prefix_len=prefix_len, tree_size=t, kv_bytes=kv_bytes,
        k_splits=plan["k_splits"],
        grid_programs=(batch * args.kv_heads * plan["rows_pad"] // plan["block_rows"]
                       * plan["k_splits"]),
        reference_ms=ref_ms, reference_status=ref_status,
        reference_bw_fraction=ref_frac["peak"], reference_bw_fraction_of_copy=ref_frac["copy"],
        reference_rel_err=ref_check["rel_err"], reference_finite=ref_check["finite"],
        kernel_ms=ker_ms, kernel_status=ker_status,
        kernel_bw_fraction=ker_frac["peak"], kernel_bw_fraction_of_copy=ker_frac["copy"],
        kernel_rel_err=ker_check["rel_err"], kernel_finite=ker_check["finite"],
        kernel_correct=ker_correct,
        speedup_vs_reference=(ref_ms / ker_ms) if ref_ms and ker_ms else None))
    del inputs, ref32, ref_out

  config = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                dtype=args.dtype, block_k=args.block_k, k_splits=args.k_splits or "auto",
                warmup=args.warmup, iters=args.iters, tolerance=TOLERANCE[args.dtype],
                timing="median wall time of jitted call incl. block_until_ready",
                error="max |out - ref32| / max |ref32| over the first and last sequence",
                **grid)
  report = dict(
      device=dict(platform=device.platform, device_kind=device.device_kind,
                  num_sms=device_num_sms() if on_gpu else None,
                  peak_hbm_bytes_per_s=ceilings["peak"],
                  measured_copy_bytes_per_s=ceilings["copy"]),
      jax_version=jax.__version__,
      config=config,
      wall_s=time.perf_counter() - start_time,
      results=results)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2))
  png = args.out.with_suffix(".png")
  plot(results, png, f"prefix + tree attention, {device.device_kind}, {args.dtype}, "
                     f"H={args.heads} KVH={args.kv_heads} D={args.head_dim}")

  for r in results:
    kernel_col = (f"{r['kernel_ms']:.3f} ms ({r['k_splits']} splits, "
                  f"{r['kernel_bw_fraction_of_copy']:.0%} of copy bw, "
                  f"err {r['kernel_rel_err']:.1e})" if r["kernel_ms"] is not None
                  else r["kernel_status"])
    ref_col = (f"{r['reference_ms']:.3f} ms" if r["reference_ms"] is not None
               else r["reference_status"])
    print(f"B={r['batch']:>3} S={r['prefix_len']:>6} T={r['tree_size']:>3}  "
          f"reference {ref_col}  kernel {kernel_col}")
  print(f"copy bandwidth {ceilings['copy'] / 1e9:.0f} GB/s; wrote {args.out} and {png}")
  if any(r["kernel_correct"] is False for r in results):
    print("WARNING: kernel output failed the correctness check at some points (kernel_correct)")

  if args.write_crossovers:
    table = crossover.table_from_results(
        results, device.device_kind, args.dtype,
        source=dict(config, jax_version=jax.__version__, benchmark=args.out.name))
    if not table["entries"]:
      print(f"no kernel measurements on {device.platform}: {args.write_crossovers} not written")
    else:
      path = args.write_crossovers
      doc = json.loads(path.read_text()) if path.exists() else None
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(crossover.merge_tables(doc, table), indent=2) + "\n")
      print(f"wrote crossover table for {device.device_kind} {args.dtype} to {path}")


if __name__ == "__main__":
  main()
