"""Benchmark: Pallas prefix + tree attention against the jnp reference.

Grid over batch size x prefix length x tree size (T verify tokens). For each point it reports
the kernel and reference times, their ratio, and the achieved bandwidth (bytes of prefix K and V
read / time) as a fraction of the device's peak HBM bandwidth -- verification at small batch is
memory-bound, so that fraction is the number that says how much is left on the table.

On CPU only the reference runs; kernel entries are marked skipped (interpret mode measures the
interpreter, not the kernel).

  python experiments/bench_tree_attention.py --out results/tree_attention.json
  python experiments/bench_tree_attention.py --quick --out /tmp/bt.json    # CPU smoke run

Writes the JSON and a PNG (time vs prefix length, one panel per T) next to it.
"""

from __future__ import annotations

import argparse
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
from tlt_jax.kernels.reference import prefix_tree_attention_reference  # noqa: E402
from tlt_jax.kernels.tree_attention_pallas import prefix_tree_attention_pallas  # noqa: E402

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
                 prefix_lens=(1024, 2048, 4096, 8192, 16384, 32768),
                 tree_sizes=(8, 16, 32, 64))
QUICK_GRID = dict(batches=(1, 2), prefix_lens=(1024, 2048), tree_sizes=(8, 16))
CPU_SKIP = "skipped: cpu: reference only"


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


def bench_point(fn, args, warmup, iters, kv_bytes, peak):
  """Returns (ms, fraction of peak bandwidth or None, status)."""
  try:
    seconds = median_seconds(fn, args, warmup, iters)
  except Exception as e:  # e.g. the reference running out of memory at batch 32 x 32k
    return None, None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  fraction = kv_bytes / seconds / peak if peak else None
  return seconds * 1e3, fraction, "ok"


def plot(results, path: pathlib.Path, title: str):
  tree_sizes = sorted({r["tree_size"] for r in results})
  batches = sorted({r["batch"] for r in results})
  fig, axes = plt.subplots(1, len(tree_sizes), figsize=(4.5 * len(tree_sizes), 4), squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, t in zip(axes[0], tree_sizes):
    for i, batch in enumerate(batches):
      rows = sorted((r for r in results if r["tree_size"] == t and r["batch"] == batch),
                    key=lambda r: r["prefix_len"])
      for key, style, label in (("kernel_ms", "-", "pallas"), ("reference_ms", "--", "ref")):
        pts = [(r["prefix_len"], r[key]) for r in rows if r[key] is not None]
        if pts:
          ax.plot(*zip(*pts), style, marker="o", ms=3, color=colors[i % len(colors)],
                  label=f"B={batch} {label}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix length")
    ax.set_ylabel("time (ms)")
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
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--iters", type=int, default=10)
  args = parser.parse_args(argv)
  enable_compilation_cache()

  grid = dict(QUICK_GRID if args.quick else FULL_GRID)
  for name in ("batches", "prefix_lens", "tree_sizes"):
    if getattr(args, name):
      grid[name] = tuple(getattr(args, name))
  if args.quick:
    args.iters = min(args.iters, 3)

  device = jax.devices()[0]
  peak = peak_hbm_bytes_per_s(device)
  on_gpu = jax.default_backend() == "gpu"
  dtype = jnp.dtype(args.dtype)
  reference = jax.jit(prefix_tree_attention_reference)
  kernel = jax.jit(lambda *a: prefix_tree_attention_pallas(*a, block_k=args.block_k))

  results = []
  points = list(itertools.product(grid["batches"], grid["prefix_lens"], grid["tree_sizes"]))
  for batch, prefix_len, t in tqdm(points, desc="tree attention"):
    inputs = make_inputs(jax.random.key(0), batch, prefix_len, t, args.heads, args.kv_heads,
                         args.head_dim, dtype)
    kv_bytes = 2 * batch * args.kv_heads * prefix_len * args.head_dim * dtype.itemsize
    ref_ms, ref_frac, ref_status = bench_point(reference, inputs, args.warmup, args.iters,
                                               kv_bytes, peak)
    if on_gpu:
      ker_ms, ker_frac, ker_status = bench_point(kernel, inputs, args.warmup, args.iters,
                                                 kv_bytes, peak)
    else:
      ker_ms, ker_frac, ker_status = None, None, CPU_SKIP
    results.append(dict(
        batch=batch, prefix_len=prefix_len, tree_size=t, kv_bytes=kv_bytes,
        reference_ms=ref_ms, reference_status=ref_status, reference_bw_fraction=ref_frac,
        kernel_ms=ker_ms, kernel_status=ker_status, kernel_bw_fraction=ker_frac,
        speedup_vs_reference=(ref_ms / ker_ms) if ref_ms and ker_ms else None))
    del inputs

  report = dict(
      device=dict(platform=device.platform, device_kind=device.device_kind,
                  peak_hbm_bytes_per_s=peak),
      jax_version=jax.__version__,
      config=dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype, block_k=args.block_k, warmup=args.warmup, iters=args.iters,
                  timing="median wall time of jitted call incl. block_until_ready", **grid),
      results=results)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(json.dumps(report, indent=2))
  png = args.out.with_suffix(".png")
  plot(results, png, f"prefix + tree attention, {device.device_kind}, {args.dtype}, "
                     f"H={args.heads} KVH={args.kv_heads} D={args.head_dim}")

  for r in results:
    kernel_col = f"{r['kernel_ms']:.3f} ms" if r["kernel_ms"] is not None else r["kernel_status"]
    ref_col = (f"{r['reference_ms']:.3f} ms" if r["reference_ms"] is not None
               else r["reference_status"])
    print(f"B={r['batch']:>3} S={r['prefix_len']:>6} T={r['tree_size']:>3}  "
          f"reference {ref_col}  kernel {kernel_col}")
  print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
  main()
