"""Does this device compute the attention right? The reference attention (what prefill and
training run) and the Pallas kernel, on the default device, against the float32 reference on
the host's CPU, with the XLA flags the package sets (tlt_jax/xla_flags.py) and, in a second
process, with those flags turned off.

On one H100 with jax 0.11.2 (2026-11-26), XLA's default autotuning compiled the reference
wrong at batch 1, cache 8192 and 2, 8, 9 or 12 new tokens (relative error about 1), and
`--xla_gpu_exclude_nondeterministic_ops=true` made it right. The flags-off leg says whether
the installed jax still needs that flag. The shapes are those of that run (Qwen2.5-7B heads:
28 query, 4 KV, dim 128, bf16); --quick uses toy ones (any device, CI).

  python -m experiments.check_gpu_numerics --out runs/numerics.json
  python -m experiments.check_gpu_numerics --quick --out /tmp/numerics.json

Writes JSON: device, jax, XLA_FLAGS of each leg, and per shape the relative error of the
reference and (on GPU) the kernel; exits 1 when the leg with the package's flags is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp

from tlt_jax import xla_flags
from tlt_jax.kernels.reference import prefix_tree_attention_reference
from tlt_jax.kernels.tree_attention_pallas import prefix_tree_attention_pallas

from . import bench_tree_attention as bench
from .common import REPO, module_command, run_metadata, write_json

# (batch, cache length, new tokens): the H100 run's wrong and right shapes.
SHAPES = [(1, 8192, t) for t in (1, 2, 4, 7, 8, 9, 12, 16, 48)] + [(1, 16384, 8), (2, 8192, 8)]
QUICK_SHAPES = [(1, 64, 2), (2, 128, 8)]
HEADS = dict(heads=28, kv_heads=4, head_dim=128)
QUICK_HEADS = dict(heads=4, kv_heads=2, head_dim=16)


def check_shapes(shapes, heads: dict, dtype=jnp.bfloat16) -> list[dict]:
  """Per (B, S, T): relative errors of the device's reference and (on GPU) kernel outputs
  against the host's float32 reference, over every sequence of the batch."""
  largest = [max(s[i] for s in shapes) for i in range(3)]
  base = bench.make_inputs(jax.random.key(0), *largest, heads["heads"], heads["kv_heads"],
                           heads["head_dim"], dtype)
  reference = jax.jit(prefix_tree_attention_reference)
  on_gpu = jax.default_backend() == "gpu"
  rows = []
  for batch, prefix_len, t in shapes:
    inputs = bench.slice_inputs(base, batch, prefix_len, t)
    every = tuple(range(batch))
    row = dict(batch=batch, prefix_len=prefix_len, tree_size=t,
               reference=bench.check_point(inputs, reference(*inputs), every),
               kernel=(bench.check_point(inputs, prefix_tree_attention_pallas(*inputs), every)
                       if on_gpu else None))
    row["right"] = all(c is None or (c["finite"] and c["rel_err"] <= bench.TOLERANCE["bfloat16"])
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


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  p.add_argument("--quick", action="store_true", help="toy shapes (any device)")
  p.add_argument("--leg", choices=("flags", "flags_off"), default="flags",
                 help=argparse.SUPPRESS)  # flags_off: the child process of the second leg
  args = p.parse_args(argv)
  shapes, heads = (QUICK_SHAPES, QUICK_HEADS) if args.quick else (SHAPES, HEADS)
  print(f"--- {args.leg}: XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}", flush=True)
  rows = check_shapes(shapes, heads)
  args.out.parent.mkdir(parents=True, exist_ok=True)
  if args.leg == "flags_off":
    write_json(args.out, rows)
    return
  child_out = args.out.with_suffix(".flags_off.tmp")
  argv_child = [*module_command("check_gpu_numerics"), "--out", str(child_out),
                "--leg", "flags_off", *(["--quick"] if args.quick else [])]
  env = dict(os.environ, XLA_FLAGS=flags_off())
  done = subprocess.run(argv_child, env=env, cwd=REPO, timeout=600)
  off_rows = json.loads(child_out.read_text()) if done.returncode == 0 else None
  child_out.unlink(missing_ok=True)
  device = jax.devices()[0]
  doc = dict(run_metadata(device), heads=heads, dtype="bfloat16",
             tolerance=bench.TOLERANCE["bfloat16"],
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


if __name__ == "__main__":
  main()
