"""Benchmark: Pallas prefix + tree attention (split-K where chosen) against the jnp reference;
with --numerics, whether this device computes the attention right at all.

Grid over batch size x prefix length x tree size (T verify tokens; default 1, 4, 16, 32 x 2k,
8k, 16k, 32k x 1, 8, 16, 48 = 64 points at the Qwen2.5-7B head shape: 28 query / 4 KV heads,
D = 128, bf16). Per point: the kernel and reference times (each a call's time on the device:
one program calls it --repeat times, see `repeated`; a call timed alone from Python also pays
its launch, about 0.1 ms on an H100, which a decode step does not), speedup_vs_reference, the
kernel's prefix splits, and the bandwidth (prefix K and V bytes / time) as a fraction of the
datasheet peak and of a large device-to-device copy measured once per run (what a streaming
kernel can reach). Each output is checked against the reference run in float32 on the host's
CPU (`check_point`), and the JSON records per point whether the kernel met each of TARGETS that
applies there. On CPU only the reference runs (interpret mode would time the interpreter).

--numerics: the reference attention (what prefill and training run) and on GPU the kernel, on
the default device, against the float32 reference on the host's CPU, at the shapes where on
one H100 with jax 0.11.2 (2026-11-26) XLA's default autotuning compiled the reference wrong
(batch 1, cache 8192, 2, 8, 9 or 12 new tokens: relative error about 1); the package's XLA
flags (tlt_jax/xla_flags.py) made it right. It runs with those flags and, in a second process,
with them turned off (does the installed jax still need them?), and exits 1 when the leg with
them is wrong. --quick uses toy shapes.

The JSON is rewritten after every grid point; --time-budget starts no point after the first
once that many seconds have passed since the script started. At the end a PNG (time and
bandwidth fraction vs prefix length, one column per T) and, with --write-crossovers, the
kernel-vs-reference table the `impl="auto"` dispatcher reads (merged into an existing file).

  python -m experiments.bench_tree_attention --out results/tree_attention.json \
      --time-budget 480 --write-crossovers tlt_jax/kernels/crossover.json
  python -m experiments.bench_tree_attention --quick --out /tmp/bt.json    # CPU smoke run
  python -m experiments.bench_tree_attention --numerics --out runs/numerics.json
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # --time-budget counts from here

import argparse
import functools
import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from tqdm import tqdm

from .profile_decode import median_ms
from .common import REPO, module_command, run_metadata, write_json
from tlt_jax import xla_flags
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.kernels import crossover
from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import (
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

FULL_GRID = dict(batches=(1, 4, 16, 32),
                 prefix_lens=(2048, 8192, 16384, 32768),
                 tree_sizes=(1, 8, 16, 48))
QUICK_GRID = dict(batches=(1, 2), prefix_lens=(1024, 2048), tree_sizes=(8, 16))
CPU_SKIP = "skipped: cpu: reference only"
# Max relative error of the kernel against the float32 reference (see `check_point`).
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}
COPY_BYTES = {"gpu": 1 << 30, "cpu": 64 << 20}
# What the kernel should reach. `where` bounds the points a target applies to: axis -> [min,
# max], None = unbounded; `metric` (a result field) must be >= `at_least` there.
TARGETS = (
    dict(name="bandwidth_batch1_long_prefix",
         where=dict(batch=[1, 1], prefix_len=[16384, None]),
         metric="kernel_bw_fraction_of_copy", at_least=0.5,
         why="one sequence verifying against a long cache is a stream over K/V"),
    dict(name="speedup_large_batch_tree_long_prefix",
         where=dict(batch=[16, None], tree_size=[16, None], prefix_len=[16384, None]),
         metric="speedup_vs_reference", at_least=3.0,
         why="the reference materialises B x H x T x S scores in HBM; the kernel does not"),
    dict(name="never_slower",
         where={},
         metric="speedup_vs_reference", at_least=1.0,
         why="impl='auto' should never lose by picking the kernel"),
)


def peak_hbm_bytes_per_s(device: jax.Device) -> float | None:
  if device.platform != "gpu":
    return None
  for name, peak in PEAK_HBM_BYTES_PER_S:
    if name in device.device_kind:
      return peak
  return None


def make_inputs(key, batch, prefix_len, t, heads, kv_heads, head_dim, dtype):
  """The largest point's inputs, drawn once: q [B, T, H, D], k/v cache [B, KVH, S, D] full
  (cache_lengths [B] == S), k/v new [B, T, KVH, D] and a causal (chain) draft tree [B, T, T]."""
  k = jax.random.split(key, 5)
  normal = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(dtype)  # noqa: E731
  return (normal(k[0], (batch, t, heads, head_dim)),
          normal(k[1], (batch, kv_heads, prefix_len, head_dim)),
          normal(k[2], (batch, kv_heads, prefix_len, head_dim)),
          jnp.full((batch,), prefix_len, jnp.int32),
          normal(k[3], (batch, t, kv_heads, head_dim)),
          normal(k[4], (batch, t, kv_heads, head_dim)),
          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def slice_inputs(base, batch, prefix_len, t):
  """One point's inputs cut from the largest ones (layout of `make_inputs`), in one program:
  drawing them per point would compile a random generator per point, slicing eagerly a
  program per slice."""
  q, kc, vc, _, kn, vn, _ = base
  return (q[:batch, :t], kc[:batch, :, :prefix_len], vc[:batch, :, :prefix_len],
          jnp.full((batch,), prefix_len, jnp.int32), kn[:batch, :t], vn[:batch, :t],
          jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (batch, t, t)))


def repeated(fn, repeat: int):
  """A jitted program that calls fn(*args) `repeat` times and returns the last output. Each
  call's first argument is shifted by a zero that XLA can only know from the previous call's
  whole output (1 if it held a NaN), so no call is hoisted, dropped or cut down to a slice.
  Its time / repeat is a call's time on the device without the launch from Python, which is
  most of the wall time of a call that reads a few MB (and which a decode step, one program
  over all layers, does not pay per attention)."""
  @jax.jit
  def run(*args):
    def body(_, carry):
      _, shift = carry
      out = fn(args[0] + shift, *args[1:])
      nan = jnp.isnan(jnp.sum(out.astype(jnp.float32)))
      return out, jnp.where(nan, 1, 0).astype(args[0].dtype)
    first = jax.eval_shape(fn, *args)
    carry = (jnp.zeros(first.shape, first.dtype), jnp.zeros((), args[0].dtype))
    return jax.lax.fori_loop(0, repeat, body, carry)[0]
  return run


def copy_bytes_per_s(nbytes: int, warmup: int, iters: int) -> float:
  """Measured device-to-device copy bandwidth of a bfloat16 buffer of nbytes: (read + write
  bytes) / time of x + 1, which XLA cannot elide the way it may elide a bare copy."""
  x, add = jnp.ones((nbytes // 2,), jnp.bfloat16), jax.jit(lambda a: a + 1)
  return 2 * nbytes / median_ms(lambda: jax.block_until_ready(add(x)), max(iters, 5), warmup) * 1e3


def bench_point(fn, args, warmup, iters, repeat, kv_bytes, ceilings):
  """Returns (ms per call on the device, bytes/s, {ceiling name: fraction of it or None},
  status, output or None), timing `repeated(fn, repeat)`."""
  program, last = repeated(fn, repeat), [None]  # the first of the warm-up calls compiles
  try:
    ms = median_ms(lambda: last.__setitem__(0, jax.block_until_ready(program(*args))), iters,
                   warmup)
    seconds, out = ms / 1e3 / repeat, last[0]
  except Exception as e:  # e.g. the reference running out of memory at batch 32 x 32k
    return None, None, {name: None for name in ceilings}, \
        f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}", None
  bw = kv_bytes / seconds
  fractions = {name: bw / c if c else None for name, c in ceilings.items()}
  return seconds * 1e3, bw, fractions, "ok", out


@jax.jit
def _reference32(*inputs):
  """The reference in float32 (run where its inputs live: on the host's CPU, see below)."""
  return prefix_tree_attention_reference(
      *(x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in inputs))


def check_point(inputs, out, rows):
  """Returns dict(rel_err, finite) of one output: max |out - ref32| / max |ref32| over `rows`
  (the first and last sequence, so a batch indexing mistake in the kernel shows up), ref32
  being the float32 reference computed on the host's CPU. Not on the device: on an H100 XLA
  once miscompiled the reference at some shapes (see tlt_jax/xla_flags.py), and a check on
  the device then failed the right kernel and passed the wrong reference."""
  if out is None:
    return dict(rel_err=None, finite=None)
  cpu = jax.devices("cpu")[0]
  picked = [jax.device_put(np.asarray(x[jnp.asarray(rows)]), cpu) for x in inputs]
  ref32 = np.asarray(_reference32(*picked))
  got = np.asarray(out[jnp.asarray(rows)].astype(jnp.float32))
  err = np.max(np.abs(got - ref32)) / max(float(np.max(np.abs(ref32))), 1e-30)
  return dict(rel_err=float(err), finite=bool(jnp.all(jnp.isfinite(out))))


def target_met(target: dict, r: dict) -> bool | None:
  """Whether result row r meets target (None: the kernel did not run here, as on CPU)."""
  if r["kernel_status"] == CPU_SKIP:
    return None
  if r["kernel_status"] != "ok" or not r["kernel_correct"]:
    return False
  value = r[target["metric"]]
  if value is None:
    # A speedup over a reference that failed (out of memory): the kernel is the only option.
    return target["metric"] == "speedup_vs_reference" and r["reference_status"] != "ok"
  return value >= target["at_least"]


def applies(target: dict, r: dict) -> bool:
  return all((lo is None or r[axis] >= lo) and (hi is None or r[axis] <= hi)
             for axis, (lo, hi) in target["where"].items())


def summarize_targets(results: list[dict]) -> dict:
  """Per target: the points it applies to, how many the kernel ran at and met, and whether
  all of those met it (None when the kernel ran at none)."""
  summary = {}
  for target in TARGETS:
    verdicts = [r["targets"][target["name"]] for r in results if target["name"] in r["targets"]]
    measured = [v for v in verdicts if v is not None]
    summary[target["name"]] = dict(points=len(verdicts), measured=len(measured),
                                   met=sum(measured), all_met=all(measured) if measured else None)
  return summary


def bench_grid_point(args, base, reference, kernel, ceilings, on_gpu, dtype, batch,
                     prefix_len, t) -> dict:
  """One result row: the reference (and on GPU the kernel) timed and checked at (B, S, T)."""
  inputs = slice_inputs(base, batch, prefix_len, t)
  kv_bytes = 2 * batch * args.kv_heads * prefix_len * args.head_dim * dtype.itemsize
  rows = tuple(sorted({0, batch - 1}))
  ref_ms, ref_bw, ref_frac, ref_status, ref_out = bench_point(
      reference, inputs, args.warmup, args.iters, args.repeat, kv_bytes, ceilings)
  ref_check = check_point(inputs, ref_out, rows)
  del ref_out
  plan = kernel_plan(inputs[0].shape, inputs[1].shape, dtype, block_k=args.block_k,
                     k_splits=args.k_splits)
  if on_gpu:
    ker_ms, ker_bw, ker_frac, ker_status, ker_out = bench_point(
        kernel, inputs, args.warmup, args.iters, args.repeat, kv_bytes, ceilings)
    ker_check = check_point(inputs, ker_out, rows)
    ker_correct = (ker_status == "ok" and ker_check["finite"]
                   and ker_check["rel_err"] <= TOLERANCE[args.dtype])
  else:
    ker_ms, ker_bw, ker_frac, ker_status = None, None, dict.fromkeys(ceilings), CPU_SKIP
    ker_check, ker_correct = check_point(inputs, None, rows), None
  row = dict(
      batch=batch, prefix_len=prefix_len, tree_size=t, kv_bytes=kv_bytes,
      k_splits=plan["k_splits"],
      grid_programs=(batch * args.kv_heads * plan["rows_pad"] // plan["block_rows"]
                     * plan["k_splits"]),
      reference_ms=ref_ms, reference_status=ref_status, reference_bytes_per_s=ref_bw,
      reference_bw_fraction=ref_frac["peak"], reference_bw_fraction_of_copy=ref_frac["copy"],
      reference_rel_err=ref_check["rel_err"], reference_finite=ref_check["finite"],
      kernel_ms=ker_ms, kernel_status=ker_status, kernel_bytes_per_s=ker_bw,
      kernel_bw_fraction=ker_frac["peak"], kernel_bw_fraction_of_copy=ker_frac["copy"],
      kernel_rel_err=ker_check["rel_err"], kernel_finite=ker_check["finite"],
      kernel_correct=ker_correct,
      speedup_vs_reference=(ref_ms / ker_ms) if ref_ms and ker_ms else None)
  row["targets"] = {g["name"]: target_met(g, row) for g in TARGETS if applies(g, row)}
  return row


def describe(r: dict) -> str:
  """One line of a result row for the log."""
  kernel_col = (f"{r['kernel_ms']:.3f} ms ({r['k_splits']} splits, "
                f"{r['kernel_bw_fraction_of_copy']:.0%} of copy bw, "
                f"err {r['kernel_rel_err']:.1e})" if r["kernel_ms"] is not None
                else r["kernel_status"])
  ref_col = (f"{r['reference_ms']:.3f} ms" if r["reference_ms"] is not None
             else r["reference_status"])
  missed = [name for name, met in r["targets"].items() if met is False]
  return (f"B={r['batch']:>3} S={r['prefix_len']:>6} T={r['tree_size']:>3}  "
          f"reference {ref_col}  kernel {kernel_col}"
          + (f"  missed: {', '.join(missed)}" if missed else ""))


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


# ---------------------------------------------------------------- --numerics

# (batch, cache length, new tokens): the H100 run's wrong and right shapes (module docstring).
NUMERICS_SHAPES = ([(1, 8192, t) for t in (1, 2, 4, 7, 8, 9, 12, 16, 48)]
                   + [(1, 16384, 8), (2, 8192, 8)])
NUMERICS_QUICK = dict(shapes=[(1, 64, 2), (2, 128, 8)], heads=4, kv_heads=2, head_dim=16)


def check_shapes(shapes, heads: dict, dtype=jnp.bfloat16) -> list[dict]:
  """Per (B, S, T): relative errors of the device's reference and (on GPU) kernel outputs
  against the host's float32 reference, over every sequence of the batch."""
  largest = [max(s[i] for s in shapes) for i in range(3)]
  base = make_inputs(jax.random.key(0), *largest, heads["heads"], heads["kv_heads"],
                     heads["head_dim"], dtype)
  reference = jax.jit(prefix_tree_attention_reference)
  on_gpu = jax.default_backend() == "gpu"
  rows = []
  for batch, prefix_len, t in shapes:
    inputs = slice_inputs(base, batch, prefix_len, t)
    every = tuple(range(batch))
    row = dict(batch=batch, prefix_len=prefix_len, tree_size=t,
               reference=check_point(inputs, reference(*inputs), every),
               kernel=(check_point(inputs, prefix_tree_attention_pallas(*inputs), every)
                       if on_gpu else None))
    row["right"] = all(c is None or (c["finite"] and c["rel_err"] <= TOLERANCE["bfloat16"])
                       for c in (row["reference"], row["kernel"]))
    rows.append(row)
    print(f"B={batch} S={prefix_len:>6} T={t:>2}  reference err {row['reference']['rel_err']:.1e}"
          + (f"  kernel err {row['kernel']['rel_err']:.1e}" if row["kernel"] else "")
          + ("" if row["right"] else "  WRONG"), flush=True)
  return rows


def flags_off() -> str:
  """This process's XLA_FLAGS with each of the package's flags set to false instead."""
  kept = [word for word in os.environ.get("XLA_FLAGS", "").split()
          if word.lstrip("-").split("=", 1)[0] not in xla_flags.FLAGS]
  return " ".join([*kept, *(f"--{name}=false" for name in xla_flags.FLAGS)])


def numerics(args) -> None:
  """--numerics: both legs (the second in a child process with the flags off), one JSON."""
  heads = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim)
  shapes = NUMERICS_SHAPES
  if args.quick:
    shapes, heads = NUMERICS_QUICK["shapes"], {k: NUMERICS_QUICK[k] for k in heads}
  print(f"--- {args.leg}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  rows = check_shapes(shapes, heads)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  if args.leg == "flags_off":
    write_json(args.out, rows)
    return
  child_out = args.out.with_suffix(".flags_off.tmp")
  argv_child = [*module_command("bench_tree_attention"), "--numerics", "--out", str(child_out),
                "--leg", "flags_off", *(["--quick"] if args.quick else [])]
  env = dict(os.environ, XLA_FLAGS=flags_off())
  done = subprocess.run(argv_child, env=env, cwd=REPO, timeout=600)
  off_rows = json.loads(child_out.read_text()) if done.returncode == 0 else None
  child_out.unlink(missing_ok=True)
  doc = dict(run_metadata(jax.devices()[0]), heads=heads, dtype="bfloat16",
             tolerance=TOLERANCE["bfloat16"],
             legs=dict(flags=dict(xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows),
                       flags_off=dict(xla_flags=env["XLA_FLAGS"], rows=off_rows,
                                      returncode=done.returncode)))
  doc["right_with_flags"] = all(r["right"] for r in rows)
  doc["right_without_flags"] = None if off_rows is None else all(r["right"] for r in off_rows)
  write_json(args.out, doc)
  print(f"right with the package's flags: {doc['right_with_flags']}; without them: "
        f"{doc['right_without_flags']}; wrote {args.out}")
  if not doc["right_with_flags"]:
    sys.exit(1)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  parser.add_argument("--quick", action="store_true",
                      help="tiny grid (with --numerics toy shapes) for CPU smoke runs")
  parser.add_argument("--numerics", action="store_true",
                      help="check the attention's numerics on this device (module docstring)")
  parser.add_argument("--leg", choices=("flags", "flags_off"), default="flags",
                      help=argparse.SUPPRESS)  # flags_off: the --numerics child process
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
  parser.add_argument("--repeat", type=int, default=20,
                      help="calls per timed program (see `repeated`); a point's time is the "
                           "median over --iters programs / repeat")
  parser.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                      help="start no grid point after the first once this many seconds have "
                           "passed since the script started (0 = no limit)")
  parser.add_argument("--write-crossovers", type=pathlib.Path, default=None, metavar="PATH",
                      help="merge this run's kernel-vs-reference table into PATH (GPU runs)")
  args = parser.parse_args(argv)
  if args.time_budget < 0:
    parser.error(f"--time-budget must be >= 0 seconds, got {args.time_budget}")
  for name in ("iters", "repeat"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  if args.numerics:
    return numerics(args)
  enable_compilation_cache()

  grid = dict(QUICK_GRID if args.quick else FULL_GRID)
  for name in ("batches", "prefix_lens", "tree_sizes"):
    if getattr(args, name):
      grid[name] = tuple(getattr(args, name))
  if args.quick:
    args.iters, args.repeat = min(args.iters, 3), min(args.repeat, 2)

  device = jax.devices()[0]
  on_gpu = jax.default_backend() == "gpu"
  copy_bytes = COPY_BYTES["gpu" if on_gpu else "cpu"]
  ceilings = dict(peak=peak_hbm_bytes_per_s(device),
                  copy=copy_bytes_per_s(copy_bytes, args.warmup, args.iters))
  dtype = jnp.dtype(args.dtype)
  reference = jax.jit(prefix_tree_attention_reference)
  kernel = jax.jit(functools.partial(prefix_tree_attention_pallas, block_k=args.block_k,
                                     k_splits=args.k_splits))

  config = dict(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                dtype=args.dtype, block_k=args.block_k, k_splits=args.k_splits or "auto",
                warmup=args.warmup, iters=args.iters, tolerance=TOLERANCE[args.dtype],
                repeat=args.repeat,
                timing="median over iters of the wall time of one program calling it repeat "
                       "times (block_until_ready included), / repeat",
                error="max |out - ref32| / max |ref32| over the first and last sequence",
                **grid)
  meta = run_metadata(device)
  meta["device"].update(num_sms=device_num_sms() if on_gpu else None,
                        peak_hbm_bytes_per_s=ceilings["peak"], copy_bytes=copy_bytes,
                        measured_copy_bytes_per_s=ceilings["copy"])
  results = []
  report = dict(**meta, config=config, targets=TARGETS, time_budget_s=args.time_budget or None,
                stopped_early=False, skipped_points=[], wall_s=None, target_summary=None,
                results=results)
  args.out.parent.mkdir(parents=True, exist_ok=True)

  def save():
    report.update(wall_s=time.perf_counter() - T0, target_summary=summarize_targets(results))
    write_json(args.out, report)

  save()  # the device and copy bandwidth, before any point
  base = jax.jit(make_inputs, static_argnums=(1, 2, 3, 4, 5, 6, 7))(
      jax.random.key(0), max(grid["batches"]), max(grid["prefix_lens"]),
      max(grid["tree_sizes"]), args.heads, args.kv_heads, args.head_dim, dtype)
  points = list(itertools.product(grid["batches"], grid["prefix_lens"], grid["tree_sizes"]))
  progress = tqdm(points, desc="tree attention")
  for i, (batch, prefix_len, t) in enumerate(progress):
    if i and args.time_budget and time.perf_counter() - T0 > args.time_budget:
      report.update(stopped_early=True, skipped_points=[list(p) for p in points[i:]])
      tqdm.write(f"time budget of {args.time_budget:.0f} s spent: {len(points) - i} of "
                 f"{len(points)} points skipped")
      break
    row = bench_grid_point(args, base, reference, kernel, ceilings, on_gpu, dtype, batch,
                           prefix_len, t)
    results.append(row)
    save()
    tqdm.write(describe(row))
  progress.close()
  save()

  png = args.out.with_suffix(".png")
  plot(results, png, f"prefix + tree attention, {device.device_kind}, {args.dtype}, "
                     f"H={args.heads} KVH={args.kv_heads} D={args.head_dim}")
  print(f"copy bandwidth {ceilings['copy'] / 1e9:.0f} GB/s; wrote {args.out} and {png}")
  for name, s in report["target_summary"].items():
    print(f"target {name}: met at {s['met']} of {s['measured']} measured points "
          f"({s['points']} in the grid)")
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
      write_json(path, crossover.merge_tables(doc, table))
      print(f"wrote crossover table for {device.device_kind} {args.dtype} to {path}")


if __name__ == "__main__":
  main()
