"""The compiled-executable pool: bucketed programs vs one program per batch size and strategy.

The rollout engine compiles a decode program per power-of-two batch bucket, and an SD program
per (bucket, strategy) for the buckets at or below rollout.sd_threshold with the tuner's arms;
without buckets, compiling on demand ends with a program for every batch size and strategy.
Both sets are compiled for the config's policy and drafters (one device, AOT, as the pool
does); per set: executables, compile seconds, and XLA's memory analysis (generated code, 0 on
the CPU backend, and each program's temporaries), in OUT/executable_pool.{json,png}.

  python -m experiments.executable_pool --out results/executable_pool [--quick]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from tlt_jax.components import load_drafters_for, load_policy, load_tokenizer_for
from tlt_jax.mesh import make_mesh
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.rollout.engine import EngineConfig
from tlt_jax.rollout.scheduler import batch_ladder, bucket
from tlt_jax.models.policy import Policy
from tlt_jax.speculative.decoding import decode_loop, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

from .common import add_config_flags, config_or_exit, pyplot, save_figure, write_json


def program_sets(max_batch: int, sd_threshold: int, strategies: list) -> dict[str, list]:
  """(mode, batch, strategy) keys of the two sets; mode is 'plain' or 'sd'. Bucketed: the
  engine's ladder (powers of two) and the buckets the SD threshold's row counts fall in."""
  pow2 = batch_ladder(max_batch)
  sd_pow2 = sorted({bucket(b, max_batch) for b in range(1, sd_threshold + 1)})
  bucketed = [("plain", b, None) for b in pow2] + \
      [("sd", b, s) for b in sd_pow2 for s in strategies]
  every = [("plain", b, None) for b in range(1, max_batch + 1)] + \
      [("sd", b, s) for b in range(1, sd_threshold + 1) for s in strategies]
  return {"bucketed": bucketed, "every_batch_size": every}


def compile_set(keys, cfg, drafters, params, capacity: int, max_new_tokens: int,
                eos: int) -> dict:
  """Compiles every program of a set (drafters: name -> the run's drafters); returns counts,
  seconds and memory."""
  sp = SamplingParams(1.0)
  key = jax.random.key(0)
  states = {}
  policy = Policy(params, cfg)

  def state_shape(b):
    if b not in states:
      def make():
        prompts = jnp.ones((b, 8), jnp.int32)
        return start(policy, prompts, jnp.full((b,), 8, jnp.int32),
                     init_cache(cfg, b, capacity), key, sp, max_new_tokens, eos,
                     drafters=drafters,
                     draft_states={n: st for n, d in drafters.items()
                                   if (st := d.init_state(cfg, b, capacity)) is not None})
      states[b] = jax.eval_shape(make)
    return states[b]

  seconds, code, temp = 0.0, 0, 0
  limits = (jnp.int32(1), jnp.int32(32))  # min_running, max_iterations: traced, as the engine has
  for mode, b, strategy in keys:
    # The engine's decode program: a loop of plain steps or SD iterations (see decode_loop).
    fn = functools.partial(decode_loop, sp=sp, eos_id=eos,
                           strategy=strategy if mode == "sd" else None)
    t0 = time.perf_counter()
    exe = jax.jit(fn, donate_argnums=(2,)).lower(policy, drafters, state_shape(b), key,
                                                 *limits).compile()
    seconds += time.perf_counter() - t0
    mem = exe.memory_analysis()
    if mem is not None:
      code += int(getattr(mem, "generated_code_size_in_bytes", 0) or 0)
      temp += int(getattr(mem, "temp_size_in_bytes", 0) or 0)
  return {"executables": len(keys), "compile_s": seconds, "generated_code_bytes": code,
          "temp_bytes": temp, "memory_bytes": code + temp,
          "plain": sum(k[0] == "plain" for k in keys), "sd": sum(k[0] == "sd" for k in keys)}


def plot(result: dict, path: pathlib.Path) -> None:
  plt = pyplot()
  names = list(result["sets"])
  fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=100)
  for ax, key, label in ((axes[0], "executables", "executables"),
                         (axes[1], "compile_s", "compile seconds"),
                         (axes[2], "memory_bytes", "generated code + temporaries (MB)")):
    values = [result["sets"][n][key] / (1e6 if "bytes" in key else 1) for n in names]
    ax.bar(names, values, color=["#3b6ea5", "#c0392b"])
    ax.set_title(label, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
  fig.suptitle(f"max_batch {result['max_batch']}, SD threshold {result['sd_threshold']}, "
               f"{len(result['strategies'])} strategies", fontsize=9)
  save_figure(fig, path)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  add_config_flags(parser)
  parser.add_argument("--quick", action="store_true",
                      help="max_batch 4, SD threshold 2, one strategy (smoke test)")
  args = parser.parse_args()
  config = config_or_exit(args.config, args.set)

  r = config.rollout
  strategies = [Strategy.parse(s) for s in r.speculative.arms]
  max_batch, threshold = r.max_batch, r.sd_threshold
  if args.quick:
    max_batch, threshold, strategies = 4, 2, strategies[:1]
  if not config.model.path:
    sys.exit("--config must name a model.path (the policy whose programs are compiled)")
  cfg, params = load_policy(config, make_mesh({"replica": 1}, jax.devices()[:1]))
  drafters = load_drafters_for(config, cfg)
  eos = load_tokenizer_for(config).eos_token_id
  capacity = EngineConfig(max_batch=1, max_prompt_len=r.max_prompt_len,
                          max_new_tokens=r.max_new_tokens).capacity

  sets = program_sets(max_batch, threshold, strategies)
  # One untimed compile first: the first trace of the model's functions is not a pool cost.
  compile_set(sets["bucketed"][:1], cfg, drafters, params, capacity, r.max_new_tokens, eos)
  result = {"config": args.config, "max_batch": max_batch, "sd_threshold": threshold,
            "strategies": [s.as_tuple() for s in strategies], "capacity": capacity,
            "backend": jax.default_backend(), "sets": {}}
  for name, keys in sets.items():
    result["sets"][name] = compile_set(keys, cfg, drafters, params, capacity,
                                       r.max_new_tokens, eos)
    row = result["sets"][name]
    print(f"{name:18s} {row['executables']:4d} executables  {row['compile_s']:7.1f} s  "
          f"code + temporaries {row['memory_bytes'] / 1e6:.1f} MB", flush=True)
  a, b = result["sets"]["bucketed"], result["sets"]["every_batch_size"]
  result["ratio_executables"] = b["executables"] / a["executables"]
  result["ratio_compile_s"] = b["compile_s"] / a["compile_s"]
  args.out.mkdir(parents=True, exist_ok=True)
  write_json(args.out / "executable_pool.json", result)
  plot(result, args.out / "executable_pool.png")
  print(f"every batch size / bucketed: {result['ratio_executables']:.1f}x executables, "
        f"{result['ratio_compile_s']:.1f}x compile time")


if __name__ == "__main__":
  main()
