"""Benchmark: one plain decode step against one SD iteration, per batch size and strategy, on
random weights of a named shape (--shape) or on a config's policy, drafters and held-out
prompts (--config FILE[:variant], --set KEY=VALUE). docs/reproducing.md lists the flags.

Per batch size (default 1, 8, 32), with the prompts in the cache, in milliseconds, medians of
--iters one-iteration calls of the engine's `decode_loop` after two warm-up calls, each call
from the previous one's state:

  tlt_plain_ms       a plain step (policy only); tlt_plain_sync_ms: the same step also keeping
                     the EAGLE drafters' caches in step, as the rollout does before SD
  sd[name]           one greedy SD iteration per strategy ('depth,topk,verify[,drafts]') and
                     EAGLE drafter (--drafters random | config | oracle: the policy itself,
                     every draft accepted; --draft-vocab-sizes: random ones with a reduced draft
                     vocabulary and its own head): its time and ratio to the step, accept length,
                     whether its tokens are the plain step's, the decode speedup, and its weight
                     bytes in plain steps (`weight_read_floor`). The suffix drafter copies from a
                     corpus of random responses (its matching costs the same whatever they hold).
  floor_ms           a minimal decoder in plain JAX over the same weights (`floor_decoder`)
  --loop-iterations  every program also N iterations in one call, the programs of a batch
                     alternating, per iteration (`loop_iteration_ms`)
  --shared-shape     each strategy of top-k K also inside the program shaped for (S, K, T), as
                     shared SD programs run it (`padding_cost`: its time over its own program's)

Each program is jitted once per batch size. The prefill that fills the caches is set-up, with
the layers as a scan; the persistent compilation cache is on. With --config the policy runs as
the config says, on one device, with a cache as long as the rollout's. The JSON (run metadata
recorded) is rewritten after every measurement, the PNG after every batch; --time-budget
starts no batch after the first once that many seconds have passed.

  python -m experiments.bench_decode --shape qwen2.5-7b --batches 1 8 --time-budget 480 \
      --out docs/results/decode_h100.json
  python -m experiments.bench_decode --config configs/default.py --drafters random oracle \
      --strategies 4,2,8 3,2,6 6,2,12 --shared-shape 6,2,12 --loop-iterations 48 \
      --batches 1 2 4 --out results/shared_programs/sd_step.json
  python -m experiments.bench_decode --quick --out /tmp/decode.json  # any device; 2 CPUs: ~20 s
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import statistics
import sys
import time

T0 = time.perf_counter()  # --time-budget counts from here

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from .common import (add_config_flags, config_or_exit, run_metadata, strategy_label,
                     write_json)
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.config import ConfigError
from tlt_jax.drafters import (DRAFTERS, Drafter, EagleDrafter, drafters_named, make_drafter,
                              reads_corpus)
from tlt_jax.kernels import ATTENTION_IMPLS
from tlt_jax.models import ModelConfig, init_cache, init_params
from tlt_jax.drafters.eagle.network import (DRAFT_TO_POLICY, DrafterConfig, drafter_from_policy,
                                    init_drafter_params)
from tlt_jax.models.policy import Policy
from tlt_jax.models.shapes import MODEL_SHAPES
from tlt_jax.speculative.decoding import decode_loop, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

GREEDY = SamplingParams(temperature=0.0)
SHAPE_STRATEGIES = ["8,4,48", "8,4,16", "4,2,8"]
EAGLE_VARIANTS = ("random", "config", "oracle")


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


def timed_calls(call, state, iters: int) -> tuple:
  """call(state) -> (state, StepStats, iterations), each call one iteration from the previous
  one's state: (the last state, the median ms of `iters` calls after two warm-up calls, tokens
  emitted per row per call over all calls). No row finishes while being timed."""
  box, accepted = [state], []

  def one():
    box[0], stats, _ = call(box[0])
    accepted.append(stats.accepted)
    jax.block_until_ready(box[0].num_out)
  ms = median_ms(one, iters)
  return box[0], ms, float(np.mean([np.asarray(a).mean() for a in accepted]))


def same_tokens(state, reference: tuple) -> bool:
  """Whether every row's tokens are the reference's (plain decoding's (out [B, N], num_out
  [B]) on the host) as far as both go."""
  out, num_out = reference
  n = int(min(np.min(np.asarray(state.num_out)), np.min(num_out)))
  return bool(np.array_equal(np.asarray(state.out)[:, :n], out[:, :n]))


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


# ---------------------------------------------------------------- what is timed


@dataclasses.dataclass
class SdEntry:
  """One timed SD program: `strategy` drafted by `drafters` (name -> Drafter) in the program
  shaped for `program` (the strategy's own, or a shared shape it runs inside with limits);
  `eagle`: which EAGLE drafter (None without one); `own`: for a shared shape, the entry of
  the strategy's own program."""
  name: str
  strategy: Strategy
  program: Strategy
  drafters: dict
  eagle: str | None
  own: str | None = None

  def limits(self):
    if self.own is None:
      return None
    return jnp.asarray([self.strategy.depth, self.strategy.verify_tokens], jnp.int32)


def sd_entries(strategies: list[Strategy], eagles: dict[str, Drafter], others: dict,
               default: str, shared: Strategy | None) -> list[SdEntry]:
  """Every (strategy, EAGLE drafter) pair to time, each strategy of the shared shape's top-k
  also inside that shape. Named by the strategy, plus the EAGLE drafter's name unless it is
  `default` (and ' in S,K,T' inside a shared shape)."""
  out = []
  for s in strategies:
    for variant in (eagles if "eagle" in s.drafts else [None]):
      drafters = {n: eagles[variant] if n == "eagle" else others[n] for n in s.drafts}
      name = strategy_label(s) + ("" if variant in (None, default) else f" {variant}")
      out.append(SdEntry(name, s, s, drafters, variant))
      if shared is not None and shared.topk == s.topk and shared.depth >= s.depth and \
         shared.verify_tokens >= s.verify_tokens:
        shape = Strategy(shared.depth, shared.topk, shared.verify_tokens, s.drafts)
        out.append(SdEntry(f"{name} in {strategy_label(shape)}", s, shape, drafters, variant,
                           own=name))
  return out


class Programs:
  """Every jitted program of the run, built once per strategy: a new batch size compiles each
  again, a repeat compiles nothing.

  start(params, drafters, prompts [B, P], lengths [B]) -> GenState with the drafters' states
    filled; the layers run as a scan (set-up, not timed).
  decode(program)(params, drafters, state, key, iterations, limits, corpus) -> (state, stats,
    iterations run): `iterations` (a traced int32: any number, one program) plain steps
    (program None; the drafters' states kept in step) or SD iterations in one `decode_loop`
    call, as the engine runs them; state donated.
  floor: see floor_decoder.
  """

  def __init__(self, cfg: ModelConfig, cap: int, max_new: int):
    self.cfg, self._decode = cfg, {}
    self.floor = floor_decoder(cfg)
    scan_cfg = cfg.replace(scan_layers=True)

    def filled(params, drafters, prompts, lengths):
      b = prompts.shape[0]
      states = {n: d.init_state(scan_cfg, b, cap) for n, d in drafters.items()}
      return start(Policy(params, scan_cfg), prompts, lengths, init_cache(scan_cfg, b, cap),
                   jax.random.key(0), GREEDY, max_new, -1, drafters=drafters,
                   draft_states={n: st for n, st in states.items() if st is not None})
    self.start = jax.jit(filled)

  def decode(self, program: Strategy | None):
    if program not in self._decode:
      def fn(params, drafters, state, key, iterations, limits, corpus):
        return decode_loop(Policy(params, self.cfg), drafters, state, key, jnp.int32(1),
                           iterations, GREEDY, -1, program, limits, corpus)
      self._decode[program] = jax.jit(fn, donate_argnums=(2,))
    return self._decode[program]


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


@dataclasses.dataclass
class Bench:
  """What every batch size is measured with.

  prompts: [N, P] int32 right-padded prompts (a batch of b rows takes rows i % N), or None
    for random tokens of prompt_len per batch; cap: cache slots; max_new: output slots (no row
    finishes while being timed); sync: the EAGLE drafters `tlt plain+sync` keeps in step
    ({}: not timed); corpus_rows: responses the suffix drafter may copy from per row."""
  cfg: ModelConfig
  params: dict
  prompts: np.ndarray | None
  lengths: np.ndarray | None
  prompt_len: int
  cap: int
  max_new: int
  entries: list[SdEntry]
  sync: dict
  corpus_rows: int


def batch_prompts(bench: Bench, batch: int) -> tuple[jax.Array, jax.Array]:
  """[batch, P] prompts and [batch] lengths."""
  if bench.prompts is None:
    rng = np.random.default_rng(batch)
    tokens = rng.integers(0, bench.cfg.vocab_size, (batch, bench.prompt_len))
    return jnp.asarray(tokens, jnp.int32), jnp.full((batch,), bench.prompt_len, jnp.int32)
  rows = np.arange(batch) % len(bench.prompts)
  return jnp.asarray(bench.prompts[rows]), jnp.asarray(bench.lengths[rows])


def bench_batch(programs: Programs, bench: Bench, batch: int, iters: int, loop_iterations: int,
                loop_repeats: int, row: dict, save) -> None:
  """Fills `row` with the JAX times of one batch size, calling save() after each one. Every
  array made here dies with this call."""
  cfg, params = bench.cfg, bench.params
  prompts, lengths = batch_prompts(bench, batch)
  key, one = jax.random.key(1), jnp.int32(1)
  corpus = jax.random.randint(jax.random.key(2), (batch, bench.corpus_rows, bench.max_new), 0,
                              cfg.vocab_size)
  # name -> (program, drafters, limits, corpus); name None: the plain step
  calls = {None: (programs.decode(None), {}, None, None)}
  calls.update({e.name: (programs.decode(e.program), e.drafters, e.limits(),
                         corpus if reads_corpus(e.strategy.drafts) else None)
                for e in bench.entries})
  states = {}  # each program's state after its calls, for the loop timing

  def timed(name, drafters=None):
    fn, own, limits, cor = calls[name]
    drafters = own if drafters is None else drafters
    return timed_calls(lambda s: fn(params, drafters, s, key, one, limits, cor),
                       programs.start(params, drafters, prompts, lengths), iters)

  states[None], row["tlt_plain_ms"], _ = timed(None)
  reference = jax.device_get((states[None].out, states[None].num_out))
  save()
  if bench.sync:
    _, row["tlt_plain_sync_ms"], _ = timed(None, bench.sync)
    save()
  row["sd"] = {}
  for e in bench.entries:
    states[e.name], ms, accept = timed(e.name)
    eagle = e.drafters.get("eagle")
    result = {"strategy": list(e.strategy.as_tuple()), "drafter": e.eagle,
              "program": list(e.program.as_tuple()), "iteration_ms": ms,
              "vs_plain_step": ms / row["tlt_plain_ms"], "accept_len": accept,
              "decode_speedup": accept * row["tlt_plain_ms"] / ms,
              "identical_to_plain": same_tokens(states[e.name], reference),
              "draft_vocab_size": (eagle.settings.draft_vocab_size or cfg.vocab_size
                                   if eagle else None),
              "weight_floor_vs_plain_step": (weight_read_floor(cfg, eagle.settings,
                                                               e.strategy.depth)
                                             if eagle else 1.0)}
    if e.own:
      result.update(own=e.own, padding_cost=ms / row["sd"][e.own]["iteration_ms"])
    row["sd"][e.name] = result
    if not loop_iterations:
      del states[e.name]
    save()

  if loop_iterations:
    per_iteration = loop_ms(calls, states, params, key, loop_iterations, loop_repeats)
    row["tlt_plain_loop_ms"] = per_iteration.pop(None)
    for name, ms in per_iteration.items():
      r = row["sd"][name]
      r.update(loop_iteration_ms=ms, loop_vs_plain_step=ms / row["tlt_plain_loop_ms"])
      if "own" in r:
        r["loop_padding_cost"] = ms / row["sd"][r["own"]]["loop_iteration_ms"]
    save()
  states.clear()

  k = jnp.full((cfg.num_layers, batch, cfg.num_kv_heads, prompts.shape[1], cfg.head_dim), 0.01,
               cfg.jnp_dtype)
  tokens = prompts[:, 0]
  floor = programs.floor
  row["floor_ms"] = median_ms(lambda: jax.block_until_ready(floor(params, tokens, k, k)), iters)
  row["tlt_vs_floor"] = row["tlt_plain_ms"] / row["floor_ms"]
  save()


def loop_ms(calls: dict, states: dict, params, key, iterations: int, repeats: int) -> dict:
  """ms per iteration of each program (calls: name -> (program, drafters, limits, corpus))
  as the engine runs them: `iterations` in one decode_loop call, each from its state in
  `states` (replaced as it goes), the programs alternating, the median of `repeats` calls
  each after a warm-up round."""
  most = jnp.int32(iterations)
  times = {name: [] for name in calls}
  for r in range(repeats + 1):
    for name, (fn, drafters, limits, corpus) in calls.items():
      t0 = time.perf_counter()
      states[name], _, done = fn(params, drafters, states[name], key, most, limits, corpus)
      done = int(done)
      if r:
        times[name].append((time.perf_counter() - t0) / max(done, 1))
  return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def plot(result: dict, path: pathlib.Path) -> None:
  """Step times per batch (left), SD iteration / plain step per strategy in its own program
  (middle) and, with a shared shape, the padding cost per batch (right), from the batches
  measured to the end."""
  rows = [r for r in result["rows"] if r.get("complete")]
  if not rows:
    return
  batches = [r["batch"] for r in rows]
  padded = [n for n, v in rows[0]["sd"].items() if "own" in v]
  fig, axes = plt.subplots(1, 3 if padded else 2, figsize=(16 if padded else 11, 4))
  ax1, ax2 = axes[:2]
  series = [("tlt_plain_ms", "tlt_jax plain step"), ("tlt_plain_sync_ms", "+ drafter cache sync"),
            ("floor_ms", "plain-JAX floor")]
  width = 0.8 / len(series)
  for i, (key, label) in enumerate(series):
    if all(key in r for r in rows):
      ax1.bar(np.arange(len(rows)) + i * width, [r[key] for r in rows], width, label=label)
  ax1.set_xticks(np.arange(len(rows)) + 0.4 - width / 2, [f"B={b}" for b in batches])
  ax1.set_ylabel("ms per decode step")
  ax1.set_yscale("log")
  ax1.legend(fontsize=8)
  ax1.set_title(f"{result['model_name']} on {result['device']['device_kind']} "
                f"(attention {result['attention_impl']})", fontsize=9)
  loop = "tlt_plain_loop_ms" in rows[0]
  ratio = "loop_vs_plain_step" if loop else "vs_plain_step"
  for name, v in rows[0]["sd"].items():
    if "own" not in v:
      ax2.plot(batches, [r["sd"][name][ratio] for r in rows], "o-",
               label=f"SD {name} (accept {v['accept_len']:.2f})")
  ax2.axhline(1.0, color="k", lw=0.8)
  ax2.set_xscale("log", base=2)
  ax2.set_xlabel("batch")
  ax2.set_ylabel("SD iteration / plain step" + (" (in a decode loop)" if loop else ""))
  if rows[0]["sd"]:
    ax2.legend(fontsize=7)
  if padded:
    cost = "loop_padding_cost" if loop else "padding_cost"
    width = 0.8 / len(padded)
    for i, name in enumerate(padded):
      axes[2].bar(np.arange(len(rows)) + (i - (len(padded) - 1) / 2) * width,
                  [r["sd"][name][cost] for r in rows], width, label=name)
    axes[2].axhline(1.0, color="k", lw=0.8)
    axes[2].set_xticks(np.arange(len(rows)), [f"batch {b}" for b in batches])
    axes[2].set_ylabel("iteration time, shared / own program (x)")
    axes[2].set_title("padding cost of a shared SD program", fontsize=9)
    axes[2].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------- set-up


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, type=pathlib.Path, help="JSON output path")
  parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default=None,
                      help="model shape with random weights (default without --config: "
                           "qwen2.5-7b on GPU, small elsewhere)")
  add_config_flags(parser, default=None)
  parser.add_argument("--batches", type=int, nargs="+", default=None,
                      help="batch sizes (default 1 8 32)")
  parser.add_argument("--prompt-len", type=int, default=None,
                      help="random prompt tokens with --shape (default: 1024 on GPU, 256 "
                           "elsewhere)")
  parser.add_argument("--strategies", nargs="*", default=None,
                      help="'depth,topk,verify[,drafts]' each (default: the config's arms, "
                           f"or {' '.join(SHAPE_STRATEGIES)}); none: plain steps only")
  parser.add_argument("--drafters", nargs="+", choices=EAGLE_VARIANTS, default=None,
                      help="the EAGLE drafters of the strategies that draft with it (default: "
                           "config with --config, else random)")
  parser.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[],
                      help="also time SD with random EAGLE drafters of these reduced draft "
                           "vocabularies")
  parser.add_argument("--shared-shape", default=None, metavar="S,K,T",
                      help="also run each strategy of top-k K in the program shaped for "
                           "(S, K, T), as shared SD programs do")
  parser.add_argument("--attention-impl", choices=ATTENTION_IMPLS, default=None,
                      help="attention of the policy and so of the drafter, whose layers "
                           "follow the policy's config (default: the config's, or auto)")
  parser.add_argument("--iters", type=int, default=20)
  parser.add_argument("--loop-iterations", type=int, default=0, metavar="N",
                      help="also time every program as N iterations in one decode_loop call")
  parser.add_argument("--loop-repeats", type=int, default=5)
  parser.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                      help="start no batch after the first once this many seconds have passed "
                           "since the script started (0 = no limit)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke run on any device: 3 iterations, shape 'small' and 32 prompt "
                           "tokens without --config, batch 1 and strategy 3,2,6 unless given")
  args = parser.parse_args(argv)
  if args.shape and args.config:
    parser.error("give --shape (random weights) or --config (a config's policy), not both")
  if "config" in (args.drafters or []) and not args.config:
    parser.error("--drafters config needs --config")
  if args.quick:
    args.iters, args.prompt_len = 3, 32
    args.shape = None if args.config else "small"
    args.batches = args.batches or [1]
    args.strategies = ["3,2,6"] if args.strategies is None else args.strategies
  args.batches = args.batches or [1, 8, 32]
  for s in [*(args.strategies or []), *([args.shared_shape] if args.shared_shape else [])]:
    try:
      Strategy.parse(s)
    except ValueError as e:
      parser.error(f"strategy {s!r}: {e}")
  if args.attention_impl == "pallas" and jax.default_backend() != "gpu":
    parser.error(f"--attention-impl pallas needs a GPU (backend here: "
                 f"{jax.default_backend()}); pallas_interpret runs the kernel on CPU")
  if args.time_budget < 0:
    parser.error(f"--time-budget must be >= 0 seconds, got {args.time_budget}")
  if args.loop_iterations < 0 or args.loop_repeats < 1:
    parser.error("--loop-iterations must be >= 0 and --loop-repeats >= 1")
  return args


def random_drafter(name: str, settings, cfg: ModelConfig, seed: int) -> Drafter:
  """Drafter `name` with `settings` and, for a trained family, random weights (drawn with the
  "rbg" generator, which compiles in half the time of the default one)."""
  cls = DRAFTERS[name]
  if not cls.trained:
    return make_drafter(name, settings)
  params = jax.jit(functools.partial(cls.init_params, settings, cfg))(
      jax.random.key(seed, impl="rbg"))
  return make_drafter(name, settings, params)


def load_model(args, gpu: bool) -> tuple:
  """(cfg, params, prompts, lengths, prompt_len, eagle settings, the config or None, what the
  model is): the config's policy and held-out prompts, or random weights of a named shape
  (whose values do not change the cost) and random prompts."""
  if not args.config:
    shape = args.shape or ("qwen2.5-7b" if gpu else "small")
    cfg = ModelConfig(**MODEL_SHAPES[shape], dtype="bfloat16" if gpu else "float32",
                      param_dtype="bfloat16" if gpu else "float32",
                      attention_impl=args.attention_impl or "auto")
    params = jax.jit(functools.partial(init_params, cfg))(jax.random.key(0, impl="rbg"))
    return (cfg, params, None, None, args.prompt_len or (1024 if gpu else 256),
            DrafterConfig(), None, shape)
  from tlt_jax.components import (drafter_settings, load_policy, load_tokenizer_for,
                                  task_prompts)
  from tlt_jax.mesh import make_mesh
  sets = [*args.set, *([f"model.attention_impl={args.attention_impl}"]
                       if args.attention_impl else [])]
  config = config_or_exit(args.config, sets)
  try:
    cfg, params = load_policy(config, make_mesh({"replica": 1, "fsdp": 1, "tensor": 1},
                                                 jax.devices()[:1]))
    _, ids = task_prompts(config, load_tokenizer_for(config), max(args.batches),
                          eval_split=True)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  lengths = np.asarray([len(p) for p in ids], np.int32)
  prompts = np.zeros((len(ids), int(lengths.max())), np.int32)
  for i, p in enumerate(ids):
    prompts[i, :len(p)] = p
  return (cfg, params, prompts, lengths, prompts.shape[1], drafter_settings(config, "eagle"),
          config, pathlib.Path(config.model.path).name if config.model.path else
          f"random {args.config}")


def load_drafters(args, cfg, params, settings, config, strategies) -> tuple[dict, dict]:
  """(EAGLE drafters by variant name, the other drafters the strategies name by name)."""
  from tlt_jax.components import load_drafters_for
  eagles = {}
  if "eagle" in drafters_named(strategies):
    for variant in args.drafters or ["config" if config else "random"]:
      if variant == "config":
        eagles[variant] = load_drafters_for(config, cfg, names=("eagle",))["eagle"]
      elif variant == "oracle":
        dcfg, dparams = drafter_from_policy(cfg, params)
        eagles[variant] = EagleDrafter(dparams, dcfg)
      else:
        eagles[variant] = random_drafter("eagle", settings, cfg, 1)
    for vocab in args.draft_vocab_sizes:
      # Which ids the vocabulary holds does not change the cost either.
      eagles[f"r={vocab}"] = random_drafter(
          "eagle", dataclasses.replace(settings, draft_vocab_size=vocab), cfg, 1)
  names = [n for n in drafters_named(strategies) if n != "eagle"]
  if config:
    others = load_drafters_for(config, cfg, names=names)
  else:
    others = {n: random_drafter(n, DRAFTERS[n].Settings(), cfg, 2) for n in names}
  return eagles, others


def main(argv=None):
  args = parse_args(argv)
  gpu = jax.default_backend() == "gpu"
  cache_dir = enable_compilation_cache()
  cfg, params, prompts, lengths, prompt_len, settings, config, model_name = load_model(args, gpu)
  if args.strategies is None:
    args.strategies = (list(config.rollout.speculative.arms) if config else SHAPE_STRATEGIES)
  strategies = [Strategy.parse(s) for s in args.strategies]
  shared = Strategy.parse(args.shared_shape) if args.shared_shape else None
  try:
    eagles, others = load_drafters(args, cfg, params, settings, config, strategies)
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  most = max([s.depth for s in strategies] + [0]) + 1
  # EOS is off and no row finishes while being timed.
  max_new = (args.iters + 4 + (args.loop_repeats + 1) * args.loop_iterations) * most + 2
  cap = prompt_len + max_new + most
  if config:  # at least the rollout's cache: attention reads every slot
    cap = max(cap, config.rollout.max_prompt_len + config.rollout.max_new_tokens)
  cap = -(-cap // 64) * 64
  default = "config" if config else "random"
  bench = Bench(cfg, params, prompts, lengths, prompt_len, cap, max_new,
                sd_entries(strategies, eagles, others, default, shared),
                {"eagle": next(iter(eagles.values()))} if eagles else {},
                config.rollout.speculative.corpus_rows if config else 8)
  programs = Programs(cfg, cap, max_new)

  result = {**run_metadata(), "model_name": model_name,
            "shape": None if config else model_name,
            "model": MODEL_SHAPES[model_name] if not config else str(config.model.path),
            "config": args.config, "sets": args.set, "dtype": cfg.dtype,
            "attention_impl": cfg.attention_impl, "prompt_len": prompt_len, "cache_slots": cap,
            "iters": args.iters, "batches": args.batches, "strategies": args.strategies,
            "drafters": list(eagles), "shared_shape": args.shared_shape,
            "loop_iterations": args.loop_iterations or None,
            "compilation_cache": cache_dir,
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
    bench_batch(programs, bench, b, args.iters, args.loop_iterations, args.loop_repeats, row,
                save)
    row["complete"] = True
    save()
    plot(result, png)
    sd = ", ".join(f"SD {k} {v['vs_plain_step']:.2f}x accept {v['accept_len']:.2f}"
                   + (f" (padding {v['padding_cost']:.2f}x)" if "own" in v else
                      f" (weights {v['weight_floor_vs_plain_step']:.2f}x)")
                   for k, v in row["sd"].items())
    sync = (f" (+sync {row['tlt_plain_sync_ms']:.2f})" if "tlt_plain_sync_ms" in row else "")
    print(f"B={b}: plain {row['tlt_plain_ms']:.2f} ms{sync}, floor {row['floor_ms']:.2f} ms "
          f"({row['tlt_vs_floor']:.2f}x); {sd}", flush=True)
  result["wall_s"] = time.perf_counter() - T0
  save()
  plot(result, png)
  print(f"wrote {args.out} and {png} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
  main()
