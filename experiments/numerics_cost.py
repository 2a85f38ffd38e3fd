"""Benchmark: what the shape-invariant numerics cost (model.numerics "invariant" against
"fast"), side by side in one run, in bfloat16 with random weights of a named shape.

Timed per mode, each a jitted call (median of --repeats after a warm-up call):
  decode  one decode step at each of --batches rows, over a cache of --context valid slots;
  verify  a tree verify of --tree nodes (a chain) at 8 rows over the same cache;
  update  the gradient of the trainer's token log-probs (tlt_jax.rl.loss.token_log_probs)
          over 4 rows of --train-len tokens.
Writes OUT/numerics_cost.json (the times, invariant / fast per call, the target: a decode step
at most 1.5x the fast one, checked per row count) and OUT/numerics_cost.png.

  python -m experiments.numerics_cost --out results/numerics            # SmolLM2's shape, 4 layers
  python -m experiments.numerics_cost --quick --out /tmp/numerics       # CI: the small shape
"""

from __future__ import annotations

import argparse
import pathlib

from .common import median_ms, pyplot, run_metadata, save_figure, write_json

DECODE_TARGET = 1.5  # invariant decode step / fast decode step, at most
# The sizes' flags: (flag, type, default, default with --quick, what).
SIZES = (("--shape", str, "smollm2-135m", "small", "a name of tlt_jax.models.shapes"),
         ("--layers", int, 4, 2, "layers"), ("--batches", int, [1, 8, 32], [1, 8], "decode rows"),
         ("--context", int, 256, 64, "valid cache slots"),
         ("--tree", int, 16, 16, "verify nodes"),
         ("--train-len", int, 256, 64, "tokens per update row"),
         ("--repeats", int, 5, 2, "timed calls"))


def measure(cfg, args) -> dict:
  """{call name: seconds} of the decode, verify and update calls for ModelConfig cfg."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tlt_jax.models import decoder, init_cache
  from tlt_jax.models.attention_inputs import ancestor_mask, tree_depths
  from tlt_jax.rl.loss import token_log_probs
  params = decoder.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  capacity = args.context + args.tree + 8
  out = {}

  def timed(fn, *inputs) -> float:
    """Median seconds of fn(*inputs) over --repeats calls after one warm-up (compile) call."""
    return median_ms(lambda: jax.block_until_ready(fn(*inputs)), args.repeats, warmup=1) / 1e3

  def cache_for(rows):
    cache = init_cache(cfg, rows, capacity)
    prompt = jnp.asarray(rng.integers(1, cfg.vocab_size, (rows, args.context)), jnp.int32)
    _, _, cache = jax.jit(lambda p, t, c: decoder.prefill(
        p, t, jnp.full((rows,), args.context, jnp.int32), c, cfg))(params, prompt, cache)
    return cache

  step = jax.jit(lambda p, t, c: decoder.decode(p, t, c, cfg)[0])
  for rows in args.batches:
    cache = cache_for(rows)
    tokens = jnp.ones((rows,), jnp.int32)
    out[f"decode_{rows}"] = timed(step, params, tokens, cache)
  cache = cache_for(8)
  parents = np.tile(np.arange(-1, args.tree - 1), (8, 1)).astype(np.int32)
  mask = ancestor_mask(jnp.asarray(parents))
  tree = jnp.ones((8, args.tree), jnp.int32)
  verify = jax.jit(lambda p, t, c: decoder.verify(p, t, tree_depths(mask), mask, c, cfg)[0])
  out[f"verify_8x{args.tree}"] = timed(verify, params, tree, cache)
  seqs = jnp.asarray(rng.integers(1, cfg.vocab_size, (4, args.train_len + 1)), jnp.int32)
  loss_mask = jnp.ones((4, args.train_len), bool)
  grad = jax.jit(jax.grad(lambda p: token_log_probs(
      p, seqs[:, :-1], seqs[:, 1:], loss_mask, cfg.replace(scan_layers=True))[0].sum()))
  out[f"update_4x{args.train_len}"] = timed(grad, params)
  return out


def plot(result: dict, path: pathlib.Path) -> None:
  plt = pyplot()
  names = list(result["ratio"])
  fig, ax = plt.subplots(figsize=(1.2 * len(names) + 2, 3.5))
  ax.bar(names, [result["ratio"][n] for n in names], color="tab:blue")
  ax.axhline(1.0, color="grey", lw=0.8)
  ax.axhline(DECODE_TARGET, color="tab:red", ls="--", lw=0.8, label="decode target")
  ax.set_ylabel("invariant / fast time")
  ax.set_title(f"Shape-invariant numerics' cost, {result['shape']} ({result['layers']} layers), "
               f"bfloat16, {result['device']['device_kind']}", fontsize=9)
  ax.legend(fontsize=8)
  plt.xticks(rotation=30, fontsize=8)
  save_figure(fig, path, dpi=120)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  for flag, kind, full, quick, what in SIZES:
    parser.add_argument(flag, type=kind, nargs="+" if isinstance(full, list) else None,
                        help=f"{what} (default {full}; --quick {quick})")
  parser.add_argument("--quick", action="store_true", help="CI: the small shape, short")
  args = parser.parse_args(argv)
  for flag, _, full, quick, _ in SIZES:
    name = flag[2:].replace("-", "_")
    if getattr(args, name) is None:
      setattr(args, name, quick if args.quick else full)
  from tlt_jax.models.config import ModelConfig
  from tlt_jax.models.shapes import MODEL_SHAPES
  if args.shape not in MODEL_SHAPES:
    parser.error(f"--shape {args.shape}: unknown; known: {sorted(MODEL_SHAPES)}")
  base = ModelConfig(**dict(MODEL_SHAPES[args.shape], num_layers=args.layers),
                     dtype="bfloat16", param_dtype="bfloat16", attention_impl="reference")
  times = {}
  for numerics in ("fast", "invariant"):
    times[numerics] = measure(base.replace(numerics=numerics), args)
    print(f"{numerics}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times[numerics].items()),
          flush=True)
  ratio = {k: times["invariant"][k] / times["fast"][k] for k in times["fast"]}
  targets = [{"name": k, "limit": DECODE_TARGET, "measured": r, "pass": r <= DECODE_TARGET}
             for k, r in ratio.items() if k.startswith("decode_")]
  result = {"what": "the shape-invariant numerics' cost against the fast numerics, side by side "
                    "(experiments/numerics_cost.py)", **run_metadata(), "shape": args.shape,
            "layers": args.layers, "dtype": "bfloat16", "context": args.context,
            "seconds": times, "ratio": ratio, "decode_targets": targets}
  args.out.mkdir(parents=True, exist_ok=True)
  write_json(args.out / "numerics_cost.json", result)
  plot(result, args.out / "numerics_cost.png")
  print("invariant / fast: " + ", ".join(f"{k} {r:.2f}" for k, r in ratio.items()))
  print(f"wrote {args.out / 'numerics_cost.json'} and numerics_cost.png")
  return result


if __name__ == "__main__":
  main()
