"""Benchmark: the policy's decode step and SD iteration against a plain-JAX floor and
(with --hf) transformers, side by side in one run, on random weights of a named shape.

Per batch size (default 1, 8, 32), with prompts of --prompt-len tokens in the cache:

  tlt plain       `plain_step` of tlt_jax.speculative.decoding (policy only)
  tlt plain+sync  the same step also keeping an EAGLE drafter's cache in step, as the
                  rollout does before it switches to SD
  tlt SD          one `sd_step` iteration per strategy (random 1-layer drafter, greedy), with
                  the policy's whole vocabulary and with each --draft-vocab-sizes (a reduced
                  draft vocabulary with its own head: EAGLE-3); next to it the iteration's
                  weight bytes in plain steps (`weight_read_floor`): its floor where decode
                  is bound by reading weights
  floor           a minimal decoder written here in plain JAX (a Python loop over static
                  slices of the stacked weights, GQA attention over the cache, LM head): what
                  the hardware allows for these weights
  transformers    with --hf only: `generate` of a Qwen2ForCausalLM of the same shape (PyTorch,
                  dynamic cache; bfloat16 on GPU, float32 on CPU), per step:
                  (time of N new tokens - time of 1) / (N - 1)

and, with --compile-times, the first-call compile seconds of prefill, the plain step and the
first SD strategy with the layers as a Python loop and as a lax.scan. Times are medians of
--iters calls after a warm-up, in milliseconds.

Each program is jitted once and reused for every call of the same shapes; a new batch size
compiles them again. The prefill that fills the caches is set-up, not a result: it runs with
the layers as a scan, which compiles much faster than the unrolled loop at 28 layers. The
persistent compilation cache (tlt_jax.compile_cache) is on, so a rerun loads the programs from
disk, except with --compile-times, whose compile seconds are results.

The JSON (the device, jax version, date, commit and command line recorded) is rewritten after
every measurement, so a run cut short keeps what it measured; the PNG after every batch.
--time-budget starts no batch after the first once that many seconds have passed.

transformers runs only after the batch's JAX results are written and its arrays freed. JAX
preallocates 75% of GPU memory at start-up, which would leave PyTorch too little, so --hf sets
XLA_PYTHON_CLIENT_PREALLOCATE=false unless the environment sets it already.

  python -m experiments.bench_decode --out results/decode.json                # CPU: 'small'
  python -m experiments.bench_decode --shape qwen2.5-7b --batches 1 8 --time-budget 480 \
      --out docs/results/decode_h100.json
  python -m experiments.bench_decode --shape qwen2.5-7b --batches 1 8 --hf \
      --out results/decode_vs_hf.json
  python -m experiments.bench_decode --batches 1 --strategies 8,4,48 \
      --draft-vocab-sizes 7061 --out results/draft_vocab/cost.json      # 32k/152k of 32k
  python -m experiments.bench_decode --quick --out /tmp/decode.json  # any device; 2 CPUs: ~30 s
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import importlib.util
import json
import os
import pathlib
import shlex
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()  # --time-budget counts from here

# JAX preallocates 75% of GPU memory when it starts, which leaves transformers too little: on
# GPU, run --hf with XLA_PYTHON_CLIENT_PREALLOCATE=false. Set here, before JAX starts, unless
# the environment sets it already. Even then JAX keeps what it frees in its own pool: PyTorch
# gets only what JAX never took.
if "--hf" in sys.argv[1:]:
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .common import REPO, run_metadata, write_json
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.kernels import ATTENTION_IMPLS
from tlt_jax.models import ModelConfig, init_cache, init_params, prefill
from tlt_jax.models.drafter import (DRAFT_TO_POLICY, DrafterConfig,
                                    init_drafter_cache, init_drafter_params)
from tlt_jax.models.shapes import MODEL_SHAPES
from tlt_jax.drafters import EagleDrafter
from tlt_jax.models.policy import Policy
from tlt_jax.speculative.decoding import plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

GREEDY = SamplingParams(temperature=0.0)


def median_ms(fn, iters: int, warmup: int = 2) -> float:
  """Median wall milliseconds of fn() (which blocks on its result) after warm-up calls."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


# ---------------------------------------------------------------- the plain-JAX floor


def floor_decoder(cfg: ModelConfig):
  """A minimal jitted decode step over tlt_jax's own weights: (params, x [B] int32, k, v
  [L, B, KVH, S, D]) -> logits [B, V] f32. Every weight is read; no RoPE, no biases, no
  cache write: a lower bound."""
  h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  dt = cfg.jnp_dtype

  def norm(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(dt) * w

  @jax.jit
  def step(params, tokens, k_cache, v_cache):
    x = params["embed"]["embedding"][tokens].astype(dt)
    lw = params["layers"]
    for i in range(cfg.num_layers):
      a = lw["self_attn"]
      y = norm(x, lw["input_layernorm"]["weight"][i])
      q = jnp.einsum("be,ehd->bhd", y, a["q_proj"]["kernel"][i]).reshape(-1, kvh, h // kvh, d)
      k = jnp.einsum("be,ekd->bkd", y, a["k_proj"]["kernel"][i])
      v = jnp.einsum("be,ekd->bkd", y, a["v_proj"]["kernel"][i])
      s = jnp.concatenate([
          jnp.einsum("bkgd,bksd->bkgs", q, k_cache[i], preferred_element_type=jnp.float32),
          jnp.einsum("bkgd,bkd->bkg", q, k, preferred_element_type=jnp.float32)[..., None]],
          axis=-1) * d ** -0.5
      p = jax.nn.softmax(s, -1).astype(dt)
      o = (jnp.einsum("bkgs,bksd->bkgd", p[..., :-1], v_cache[i])
           + p[..., -1:] * v[:, :, None, :]).reshape(-1, h, d)
      x = x + jnp.einsum("bhd,hde->be", o, a["o_proj"]["kernel"][i])
      y = norm(x, lw["post_attention_layernorm"]["weight"][i])
      m = lw["mlp"]
      gate = y @ m["gate_proj"]["kernel"][i]
      up = y @ m["up_proj"]["kernel"][i]
      x = x + (jax.nn.silu(gate) * up) @ m["down_proj"]["kernel"][i]
    x = norm(x, params["norm"]["weight"])
    head = (params["embed"]["embedding"].T if cfg.tie_embeddings
            else params["lm_head"]["kernel"])
    return jnp.dot(x, head, preferred_element_type=jnp.float32)
  return step


# ---------------------------------------------------------------- transformers


def hf_available() -> bool:
  return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers"))


def hf_step_ms(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> dict:
  """transformers' greedy decode ms per step for a random Qwen2 of cfg's shape, in bfloat16
  on GPU and float32 on CPU."""
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.bfloat16 if device == "cuda" else torch.float32
  hf_cfg = Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       tie_word_embeddings=cfg.tie_embeddings,
                       max_position_embeddings=cfg.max_position_embeddings)
  torch.manual_seed(0)
  # Built in the target dtype: a 7B model built in float32 first would need 30 GB on the GPU.
  default_dtype = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      model = Qwen2ForCausalLM(hf_cfg).eval()
  finally:
    torch.set_default_dtype(default_dtype)
  ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)

  def gen(n):
    if device == "cuda":
      torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     pad_token_id=0, eos_token_id=None)
    if device == "cuda":
      torch.cuda.synchronize()
    return time.perf_counter() - t0

  gen(4)
  one = min(gen(1) for _ in range(2))
  many = min(gen(new_tokens) for _ in range(2))
  del model
  if device == "cuda":
    torch.cuda.empty_cache()  # the next batch's JAX programs need the memory back
  return {"device": device, "dtype": str(dtype).removeprefix("torch."),
          "step_ms": (many - one) / (new_tokens - 1) * 1e3}


# ---------------------------------------------------------------- tlt_jax


def build_programs(cfg, drafters, strategies, max_new, cap) -> dict:
  """Every jitted program of the run, built once: a new batch size compiles each again, a
  repeat or another strategy of the same batch compiles nothing.

  start:  (params, drafter params, prompts [B, P], lengths [B]) -> GenState with the full
          drafter's cache filled; the layers run as a scan (set-up, not timed). The reduced
          drafters reuse it: their layers, and so their cache's shape, are the full one's.
  plain, synced: (params, state, key[, drafter params]) -> (state, stats), state donated.
  sd:     {strategy_name: (params, drafter params, state, key) -> (state, stats)}, state
          donated.
  floor:  see floor_decoder.
  """
  dcfg = drafters[0][0]
  scan_cfg = cfg.replace(scan_layers=True)

  def filled(params, dparams, prompts, lengths):
    b = prompts.shape[0]
    return start(Policy(params, scan_cfg), prompts, lengths, init_cache(scan_cfg, b, cap),
                 jax.random.key(0), GREEDY, max_new, -1,
                 drafters={"eagle": EagleDrafter(dparams, dcfg)},
                 draft_states={"eagle": init_drafter_cache(scan_cfg, dcfg, b, cap)})

  def sd_fn(strategy, d):
    return lambda params, dparams, state, key: sd_step(
        Policy(params, cfg), {"eagle": EagleDrafter(dparams, d)}, state, key, GREEDY, -1,
        strategy)

  def synced(params, state, key, drafter_params):
    return plain_step(Policy(params, cfg), state, key, GREEDY, -1,
                      drafters={"eagle": EagleDrafter(drafter_params, dcfg)})

  sd = {}
  for strategy in strategies:
    for vocab, (d, _) in drafters.items():
      sd[strategy_name(strategy, vocab)] = jax.jit(sd_fn(strategy, d), donate_argnums=(2,))
  return {
      "start": jax.jit(filled),
      "plain": jax.jit(lambda params, state, key: plain_step(Policy(params, cfg), state, key,
                                                             GREEDY, -1), donate_argnums=(1,)),
      "synced": jax.jit(synced, donate_argnums=(1,)),
      "sd": sd,
      "floor": floor_decoder(cfg),
  }


def strategy_name(strategy: Strategy, vocab: int) -> str:
  return ",".join(map(str, strategy.as_tuple())) + (f" r={vocab}" if vocab else "")


def weight_read_floor(cfg: ModelConfig, dcfg: DrafterConfig, passes: int) -> float:
  """An SD iteration's weight bytes over a plain step's: verification reads the policy's
  weights once, like a step (all but the embedding table, of which it gathers rows; a tied
  table is read as the head), and each of the `passes` drafter passes reads the drafter's
  weights and a head (its own with a reduced draft vocabulary, else the policy's). KV-cache
  and activation bytes are left out. At equal bandwidth this is the least an iteration can
  cost, in plain steps, when decode is bound by reading weights."""
  def sizes(tree):
    return {jax.tree_util.keystr(p): int(np.prod(x.shape))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  policy = sizes(jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0)))
  drafter = sizes(jax.eval_shape(functools.partial(init_drafter_params, cfg, dcfg),
                                 jax.random.key(0)))
  table = policy["['embed']['embedding']"]
  step = sum(policy.values()) - (0 if cfg.tie_embeddings else table)
  head = 0 if dcfg.draft_vocab_size else policy.get("['lm_head']['kernel']", table)
  index = jax.tree_util.keystr((jax.tree_util.DictKey(DRAFT_TO_POLICY),))  # ids, not weights
  drafter_pass = sum(v for k, v in drafter.items() if k != index) + head
  return 1.0 + passes * drafter_pass / step


def bench_batch(programs, cfg, params, drafters, batch, prompt_len, strategies, iters,
                row, save) -> None:
  """Fills `row` with the JAX times of one batch size, calling save() after each one.

  drafters: {draft vocabulary size (0 = full): (DrafterConfig, params)}; the full one keeps
  its cache in step in `tlt plain+sync`. Every array made here dies with this call.
  """
  dparams = drafters[0][1]
  rng = np.random.default_rng(batch)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)

  def fresh(with_drafter: bool):
    state = programs["start"](params, dparams, prompts, lengths)
    return state if with_drafter else state.replace(drafts={})

  def timed_steps(step, state):
    box = [state]

    def one():
      box[0], _ = step(box[0])
      jax.block_until_ready(box[0].num_out)
    return median_ms(one, iters)

  key = jax.random.key(1)
  plain, synced = programs["plain"], programs["synced"]
  row["tlt_plain_ms"] = timed_steps(lambda s: plain(params, s, key), fresh(False))
  save()
  row["tlt_plain_sync_ms"] = timed_steps(
      lambda s: synced(params, s, key, drafter_params=dparams), fresh(True))
  save()
  row["sd"] = {}
  for strategy in strategies:
    for vocab, (_, dp) in drafters.items():
      name = strategy_name(strategy, vocab)
      sd = programs["sd"][name]
      ms = timed_steps(lambda s, sd=sd, dp=dp: sd(params, dp, s, key), fresh(True))
      row["sd"][name] = {"iteration_ms": ms, "vs_plain_step": ms / row["tlt_plain_ms"],
                         "draft_vocab_size": vocab or cfg.vocab_size,
                         "weight_floor_vs_plain_step": weight_read_floor(
                             cfg, drafters[vocab][0], strategy.depth)}
      save()

  k = jnp.full((cfg.num_layers, batch, cfg.num_kv_heads, prompt_len, cfg.head_dim), 0.01,
               cfg.jnp_dtype)
  tokens = prompts[:, 0]
  floor = programs["floor"]
  row["floor_ms"] = median_ms(lambda: jax.block_until_ready(floor(params, tokens, k, k)), iters)
  row["tlt_vs_floor"] = row["tlt_plain_ms"] / row["floor_ms"]
  save()


def compile_seconds(cfg, params, dcfg, dparams, batch, prompt_len, strategy) -> dict:
  """First-call compile seconds (lower + compile) of prefill, the plain step and one SD
  iteration, with the layers as a loop and as a scan."""
  out = {}
  prompts = jnp.zeros((batch, prompt_len), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  cap = -(-(prompt_len + 64) // 64) * 64
  for name, scan in (("loop", False), ("scan", True)):
    c = cfg.replace(scan_layers=scan)
    cache = init_cache(c, batch, cap)
    eagle = {"eagle": EagleDrafter(dparams, dcfg)}
    state = jax.eval_shape(functools.partial(start, sp=GREEDY, max_new_tokens=32, eos_id=-1),
                           Policy(params, c), prompts, lengths, cache, jax.random.key(0),
                           drafters=eagle,
                           draft_states={"eagle": init_drafter_cache(c, dcfg, batch, cap)})
    programs = {
        "prefill": (functools.partial(prefill, cfg=c), (params, prompts, lengths, cache)),
        "plain_step": (lambda pol, st, k, ds: plain_step(pol, st, k, GREEDY, -1, drafters=ds),
                       (Policy(params, c), state, jax.random.key(1), eagle)),
        "sd_step": (functools.partial(sd_step, sp=GREEDY, eos_id=-1, strategy=strategy),
                    (Policy(params, c), eagle, state, jax.random.key(1))),
    }
    for prog, (fn, args) in programs.items():
      t0 = time.perf_counter()
      jax.jit(fn).lower(*args).compile()  # a fresh jit on purpose: the compile is the result
      out[f"{prog}_{name}_s"] = time.perf_counter() - t0
  return out


def plot(result: dict, path: pathlib.Path) -> None:
  """Step times per batch (left) and SD iteration / plain step per strategy (right), from the
  batches measured to the end."""
  rows = [r for r in result["rows"] if r.get("complete")]
  if not rows:
    return
  batches = [r["batch"] for r in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  series = [("tlt_plain_ms", "tlt_jax plain step"), ("tlt_plain_sync_ms", "+ drafter cache sync"),
            ("floor_ms", "plain-JAX floor"), ("hf_ms", "transformers generate")]
  width = 0.8 / len(series)
  for i, (key, label) in enumerate(series):
    if all(key in r for r in rows):
      ax1.bar(np.arange(len(rows)) + i * width, [r[key] for r in rows], width, label=label)
  ax1.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [f"B={b}" for b in batches])
  ax1.set_ylabel("ms per decode step")
  ax1.set_yscale("log")
  ax1.legend(fontsize=8)
  ax1.set_title(f"{result['shape']} on {result['device']['device_kind']} "
                f"(attention {result['attention_impl']})")
  for strategy in rows[0]["sd"]:
    ax2.plot(batches, [r["sd"][strategy]["vs_plain_step"] for r in rows], "o-",
             label=f"SD {strategy}")
  ax2.axhline(1.0, color="k", lw=0.8)
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("batch")
  ax2.set_ylabel("SD iteration / plain step")
  ax2.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
  # No abbreviations: --hf is looked for verbatim before JAX is imported (see the top).
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default=None,
                      help="model shape (default: qwen2.5-7b on GPU, small elsewhere)")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=None,
                      help="cached prompt tokens (default: 1024 on GPU, 256 elsewhere)")
  parser.add_argument("--strategies", nargs="+", default=["8,4,48", "8,4,16", "4,2,8"])
  parser.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[],
                      help="also time SD with these reduced draft vocabularies")
  parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default="auto",
                      help="attention of the policy and so of the drafter, whose layers "
                           "follow the policy's config")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--hf", action="store_true",
                      help="also time transformers, after each batch's JAX measurements")
  parser.add_argument("--hf-new-tokens", type=int, default=64)
  parser.add_argument("--compile-times", action="store_true",
                      help="also compile prefill / plain / SD with a loop and with a scan "
                           "(turns the persistent compilation cache off)")
  parser.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                      help="start no batch after the first once this many seconds have passed "
                           "since the script started (0 = no limit)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run on any device: shape 'small', batches 1 and 2, one "
                           "strategy, 3 iterations, no --compile-times, no --hf")
  args = parser.parse_args(argv)
  if args.quick:
    args.shape, args.batches, args.strategies, args.iters = "small", [1, 2], ["3,2,6"], 3
    args.prompt_len, args.draft_vocab_sizes = 32, []
    args.compile_times = args.hf = False
  if args.attention_impl == "pallas" and jax.default_backend() != "gpu":
    parser.error(f"--attention-impl pallas needs a GPU (backend here: "
                 f"{jax.default_backend()}); pallas_interpret runs the kernel on CPU")
  if args.time_budget < 0:
    parser.error(f"--time-budget must be >= 0 seconds, got {args.time_budget}")
  return args


def main(argv=None):
  args = parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  shape = args.shape or ("qwen2.5-7b" if gpu else "small")
  prompt_len = args.prompt_len or (1024 if gpu else 256)
  if args.compile_times:
    # The environment (JAX_COMPILATION_CACHE_DIR) may turn it on: compile seconds would then
    # measure a disk read.
    jax.config.update("jax_enable_compilation_cache", False)
    cache_dir = None
  else:
    cache_dir = enable_compilation_cache()
  with_hf = args.hf and hf_available()
  if args.hf and not with_hf:
    print("torch or transformers is not installed: transformers is not measured")
  cfg = ModelConfig(**MODEL_SHAPES[shape], dtype="bfloat16" if gpu else "float32",
                    param_dtype="bfloat16" if gpu else "float32",
                    attention_impl=args.attention_impl)
  strategies = [Strategy.parse(s) for s in args.strategies]
  # Random weights, whose values do not change the cost: drawn with the "rbg" generator,
  # which compiles in half the time of the default one.
  weight_key = functools.partial(jax.random.key, impl="rbg")
  params = jax.jit(functools.partial(init_params, cfg))(weight_key(0))
  dcfg = DrafterConfig()
  dparams = jax.jit(functools.partial(init_drafter_params, cfg, dcfg))(weight_key(1))
  drafters = {0: (dcfg, dparams)}
  for vocab in args.draft_vocab_sizes:
    # Which ids the vocabulary holds does not change the cost either.
    d = DrafterConfig(draft_vocab_size=vocab)
    drafters[vocab] = (d, jax.jit(functools.partial(init_drafter_params, cfg, d))(
        weight_key(1)))
  most = max([s.depth for s in strategies] + [0]) + 1
  max_new = (args.iters + 4) * most + 2  # EOS is off: no row finishes while being timed
  cap = -(-(prompt_len + max_new + most) // 64) * 64
  programs = build_programs(cfg, drafters, strategies, max_new, cap)

  result = {**run_metadata(), "shape": shape, "model": MODEL_SHAPES[shape],
            "dtype": cfg.dtype,
            "attention_impl": args.attention_impl, "prompt_len": prompt_len,
            "iters": args.iters, "batches": args.batches, "strategies": args.strategies,
            "hf": with_hf, "compilation_cache": cache_dir,
            "time_budget_s": args.time_budget or None, "stopped_early": False,
            "skipped_batches": [], "rows": []}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  png = args.out.with_suffix(".png")
  save = functools.partial(write_json, args.out, result)
  for i, b in enumerate(args.batches):
    if i and args.time_budget and time.perf_counter() - T0 > args.time_budget:
      result.update(stopped_early=True, skipped_batches=args.batches[i:])
      print(f"time budget of {args.time_budget:.0f} s spent: batches {args.batches[i:]} "
            f"skipped", flush=True)
      break
    row = {"batch": b, "complete": False}
    result["rows"].append(row)
    bench_batch(programs, cfg, params, drafters, b, prompt_len, strategies, args.iters, row,
                save)
    if with_hf:
      # The batch's arrays died with bench_batch; its executables go too, as the next batch
      # size compiles its own anyway.
      gc.collect()
      jax.clear_caches()
      hf = hf_step_ms(cfg, b, prompt_len, args.hf_new_tokens)
      row.update(hf_device=hf["device"], hf_dtype=hf["dtype"], hf_ms=hf["step_ms"],
                 tlt_speedup_vs_hf=hf["step_ms"] / row["tlt_plain_ms"])
    row["complete"] = True
    save()
    plot(result, png)
    sd = ", ".join(f"SD {k} {v['vs_plain_step']:.2f}x "
                   f"(weights {v['weight_floor_vs_plain_step']:.2f}x)"
                   for k, v in row["sd"].items())
    hf = f", transformers {row['hf_ms']:.2f} ms" if "hf_ms" in row else ""
    print(f"B={b}: plain {row['tlt_plain_ms']:.2f} ms (+sync {row['tlt_plain_sync_ms']:.2f}), "
          f"floor {row['floor_ms']:.2f} ms ({row['tlt_vs_floor']:.2f}x){hf}; {sd}", flush=True)
  if args.compile_times and result["stopped_early"]:
    result["compile_s"] = "skipped: time budget spent"
  elif args.compile_times:
    result["compile_s"] = compile_seconds(cfg, params, dcfg, dparams, args.batches[0],
                                          prompt_len, strategies[0])
    print("compile seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                          result["compile_s"].items()), flush=True)
  result["wall_s"] = time.perf_counter() - T0
  save()
  plot(result, png)
  print(f"wrote {args.out} and {png} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
  main()
