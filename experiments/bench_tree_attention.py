"""Benchmark: Pallas prefix + tree attention (split-K where chosen) against the jnp reference;
with --numerics, whether this device computes the attention right at all.

Grid over batch size x prefix length x tree size (T verify tokens) at the Qwen2.5-7B head
shape (HEADS), bf16; docs/reproducing.md lists what a point records. Times are a call's time on
the device (`repeated`), outputs are checked on the host's CPU (`check_point`); on CPU only
the reference runs (interpret mode would time the interpreter). The JSON is rewritten after
every point; at the end a PNG (time and bandwidth fraction vs prefix length, one column per T)
and, with --write-crossovers, the table the `impl="auto"` dispatcher reads (merged into PATH).

--numerics: the reference attention (what prefill and training run) and on GPU the kernel,
against the host's float32 reference at the shapes where XLA once compiled it wrong
(tlt_jax/xla_flags.py), with the package's XLA flags and, in a second process, without them
(does the installed jax still need them?); exits 1 when it is wrong with them.

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
import numpy as np
from tqdm import tqdm

from .common import (REPO, median_ms, module_command, pyplot, run_metadata, save_figure,
                     write_json)
from tlt_jax import xla_flags
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.kernels import crossover
from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import (
    device_num_sms, kernel_plan, prefix_tree_attention_pallas)

# Peak HBM bandwidth in bytes/s by substring of `device_kind`; first match wins, so the more
# specific names come first. Datasheet numbers (SXM parts unless named).
PEAK_HBM_BYTES_PER_S = (("H200", 4.8e12), ("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12),
                        ("H100", 3.35e12), ("A100-SXM4-80GB", 2.039e12), ("A100", 1.555e12))

FULL_GRID = dict(batches=(1, 4, 16, 32), prefix_lens=(2048, 8192, 16384, 32768),
                 tree_sizes=(1, 8, 16, 48))
QUICK_GRID = dict(batches=(1, 2), prefix_lens=(1024, 2048), tree_sizes=(8, 16))
# Qwen2.5-7B's attention: 28 query heads, 4 KV heads, head dim 128; bfloat16 K/V blocks of 64.
HEADS, DTYPE, BLOCK_K = dict(heads=28, kv_heads=4, head_dim=128), jnp.dtype("bfloat16"), 64
WARMUP, ITERS = 2, 10  # per point: warm-up programs, then the timed ones (--quick: 3)
CPU_SKIP = "skipped: cpu: reference only"
TOLERANCE = 2e-2  # max relative error of a bfloat16 output against the float32 reference
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


def make_inputs(key, batch, prefix_len, t, heads, kv_heads, head_dim, dtype):
  """The largest point's random inputs, drawn once: q [B, T, H, D], k/v cache [B, KVH, S, D]
  and k/v new [B, T, KVH, D] (`slice_inputs` cuts a point's from them)."""
  k = jax.random.split(key, 5)
  normal = lambda kk, shape: jax.random.normal(kk, shape, jnp.float32).astype(dtype)  # noqa: E731
  return (normal(k[0], (batch, t, heads, head_dim)),
          normal(k[1], (batch, kv_heads, prefix_len, head_dim)),
          normal(k[2], (batch, kv_heads, prefix_len, head_dim)),
          normal(k[3], (batch, t, kv_heads, head_dim)),
          normal(k[4], (batch, t, kv_heads, head_dim)))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def slice_inputs(base, batch, prefix_len, t):
  """One point's attention arguments cut from `make_inputs`' in one program (drawing them per
  point would compile a random generator per point, slicing eagerly a program per slice): the
  cache full (cache_lengths [B] == S) and a causal (chain) draft tree [B, T, T]."""
  q, kc, vc, kn, vn = base
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


def measure(impl: str, fn, inputs, rows, args, kv_bytes: int, ceilings: dict) -> dict:
  """A result row's `impl`_* fields: ms per call on the device (timing `repeated(fn,
  args.repeat)`), bytes/s and its fractions of the ceilings, status, and the output's check
  (`check_point`). fn None: not run (the kernel on CPU)."""
  ms, status, last = None, CPU_SKIP, [None]
  if fn is not None:
    program = repeated(fn, args.repeat)  # the first of the warm-up calls compiles
    try:
      ms = median_ms(lambda: last.__setitem__(0, jax.block_until_ready(program(*inputs))),
                     args.iters, WARMUP) / args.repeat
      status = "ok"
    except Exception as e:  # e.g. the reference running out of memory at batch 32 x 32k
      last[0], status = None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  bw = kv_bytes / ms * 1e3 if ms else None
  check = check_point(inputs, last[0], rows)
  return {f"{impl}_ms": ms, f"{impl}_status": status, f"{impl}_bytes_per_s": bw,
          f"{impl}_bw_fraction": bw / ceilings["peak"] if bw and ceilings["peak"] else None,
          f"{impl}_bw_fraction_of_copy": bw / ceilings["copy"] if bw else None,
          f"{impl}_rel_err": check["rel_err"], f"{impl}_finite": check["finite"]}


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


def bench_grid_point(args, base, reference, kernel, ceilings, batch, prefix_len, t) -> dict:
  """One result row: the reference (and with a kernel, on GPU, the kernel) timed and checked
  at (B, S, T)."""
  inputs = slice_inputs(base, batch, prefix_len, t)
  kv_bytes = 2 * batch * HEADS["kv_heads"] * prefix_len * HEADS["head_dim"] * DTYPE.itemsize
  rows = tuple(sorted({0, batch - 1}))
  plan = kernel_plan(inputs[0].shape, inputs[1].shape, DTYPE, block_k=BLOCK_K,
                     k_splits=args.k_splits)
  row = dict(batch=batch, prefix_len=prefix_len, tree_size=t, kv_bytes=kv_bytes,
             k_splits=plan["k_splits"],
             grid_programs=(batch * HEADS["kv_heads"] * plan["rows_pad"] // plan["block_rows"]
                            * plan["k_splits"]),
             **measure("reference", reference, inputs, rows, args, kv_bytes, ceilings),
             **measure("kernel", kernel, inputs, rows, args, kv_bytes, ceilings))
  row["kernel_correct"] = None if kernel is None else bool(
      row["kernel_status"] == "ok" and row["kernel_finite"]
      and row["kernel_rel_err"] <= TOLERANCE)
  ref_ms, ker_ms = row["reference_ms"], row["kernel_ms"]
  row["speedup_vs_reference"] = ref_ms / ker_ms if ref_ms and ker_ms else None
  row["targets"] = {g["name"]: target_met(g, row) for g in TARGETS if applies(g, row)}
  return row


def describe(r: dict) -> str:
  """One line of a result row for the log."""
  ref = f"{r['reference_ms']:.3f} ms" if r["reference_ms"] is not None else r["reference_status"]
  kernel = (f"{r['kernel_ms']:.3f} ms ({r['k_splits']} splits, "
            f"{r['kernel_bw_fraction_of_copy']:.0%} of copy bw, err {r['kernel_rel_err']:.1e})"
            if r["kernel_ms"] is not None else r["kernel_status"])
  missed = [name for name, met in r["targets"].items() if met is False]
  return (f"B={r['batch']:>3} S={r['prefix_len']:>6} T={r['tree_size']:>3}  reference {ref}  "
          f"kernel {kernel}" + (f"  missed: {', '.join(missed)}" if missed else ""))


def plot(results, path: pathlib.Path, title: str):
  plt = pyplot()
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
      ax.set(yscale=yscale, xlabel="prefix length", ylabel=ylabel, title=f"T={t}")
      ax.set_xscale("log", base=2)
      ax.grid(True, which="both", alpha=0.3)
  axes[0][-1].legend(fontsize=7, ncol=2)
  fig.suptitle(title)
  save_figure(fig, path, dpi=120)


# ---------------------------------------------------------------- --numerics

# (batch, cache length, new tokens): the H100 run's wrong and right shapes (tlt_jax/xla_flags.py).
NUMERICS_SHAPES = ([(1, 8192, t) for t in (1, 2, 4, 7, 8, 9, 12, 16, 48)]
                   + [(1, 16384, 8), (2, 8192, 8)])
NUMERICS_QUICK = ([(1, 64, 2), (2, 128, 8)], dict(heads=4, kv_heads=2, head_dim=16))


def check_shapes(shapes, heads: dict) -> list[dict]:
  """Per (B, S, T): relative errors of the device's reference and (on GPU) kernel outputs
  against the host's float32 reference, over every sequence of the batch."""
  largest = [max(s[i] for s in shapes) for i in range(3)]
  base = make_inputs(jax.random.key(0), *largest, *heads.values(), DTYPE)
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
    row["right"] = all(c is None or (c["finite"] and c["rel_err"] <= TOLERANCE)
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
  shapes, heads = NUMERICS_QUICK if args.quick else (NUMERICS_SHAPES, HEADS)
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
  doc = dict(run_metadata(jax.devices()[0]), heads=heads, dtype=DTYPE.name, tolerance=TOLERANCE,
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
  parser.add_argument("--k-splits", type=int, default=None,
                      help="force this many prefix splits (default: the kernel's split rule)")
  parser.add_argument("--repeat", type=int, default=20,
                      help="calls per timed program (see `repeated`); a point's time is the "
                           "median over ITERS programs / repeat")
  parser.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                      help="start no grid point after the first once this many seconds have "
                           "passed since the script started (0 = no limit)")
  parser.add_argument("--write-crossovers", type=pathlib.Path, default=None, metavar="PATH",
                      help="merge this run's kernel-vs-reference table into PATH (GPU runs)")
  args = parser.parse_args(argv)
  if args.time_budget < 0 or args.repeat < 1:
    parser.error(f"--time-budget must be >= 0 and --repeat >= 1, got {args.time_budget} and "
                 f"{args.repeat}")
  if args.numerics:
    return numerics(args)
  enable_compilation_cache()

  grid = {name: tuple(getattr(args, name) or default)
          for name, default in (QUICK_GRID if args.quick else FULL_GRID).items()}
  args.iters = 3 if args.quick else ITERS
  args.repeat = min(args.repeat, 2) if args.quick else args.repeat

  device = jax.devices()[0]
  on_gpu = jax.default_backend() == "gpu"
  copy_bytes = (1 << 30) if on_gpu else (64 << 20)  # a copy long enough to reach the peak
  peak = next((p for name, p in PEAK_HBM_BYTES_PER_S if name in device.device_kind), None)
  ceilings = dict(peak=peak if on_gpu else None,
                  copy=copy_bytes_per_s(copy_bytes, WARMUP, args.iters))
  reference = jax.jit(prefix_tree_attention_reference)
  kernel = jax.jit(functools.partial(prefix_tree_attention_pallas, block_k=BLOCK_K,
                                     k_splits=args.k_splits)) if on_gpu else None

  config = dict(**HEADS, dtype=DTYPE.name, block_k=BLOCK_K, k_splits=args.k_splits or "auto",
                warmup=WARMUP, iters=args.iters, tolerance=TOLERANCE, repeat=args.repeat,
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
      max(grid["tree_sizes"]), *HEADS.values(), DTYPE)
  points = list(itertools.product(grid["batches"], grid["prefix_lens"], grid["tree_sizes"]))
  progress = tqdm(points, desc="tree attention")
  for i, (batch, prefix_len, t) in enumerate(progress):
    if i and args.time_budget and time.perf_counter() - T0 > args.time_budget:
      report.update(stopped_early=True, skipped_points=[list(p) for p in points[i:]])
      tqdm.write(f"time budget of {args.time_budget:.0f} s spent: {len(points) - i} of "
                 f"{len(points)} points skipped")
      break
    results.append(bench_grid_point(args, base, reference, kernel, ceilings, batch,
                                    prefix_len, t))
    save()
    tqdm.write(describe(results[-1]))
  progress.close()
  save()

  png = args.out.with_suffix(".png")
  plot(results, png, f"prefix + tree attention, {device.device_kind}, {DTYPE.name}, "
                     "H={heads} KVH={kv_heads} D={head_dim}".format(**HEADS))
  print(f"copy bandwidth {ceilings['copy'] / 1e9:.0f} GB/s; wrote {args.out} and {png}")
  for name, s in report["target_summary"].items():
    print(f"target {name}: met at {s['met']} of {s['measured']} measured points "
          f"({s['points']} in the grid)")
  if any(r["kernel_correct"] is False for r in results):
    print("WARNING: kernel output failed the correctness check at some points (kernel_correct)")
  if args.write_crossovers:
    table = crossover.table_from_results(
        results, device.device_kind, config["dtype"],
        source=dict(config, jax_version=jax.__version__, benchmark=args.out.name))
    path = args.write_crossovers
    if not table["entries"]:
      print(f"no kernel measurements on {device.platform}: {path} not written")
      return
    doc = json.loads(path.read_text()) if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, crossover.merge_tables(doc, table))
    print(f"wrote crossover table for {device.device_kind} {config['dtype']} to {path}")


if __name__ == "__main__":
  main()
