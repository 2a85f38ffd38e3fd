"""Benchmark: the policy's decode step and SD iteration against a plain-JAX floor and
transformers, side by side in one run, on random weights of a named shape.

Per batch size (default 1, 8, 32), with prompts of --prompt-len tokens in the cache:

  tlt plain       `plain_step` of tlt_jax.speculative.decoding (policy only)
  tlt plain+sync  the same step also keeping an EAGLE drafter's cache in step, as the
                  rollout does before it switches to SD
  tlt SD          one `sd_step` iteration per strategy (random 1-layer drafter, greedy), with
                  the policy's whole vocabulary and with each --draft-vocab-sizes (a reduced
                  draft vocabulary with its own head: EAGLE-3)
  floor           a minimal decoder written here in plain JAX (a Python loop over static
                  slices of the stacked weights, GQA attention over the cache, LM head): what
                  the hardware allows for these weights
  transformers    `generate` of a Qwen2ForCausalLM of the same shape (PyTorch, dynamic
                  cache), per step: (time of N new tokens - time of 1) / (N - 1)

and, with --compile-times, the first-call compile seconds of prefill, the plain step and the
first SD strategy with the layers as a Python loop and as a lax.scan. Times are medians of
--iters calls after a warm-up, in milliseconds. Writes JSON (the device named) and a PNG.

  python experiments/bench_decode.py --out results/decode.json                # CPU: 'small'
  python experiments/bench_decode.py --shape qwen2.5-7b --out docs/results/decode_h100.json
  python experiments/bench_decode.py --batches 1 --strategies 8,4,48 --no-hf \
      --draft-vocab-sizes 7061 --out results/draft_vocab/cost.json      # 32k/152k of 32k

The persistent compilation cache stays off here: compile seconds are among the results.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tlt_jax.models import ModelConfig, init_cache, init_params, prefill  # noqa: E402
from tlt_jax.models.drafter import (DrafterConfig, init_drafter_cache,  # noqa: E402
                                    init_drafter_params)
from tlt_jax.speculative.decoding import plain_step, sd_step, start  # noqa: E402
from tlt_jax.speculative.sampling import SamplingParams  # noqa: E402
from tlt_jax.speculative.strategy import Strategy  # noqa: E402

GREEDY = SamplingParams(temperature=0.0)
SHAPES = {
    # A model small enough for a 2-core CPU, with a 32k vocabulary.
    "small": dict(vocab_size=32768, hidden_size=256, intermediate_size=768, num_layers=6,
                  num_heads=8, num_kv_heads=2, head_dim=32, qkv_bias=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                         qkv_bias=True, tie_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       qkv_bias=True),
}


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


def hf_step_ms(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int) -> dict:
  """transformers' greedy decode ms per step for a random Qwen2 of cfg's shape."""
  import torch
  from transformers import Qwen2Config, Qwen2ForCausalLM
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
  hf_cfg = Qwen2Config(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                       num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                       tie_word_embeddings=cfg.tie_embeddings,
                       max_position_embeddings=cfg.max_position_embeddings)
  torch.manual_seed(0)
  with torch.device(device):
    model = Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
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
  return {"device": device, "step_ms": (many - one) / (new_tokens - 1) * 1e3}


# ---------------------------------------------------------------- tlt_jax


def bench_batch(cfg, params, drafters, batch, prompt_len, strategies, iters,
                with_hf, hf_new_tokens) -> dict:
  """drafters: {draft vocabulary size (0 = full): (DrafterConfig, params)}; the full one keeps
  its cache in step in `tlt plain+sync`."""
  dcfg, dparams = drafters[0]
  rng = np.random.default_rng(batch)
  prompts = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  most = max([s.steps for s in strategies] + [0]) + 1
  max_new = (iters + 4) * most + 2  # EOS is off: no row finishes while being timed
  cap = -(-(prompt_len + max_new + most) // 64) * 64

  def fresh(with_drafter, drafter=drafters[0]):
    d, dp = drafter if with_drafter else (None, None)
    return jax.jit(functools.partial(start, sp=GREEDY, max_new_tokens=max_new, eos_id=-1,
                                     cfg=cfg, dcfg=d))(
        params, prompts, lengths, init_cache(cfg, batch, cap), jax.random.key(0),
        drafter_params=dp, draft_cache=init_drafter_cache(cfg, d, batch, cap) if d else None)

  def timed_steps(step, state):
    box = [state]

    def one():
      box[0], _ = step(box[0])
      jax.block_until_ready(box[0].num_out)
    return median_ms(one, iters)

  row = {"batch": batch}
  plain = jax.jit(functools.partial(plain_step, sp=GREEDY, eos_id=-1, cfg=cfg),
                  donate_argnums=(1,))
  row["tlt_plain_ms"] = timed_steps(lambda s: plain(params, s, jax.random.key(1)),
                                    fresh(False))
  synced = jax.jit(functools.partial(plain_step, sp=GREEDY, eos_id=-1, cfg=cfg, dcfg=dcfg),
                   donate_argnums=(1,))
  row["tlt_plain_sync_ms"] = timed_steps(
      lambda s: synced(params, s, jax.random.key(1), drafter_params=dparams), fresh(True))
  row["sd"] = {}
  for strategy in strategies:
    for vocab, (d, dp) in drafters.items():
      sd = jax.jit(functools.partial(sd_step, sp=GREEDY, eos_id=-1, strategy=strategy, cfg=cfg,
                                     dcfg=d), donate_argnums=(2,))
      ms = timed_steps(lambda s, sd=sd, dp=dp: sd(params, dp, s, jax.random.key(1)),
                       fresh(True, (d, dp)))
      name = ",".join(map(str, strategy.as_tuple())) + (f" r={vocab}" if vocab else "")
      row["sd"][name] = {"iteration_ms": ms, "vs_plain_step": ms / row["tlt_plain_ms"],
                         "draft_vocab_size": vocab or cfg.vocab_size}

  floor = floor_decoder(cfg)
  k = jnp.full((cfg.num_layers, batch, cfg.num_kv_heads, prompt_len, cfg.head_dim), 0.01,
               cfg.jnp_dtype)
  tokens = prompts[:, 0]
  row["floor_ms"] = median_ms(lambda: jax.block_until_ready(floor(params, tokens, k, k)), iters)
  row["tlt_vs_floor"] = row["tlt_plain_ms"] / row["floor_ms"]
  if with_hf:
    hf = hf_step_ms(cfg, batch, prompt_len, hf_new_tokens)
    row.update(hf_device=hf["device"], hf_ms=hf["step_ms"],
               tlt_speedup_vs_hf=hf["step_ms"] / row["tlt_plain_ms"])
  return row


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
    state = jax.eval_shape(functools.partial(start, sp=GREEDY, max_new_tokens=32, eos_id=-1,
                                             cfg=c, dcfg=dcfg),
                           params, prompts, lengths, cache, jax.random.key(0),
                           drafter_params=dparams,
                           draft_cache=init_drafter_cache(c, dcfg, batch, cap))
    programs = {
        "prefill": (functools.partial(prefill, cfg=c), (params, prompts, lengths, cache)),
        "plain_step": (lambda p, st, k, d, c=c: plain_step(p, st, k, GREEDY, -1, c,
                                                           drafter_params=d, dcfg=dcfg),
                       (params, state, jax.random.key(1), dparams)),
        "sd_step": (functools.partial(sd_step, sp=GREEDY, eos_id=-1, strategy=strategy,
                                      cfg=c, dcfg=dcfg),
                    (params, dparams, state, jax.random.key(1))),
    }
    for prog, (fn, args) in programs.items():
      t0 = time.perf_counter()
      jax.jit(fn).lower(*args).compile()
      out[f"{prog}_{name}_s"] = time.perf_counter() - t0
  return out


def plot(result: dict, path: pathlib.Path) -> None:
  rows = result["rows"]
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
  ax1.set_title(f"{result['shape']} on {result['device']}")
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


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                      help="model shape (default: qwen2.5-7b on GPU, small elsewhere)")
  parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
  parser.add_argument("--prompt-len", type=int, default=None,
                      help="cached prompt tokens (default: 1024 on GPU, 256 elsewhere)")
  parser.add_argument("--strategies", nargs="+", default=["8,4,48", "8,4,16", "4,2,8"])
  parser.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[],
                      help="also time SD with these reduced draft vocabularies")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--hf-new-tokens", type=int, default=64)
  parser.add_argument("--no-hf", action="store_true", help="skip transformers")
  parser.add_argument("--compile-times", action="store_true",
                      help="also compile prefill / plain / SD with a loop and with a scan")
  parser.add_argument("--quick", action="store_true", help="tiny settings for smoke tests")
  args = parser.parse_args()
  gpu = jax.default_backend() == "gpu"
  shape = args.shape or ("qwen2.5-7b" if gpu else "small")
  prompt_len = args.prompt_len or (1024 if gpu else 256)
  if args.quick:
    args.batches, args.strategies, args.iters, args.hf_new_tokens = [1, 2], ["3,2,6"], 3, 6
    prompt_len = 32
  with_hf = not args.no_hf and importlib.util.find_spec("torch") is not None
  if not args.no_hf and not with_hf:
    print("torch is not installed: transformers is not measured (pip install torch)")
  cfg = ModelConfig(**SHAPES[shape], max_position_embeddings=32768,
                    dtype="bfloat16" if gpu else "float32",
                    param_dtype="bfloat16" if gpu else "float32")
  strategies = [Strategy.parse(s) for s in args.strategies]
  params = jax.jit(functools.partial(init_params, cfg))(jax.random.key(0))
  dcfg = DrafterConfig()
  dparams = jax.jit(functools.partial(init_drafter_params, cfg, dcfg))(jax.random.key(1))
  drafters = {0: (dcfg, dparams)}
  for vocab in args.draft_vocab_sizes:
    # Random weights: which ids the vocabulary holds does not change the cost.
    d = DrafterConfig(draft_vocab_size=vocab)
    drafters[vocab] = (d, jax.jit(functools.partial(init_drafter_params, cfg, d))(
        jax.random.key(1)))
  result = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
            "jax": jax.__version__, "shape": shape, "model": SHAPES[shape],
            "dtype": cfg.dtype, "prompt_len": prompt_len, "iters": args.iters,
            "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": []}
  args.out.parent.mkdir(parents=True, exist_ok=True)
  for b in args.batches:
    row = bench_batch(cfg, params, drafters, b, prompt_len, strategies, args.iters,
                      with_hf, args.hf_new_tokens)
    result["rows"].append(row)
    sd = ", ".join(f"SD {k} {v['vs_plain_step']:.2f}x" for k, v in row["sd"].items())
    hf = f", transformers {row['hf_ms']:.2f} ms" if "hf_ms" in row else ""
    print(f"B={b}: plain {row['tlt_plain_ms']:.2f} ms (+sync {row['tlt_plain_sync_ms']:.2f}), "
          f"floor {row['floor_ms']:.2f} ms ({row['tlt_vs_floor']:.2f}x){hf}; {sd}", flush=True)
    args.out.write_text(json.dumps(result, indent=2))  # kept current: nothing lost on a crash
  if args.compile_times:
    result["compile_s"] = compile_seconds(cfg, params, dcfg, dparams, args.batches[0],
                                          prompt_len, strategies[0])
    print("compile seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in
                                          result["compile_s"].items()), flush=True)
  args.out.write_text(json.dumps(result, indent=2))
  plot(result, args.out.with_suffix(".png"))
  print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
  main()
