"""The decode benchmark: the rollout engine's own decode programs (plain and SD,
`SlicePrograms.decode`, i.e. `decode_loop`) timed per call and per iteration at several row
counts, a `jax.profiler` trace of one call of each reduced to a table on the spot, the compiled
programs' operation counts, XLA flag variants of the plain call, and (--peer) transformers
decoding the same shape on the same device.

  python -m experiments.profile_decode --out results/profile_decode          # headline config
  python -m experiments.profile_decode --out /tmp/profile --quick            # CI: seconds
  python -m experiments.profile_decode --out $OUT --peer --time-budget 110   # a GPU lease
  python -m experiments.profile_decode --out results/decode_7b --weights random --shape \
      qwen2.5-7b --set model.dtype=bfloat16 --set model.param_dtype=bfloat16 --batches 1 8

Per row count (default 1, 8, 32, 128) and program (plain; each SD arm, --arms or the config's,
at the row counts where the config runs SD, rollout.sd_threshold and below), from the same
prompts:

  timing      calls of 1 and of N (--iterations) iterations through `SlicePrograms.decode`,
              the median of --repeats each after a warm-up: per iteration (t_N - t_1) / (N - 1)
              and the fixed cost of a call t_1 - that (dispatch, argument transfers, the
              loop's set-up and the result's sync); the same call also through the compiled
              executable directly (`exe_*`: without the engine's argument placement); tokens
              per row per iteration (an SD arm's accept length, the bonus token included)
  SD          per arm against plain at the same rows: its iteration's time over plain's
              (`vs_plain`), the decode speedup its tokens per iteration give, whether its
              tokens are plain's (greedy only: rollout.temperature=0), and its weight bytes in
              plain iterations (`weight_read_floor`: the least it costs where weights bind)
  trace       one N-iteration call of each under jax.profiler, reduced here
              (`tlt_jax.profiling.call_table`): launches per iteration, busy and idle time
              (idle: nothing ran on the device), gaps between ops, the top ops by time. On a
              GPU these are kernels; XLA runs a traced program op by op, without its command
              buffers, so the trace shows every launch. On a CPU they are XLA:CPU's ops.
  op counts   per iteration and per call, from the compiled program's HLO
              (`tlt_jax.hlo_counts`): operations, fusions, custom calls, copies (of the KV
              cache or of a weight, by shape), sorts, while loops, collectives, host transfers
  variants    the plain program at --flag-batches under each --flags set of XLA flags, each in
              its own process (XLA reads its flags once); GPU-only flags are skipped on a CPU
  peer        (--peer) transformers `generate` of the same architecture and shape, random
              weights, the same prompt length, a static cache as long as the engine's, eager and
              (on GPU, or --peer-compile on) under torch.compile; tokens/s = rows / step

The model: the config's (default configs/smollm2.py:gpu_headline) policy and drafters where
its model folder exists, else (--weights random) random weights of --shape with the config's
drafters (the shipped EAGLE drafter reads any weights of its policy's shape); --oracle: the
policy itself as the EAGLE drafter, every draft accepted under greedy decoding (the bound on
accept length, at a drafter as costly as the policy). Prompts are random tokens of
rollout.max_prompt_len, EOS is off and no row finishes while timed. Cost does not depend on
the weights, accept lengths do: with random weights they mean nothing.

Targets (written in the JSON, checked only on a GPU, None elsewhere): a plain iteration at 128
rows at most 2x the 1-row one; an SD iteration at 1 row at most 1.3 plain iterations, per arm;
tlt_jax's plain tokens/s at least transformers + torch.compile's at every row count.

Outputs in --out: profile_decode.json (rewritten after every measurement), profile_decode.png,
and the raw trace of the 1-row plain call (trace_plain_1.xplane.pb) when it is under 16 MiB.
The table printed at the end is the same on a CPU and a GPU. --time-budget starts no part
(program, peer batch, flag variant) once that many seconds have passed. This script replaces
bench_decode.py (`git show d582ece:experiments/bench_decode.py`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import time
import warnings

T0 = time.perf_counter()  # --time-budget counts from here

import jax
import numpy as np

from .common import (REPO, config_or_exit, module_command, pyplot, run_metadata,
                     save_figure, strategy_label, usable_cpus, write_json)
from tlt_jax import hlo_counts, profiling
from tlt_jax.compile_cache import enable_compilation_cache
from tlt_jax.config import ConfigError
from tlt_jax.models import ModelConfig, init_params
from tlt_jax.models.shapes import MODEL_SHAPES

CONFIG = f"{REPO / 'configs' / 'smollm2.py'}:gpu_headline"
QUICK_CONFIG = str(REPO / "configs" / "default.py")
# XLA flag sets that cut launch cost inside a while loop on a GPU (jax 0.11.2's XLA knows
# them; XLA aborts a process on a flag it does not know, so each runs in its own):
#   no_command_buffers   every op launched one by one: what the default command buffers give
#   while_in_graph       the whole decode loop, condition included, in one CUDA graph with
#                        conditional nodes: no host round trip per iteration
#   while_in_graph_min1  the same with graphs of any size
FLAG_SETS = {
    "no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "while_in_graph": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
    "while_in_graph_min1": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL "
                           "--xla_gpu_graph_min_graph_size=1",
}
DEFAULT_FLAGS = ("no_command_buffers", "while_in_graph")
RAW_TRACE_LIMIT = 16 * 2**20
# The defaults that --quick changes: flag -> (default, --quick's).
DEFAULTS = {"config": (CONFIG, QUICK_CONFIG), "batches": ([1, 8, 32, 128], [1, 4]),
            "iterations": (32, 4), "repeats": (5, 2), "peer_new_tokens": (32, 8)}
TARGETS = {"plain_128_vs_1": 2.0, "sd_1_vs_plain_1": 1.3, "plain_vs_peer_compiled": 1.0}


# ---------------------------------------------------------------- the model and programs


def load(args):
  """(config, cfg, params, drafters by name, what the weights are, the mesh, the SD arms): the
  config's policy and the drafters of the arms, or random weights of --shape; --oracle: the
  policy itself as the EAGLE drafter."""
  from tlt_jax.components import load_drafters_for, load_policy
  from tlt_jax.drafters import EagleDrafter, drafters_named
  from tlt_jax.drafters.eagle.network import drafter_from_policy
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models.shapes import with_model_shape
  config = config_or_exit(args.config, args.set)
  weights = args.weights
  if weights == "auto":
    weights = "config" if not config.model.path or os.path.isdir(config.model.path) else "random"
  what = config.model.path or "random weights of the config's model section"
  if weights == "random" and config.model.path:
    config, what = with_model_shape(config, args.shape), f"random weights of {args.shape}"
  if args.layers and config.model.path:
    sys.exit(f"--layers {args.layers} cuts a model of random weights: add --weights random")
  if args.layers:
    with config.unlocked():
      config.model.num_layers = args.layers
    what = f"{what}, {args.layers} layers"
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  arms = arms_of(args, config)
  oracle = args.oracle and "eagle" in drafters_named(arms)
  try:
    cfg, params = load_policy(config, mesh)
    drafters = load_drafters_for(config, cfg, names=[n for n in drafters_named(arms)
                                                     if not (oracle and n == "eagle")])
  except ConfigError as e:
    sys.exit(f"config error: {e}")
  if oracle:
    dcfg, dparams = drafter_from_policy(cfg, params)
    drafters["eagle"] = EagleDrafter(dparams, dcfg)
    what = f"{what}, the policy as its EAGLE drafter (oracle)"
  return config, cfg, params, drafters, str(what), mesh, arms


def arms_of(args, config) -> list:
  """The SD arms measured (Strategy): --arms, else the config's where SD is on (--quick: its
  first); none in a flag variant's process."""
  from tlt_jax.speculative.strategy import Strategy
  if args.variant_of:
    return []
  if args.arms is not None:
    return [Strategy.parse(a) for a in args.arms]
  arms = config.rollout.speculative.arms if config.rollout.speculative.enable else ()
  return [Strategy.parse(a) for a in arms][:1 if args.quick else None]


class Bench:
  """The engine's programs of one slice, compiled ahead on every CPU, and fresh states."""

  def __init__(self, config, cfg, params, drafters, mesh, batches, plan, seed=0):
    from tlt_jax.components import sampling_params
    from tlt_jax.rollout.pool import ExecutablePool, set_compile_threads, \
        wait_for_compiles_ahead
    from tlt_jax.rollout.programs import SlicePrograms
    r = config.rollout
    self.cfg, self.params, self.drafters = cfg, params, drafters
    self.sp = sampling_params(config)
    self.max_new = r.max_new_tokens
    self.capacity = -(-(r.max_prompt_len + r.max_new_tokens) // 64) * 64  # the engine's
    self.prompt_len = r.max_prompt_len
    self.pool = ExecutablePool()
    self.progs = SlicePrograms(0, mesh, self.pool, cfg,
                               {n: d.replace(params=None) if d.trained else d
                                for n, d in drafters.items()},
                               self.capacity, self.max_new, -1, tuple(config.mesh.rollout_rules),
                               log_features=False)
    self.key = jax.random.key(seed)
    most = max(batches)
    rng = np.random.default_rng(seed)
    self.prompts = rng.integers(0, cfg.vocab_size, (most, self.prompt_len)).astype(np.int32)
    t0 = time.perf_counter()
    set_compile_threads(usable_cpus())
    base = self.progs.start_ahead(params, drafters, most, most, self.prompt_len, self.key,
                                  self.sp)
    plain = base.replace(drafts={})
    for b in batches:  # the pool keys `take` by its shapes: one for both kinds of state
      self.progs.take_ahead(base, b)
    self.progs.decode_ahead(params, drafters, base, self.key, self.sp,
                            [(b, s) for b, s in plan if s is not None])
    self.progs.decode_ahead(params, {}, plain, self.key, self.sp,
                            [(b, s) for b, s in plan if s is None])
    wait_for_compiles_ahead()
    self.compile_wall_s = time.perf_counter() - t0
    arange = np.arange(most, dtype=np.int32)
    self.base = self.progs.start(params, drafters, self.prompts,
                                 np.full(most, self.prompt_len, np.int32), arange, arange,
                                 self.key, self.sp)

  def fresh(self, batch: int, strategy):
    """A new state of the first `batch` rows (the drafters' states only for SD)."""
    state = self.progs.take_rows(self.base, np.arange(batch, dtype=np.int32))
    return state if strategy is not None else state.replace(drafts={})

  def with_room(self, state, batch: int, strategy, iterations: int):
    """`state`, or a fresh one (ready) where `iterations` more could run out of output slots:
    no row finishes while timed."""
    per_token = strategy.depth + 1 if strategy else 1
    if int(np.asarray(state.num_out).max()) + iterations * per_token <= self.max_new:
      return state
    return jax.block_until_ready(self.fresh(batch, strategy))

  def call(self, strategy):
    """call(state, iterations) -> (state, stats, iterations run), through the engine."""
    drafters = self.drafters if strategy is not None else {}
    return lambda state, n: self.progs.decode(self.params, drafters, state, self.key, self.sp,
                                              strategy, 1, n)


# ---------------------------------------------------------------- transformers (--peer)


def hf_model(cfg: ModelConfig, device: str, dtype):
  """A transformers causal LM of cfg's architecture (model_type: qwen2, llama, qwen3) and
  shape with random weights, built in `dtype` on `device`, in eval mode."""
  import torch
  from transformers import AutoConfig, AutoModelForCausalLM
  hf_cfg = AutoConfig.for_model(
      cfg.model_type, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
      intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_position_embeddings)
  torch.manual_seed(0)
  # Built in the target dtype: a 7B model built in float32 first would need 30 GB on the GPU.
  default_dtype = torch.get_default_dtype()
  torch.set_default_dtype(dtype)
  try:
    with torch.device(device):
      return AutoModelForCausalLM.from_config(hf_cfg).eval()
  finally:
    torch.set_default_dtype(default_dtype)


def peer_row(cfg: ModelConfig, batch: int, prompt_len: int, cache_len: int, new_tokens: int,
             compiled: bool, dtype_name: str) -> dict:
  """transformers' greedy decode at `batch` rows of a random model of cfg's shape in
  `dtype_name` with a static cache of `cache_len` slots (allocated once, reset before each
  call, so its shapes never change): ms per step ((time of `new_tokens` new tokens - time of
  1) / (new_tokens - 1), the best of three) and tokens/s, or why not. compiled: the decode
  steps under torch.compile (generate's own, mode 'reduce-overhead': CUDA graphs on a GPU),
  compiled in the untimed first calls (`warmup_s`)."""
  import torch
  from transformers import StaticCache
  from transformers.generation import CompileConfig
  device = "cuda" if torch.cuda.is_available() else "cpu"
  sync = torch.cuda.synchronize if device == "cuda" else lambda: None
  options = {"disable_compile": True}
  if compiled:
    config = CompileConfig()
    config._compile_all_devices = device != "cuda"  # generate compiles on GPUs only otherwise
    options = {"compile_config": config}

  def gen(n):
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode(), warnings.catch_warnings():
      # transformers 5.25 renames past_key_values to cache; 5.17 (the GPU image) knows only it.
      warnings.simplefilter("ignore", FutureWarning)
      cache.reset()  # its tensors were made in inference mode: reset there
      model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                     pad_token_id=0, eos_token_id=None, past_key_values=cache, **options)
    sync()
    return time.perf_counter() - t0
  try:
    model = hf_model(cfg, device, getattr(torch, dtype_name))
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device=device)
    cache = StaticCache(config=model.config, max_cache_len=cache_len)
    t0 = time.perf_counter()
    gen(4)
    gen(new_tokens)  # under `compiled`, the step compiles here (and is captured in a graph)
    warmup_s = time.perf_counter() - t0
    one = min(gen(1) for _ in range(3))
    step_ms = (min(gen(new_tokens) for _ in range(3)) - one) / (new_tokens - 1) * 1e3
  except Exception as e:  # noqa: BLE001 -- a peer that fails is a finding, not a crash
    return {"status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  finally:
    model = cache = None  # dropped, so that empty_cache can return their memory
    if device == "cuda":
      torch.cuda.empty_cache()  # the next batch's JAX programs need the memory back
  if step_ms <= 0:  # N tokens took no longer than 1: a busy host's noise
    return {"status": f"no result: {new_tokens} tokens took no longer than 1 (noise)"}
  return {"status": "ok", "step_ms": step_ms, "tokens_per_s": batch / step_ms * 1e3,
          "warmup_s": warmup_s, "dtype": dtype_name, "cache": f"static {cache_len}"}


# ---------------------------------------------------------------- measurements


def time_program(bench: Bench, batch: int, strategy, iterations: int, repeats: int) -> tuple:
  """Calls of 1 and of `iterations` iterations, through the engine and through the compiled
  executable called directly with its arguments already on the device (`exe_*`: the call's
  cost without the engine's argument placement): (medians (ms), per iteration and fixed per
  call, and tokens emitted per row per iteration; the last state). A state about to run out
  of output slots is replaced by a fresh one between calls (not timed)."""
  from tlt_jax.drafters import reads_corpus
  exe, put = bench.progs.decode_executable(batch, strategy, bench.sp), bench.progs.put
  drafters = bench.drafters if strategy is not None else {}
  # A suffix drafter's responses to copy from: none (-1), as the engine passes without any.
  corpus = (put(np.full((batch, bench.progs.corpus_rows, bench.max_new), -1, np.int32)),) \
      if strategy is not None and reads_corpus(strategy.drafts) else ()
  scalars = {n: (put(np.int32(1)), put(np.int32(n)), put(np.float32(bench.sp.temperature)),
                 *corpus) for n in (1, iterations)}
  calls = {"": bench.call(strategy),
           "exe_": lambda state, n: exe(bench.params, drafters, state, bench.key, *scalars[n])}
  box, ran, tokens, out = [bench.fresh(batch, strategy)], [], [], {}

  def timed(call, n) -> float:
    box[0] = bench.with_room(box[0], batch, strategy, n)
    before = np.asarray(box[0].num_out)  # ready: with_room read it
    t0 = time.perf_counter()
    box[0], _, done = call(box[0], n)
    jax.block_until_ready(box[0].num_out)
    ran.append(int(done))
    elapsed = time.perf_counter() - t0
    tokens.append((np.asarray(box[0].num_out) - before).mean() / max(ran[-1], 1))
    return elapsed
  for prefix, call in calls.items():
    for name, n in (("call_1_ms", 1), ("call_n_ms", iterations)):
      warmup = 2 if n == 1 and not prefix else 1
      times = [timed(call, n) for _ in range(repeats + warmup)]
      out[prefix + name] = float(np.median(times[warmup:]) * 1e3)
    if not prefix:
      out["min_iterations_run"] = min(ran[-repeats:])
  out["iterations"] = iterations
  out["iteration_ms"] = (out["call_n_ms"] - out["call_1_ms"]) / max(iterations - 1, 1)
  out["fixed_ms"] = out["call_1_ms"] - out["iteration_ms"]
  out["tokens_per_iteration"] = float(np.mean(tokens))
  return out, box[0]


def against_plain(plain: dict, timing: dict, state, reference, greedy: bool) -> dict:
  """An SD arm's iteration against plain's entry at the same rows: its time over plain's, the
  decode speedup its tokens per iteration give, and (greedy only, else None) whether its
  tokens are plain's (`reference`: (out [B, N], num_out [B]) on the host) as far as both go."""
  p, ms = plain.get("timing", {}).get("iteration_ms"), timing.get("iteration_ms")
  out = {"identical_to_plain": None}
  if (p or 0) > 0 and (ms or 0) > 0:  # t_N - t_1 can be noise on a busy host
    out.update(vs_plain=ms / p, decode_speedup=timing["tokens_per_iteration"] * p / ms)
  if greedy and reference is not None:
    n = int(min(np.asarray(state.num_out).min(), reference[1].min()))
    out["identical_to_plain"] = bool(np.array_equal(np.asarray(state.out)[:, :n],
                                                    reference[0][:, :n]))
  return out


def weight_read_floor(cfg: ModelConfig, dcfg, passes: int) -> float:
  """An SD iteration's weight bytes over a plain step's (dcfg: the EAGLE drafter's
  DrafterConfig): verification reads the policy's weights once, like a step (all but the
  embedding table, of which it gathers rows; a tied table is read as the head), and each of
  the `passes` drafter passes reads the drafter's weights and a head (its own with a reduced
  draft vocabulary, else the policy's). KV-cache and activation bytes are left out. At equal
  bandwidth this is the least an iteration can cost, in plain steps, when decode is bound by
  reading weights."""
  from tlt_jax.drafters.eagle.network import DRAFT_TO_POLICY, init_drafter_params

  def sizes(init, *a):
    tree = jax.eval_shape(lambda key: init(*a, key), jax.random.key(0))
    return {jax.tree_util.keystr(p): int(np.prod(x.shape))
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  policy, drafter = sizes(init_params, cfg), sizes(init_drafter_params, cfg, dcfg)
  table = policy["['embed']['embedding']"]
  step = sum(policy.values()) - (0 if cfg.tie_embeddings else table)
  head = 0 if dcfg.draft_vocab_size else policy.get("['lm_head']['kernel']", table)
  index = jax.tree_util.keystr((jax.tree_util.DictKey(DRAFT_TO_POLICY),))  # ids, not weights
  drafter_pass = sum(v for k, v in drafter.items() if k != index) + head
  return 1.0 + passes * drafter_pass / step


def trace_program(bench: Bench, batch: int, strategy, iterations: int, folder: pathlib.Path
                  ) -> tuple[dict, str]:
  """One call of `iterations` iterations under jax.profiler, reduced: (call_table, the trace
  file)."""
  call = bench.call(strategy)
  state = bench.fresh(batch, strategy)
  jax.block_until_ready(state.num_out)
  folder.mkdir(parents=True, exist_ok=True)
  with jax.profiler.trace(str(folder)):
    state, _, done = call(state, iterations)
    jax.block_until_ready(state.num_out)
  path = profiling.latest_trace(str(folder))
  return profiling.call_table(profiling.call_events(path), int(done)), path


def count_ops(bench: Bench, batch: int, strategy) -> dict:
  """`hlo_counts.decode_loop_counts` of the compiled program, copies of the KV cache and of
  the weights told by their shapes."""
  exe = bench.progs.decode_executable(batch, strategy, bench.sp)
  cache = bench.base.cache.k.shape
  big = {"kv_cache": {(cache[0], batch, *cache[2:])}, "weights": weight_shapes(bench.params)}
  return hlo_counts.decode_loop_counts(exe.as_text(), big)


def weight_shapes(params) -> set[tuple]:
  """The shapes of the weights and of one layer's slice of each stacked one (what a copy of a
  weight looks like in a compiled program); vectors left out (norms, biases)."""
  shapes = set()
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if x.ndim >= 2:
      shapes.add(tuple(x.shape))
      if "layers" in jax.tree_util.keystr(path) and x.ndim >= 3:
        shapes.add(tuple(x.shape[1:]))
  return shapes


def run_variant(name: str, flags: str, args, out: pathlib.Path) -> dict:
  """The plain program at --flag-batches in a process of its own with `flags` added to
  XLA_FLAGS: {'flags', 'status', 'rows': {batch: timing}}."""
  if jax.default_backend() != "gpu" and all(f.startswith("--xla_gpu_")
                                            for f in flags.split()):
    return {"flags": flags, "status": f"skipped: GPU-only flags on {jax.default_backend()}"}
  path = out / f".variant_{name}.json"
  argv = ["--out", str(out / f".variant_{name}"), "--variant-of", str(path), "--config",
          args.config, "--weights", args.weights, "--shape", args.shape, "--layers", args.layers,
          "--iterations", args.iterations, "--repeats", args.repeats, "--batches",
          *args.flag_batches, *[a for kv in args.set for a in ("--set", kv)]]
  env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip())
  t0 = time.perf_counter()
  done = subprocess.run(module_command("profile_decode", *argv), cwd=REPO, env=env,
                        capture_output=True, text=True)
  result = {"flags": flags, "wall_s": time.perf_counter() - t0}
  if done.returncode or not path.is_file():
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {**result, "status": f"failed (exit {done.returncode}): {tail}"}
  import json
  rows = json.loads(path.read_text())["rows"]
  path.unlink()
  shutil.rmtree(out / f".variant_{name}", ignore_errors=True)
  return {**result, "status": "ok", "rows": {r["batch"]: r["plain"]["timing"] for r in rows}}


# ---------------------------------------------------------------- targets, table, plot


def check_targets(result: dict) -> list[dict]:
  """The GPU targets with what was measured; 'pass' is None off a GPU or where a figure is
  missing."""
  gpu = result["device"]["platform"] == "gpu"
  rows = {r["batch"]: r for r in result["rows"]}

  def plain(b):
    return rows.get(b, {}).get("plain", {}).get("timing", {}).get("iteration_ms")
  out = []

  def add(name, measured, limit, what, higher_is_better=False):
    ok = None
    if gpu and measured is not None:
      ok = measured >= limit if higher_is_better else measured <= limit
    out.append({"name": name, "what": what, "limit": limit, "measured": measured, "pass": ok})
  p1, p128 = plain(1), plain(128)
  add("plain_128_vs_1", p128 / p1 if p1 and p128 else None, TARGETS["plain_128_vs_1"],
      "plain iteration at 128 rows / at 1 row")
  for arm, sd in rows.get(1, {}).get("sd", {}).items():
    ms = sd.get("timing", {}).get("iteration_ms")
    add(f"sd_1_vs_plain_1 {arm}", ms / p1 if ms and p1 else None, TARGETS["sd_1_vs_plain_1"],
        f"SD iteration ({arm}) at 1 row / plain iteration at 1 row")
  for b, r in rows.items():
    peer = result.get("peer", {}).get("rows", {}).get(str(b), {}).get("compiled", {})
    mine = r.get("plain", {}).get("tokens_per_s")
    theirs = peer.get("tokens_per_s")
    add(f"plain_vs_peer_compiled {b}", mine / theirs if mine and theirs else None,
        TARGETS["plain_vs_peer_compiled"],
        f"tlt_jax plain tokens/s / transformers + torch.compile's at {b} rows",
        higher_is_better=True)
  return out


def table(result: dict) -> str:
  """The printed summary: per program its timing, tokens, launches and idle time per
  iteration, its op counts per iteration and the top ops of its trace; each SD arm against
  plain; then variants, peer and targets."""
  lines = [f"{result['model']} on {result['device']['device_kind']} "
           f"({result['device']['platform']}), {result['dtype']}, cache {result['capacity']}"]
  lines.append(f"{'program':<18}{'rows':>5}{'iter ms':>9}{'fixed ms':>9}{'exe fixed':>10}"
               f"{'tok/it':>7}{'launch/it':>10}{'idle/it ms':>11}{'ops/it':>8}"
               f"{'copies/it':>10}{'whiles/it':>10}")
  tops, arms = [], []
  for r in result["rows"]:
    for name, p in [("plain", r.get("plain"))] + list(r.get("sd", {}).items()):
      if not p:
        continue
      t, tr = p.get("timing", {}), p.get("trace", {})
      c = p.get("op_counts", {}).get("per_iteration", {})
      exe_fixed = (t["exe_call_1_ms"] - t["iteration_ms"]) if "exe_call_1_ms" in t else None
      lines.append(
          f"{name:<18}{r['batch']:>5}{_f(t.get('iteration_ms'), 9)}{_f(t.get('fixed_ms'), 9)}"
          f"{_f(exe_fixed, 10)}{_f(t.get('tokens_per_iteration'), 7, 2)}"
          f"{_f(tr.get('launches_per_iteration'), 10, 1)}"
          f"{_f(tr.get('idle_ms_per_iteration'), 11)}{_f(c.get('ops'), 8, 0)}"
          f"{_f(c.get('copies'), 10, 0)}{_f(c.get('while_loops'), 10, 0)}")
      if tr.get("top"):
        tops.append((name, r["batch"], tr))
      if "vs_plain" in p:
        same = {True: "yes", False: "NO", None: "not checked"}[p["identical_to_plain"]]
        arms.append(f"{name} at {r['batch']} rows: {p['vs_plain']:.2f}x plain's iteration "
                    f"(weight floor {p['weight_floor_vs_plain']:.2f}x), decode speedup "
                    f"{p['decode_speedup']:.2f}x, plain's tokens: {same}")
  lines += arms
  for name, b, tr in tops[:1] + tops[-1:] if len(tops) > 1 else tops:
    lines.append(f"top ops, {name} at {b} rows ({tr['source']}, {tr['iterations']} iterations, "
                 f"busy {tr['busy_ms']:.2f} ms of {tr['span_ms']:.2f}):")
    for o in tr["top"][:8]:
      lines.append(f"  {o['op'][:44]:<44}{o['ms']:>9.3f} ms{o['per_iteration']:>8.1f}/it"
                   f"{o['share']:>7.0%}")
  for name, v in result.get("variants", {}).items():
    rows = ", ".join(f"{b} rows {t['iteration_ms']:.3f} ms/it, fixed {t['fixed_ms']:.2f}"
                     for b, t in v.get("rows", {}).items())
    lines.append(f"variant {name}: {v['status']}" + (f": {rows}" if rows else ""))
  peer = result.get("peer")
  if peer:
    lines.append(f"peer: {peer['status']}")
    for b, row in peer.get("rows", {}).items():
      lines.append(f"  {b:>4} rows: " + ", ".join(
          f"{k} {v['tokens_per_s']:.0f} tok/s" if v.get("status") == "ok" else f"{k} {v['status']}"
          for k, v in row.items()))
  for t in result.get("targets", []):
    verdict = {True: "pass", False: "FAIL", None: "not checked"}[t["pass"]]
    lines.append(f"target {t['name']}: {_f(t['measured'], 0).strip() or '-'} "
                 f"(limit {t['limit']}) {verdict}")
  return "\n".join(lines)


def _f(x, width, digits=3) -> str:
  return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


def plot(result: dict, path: pathlib.Path) -> None:
  """Per-iteration and fixed ms by rows (left), launches and idle ms per iteration (middle),
  tokens/s against transformers (right); written whole (temp file, then renamed)."""
  plt = pyplot()
  rows = result["rows"]
  if not rows:
    return
  fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
  names = ["plain"] + sorted({n for r in rows for n in r.get("sd", {})})

  def series(name, get):
    pts = [(r["batch"], get(r["plain"] if name == "plain" else r.get("sd", {}).get(name, {})))
           for r in rows]
    return [b for b, v in pts if v is not None], [v for b, v in pts if v is not None]
  for name in names:
    xs, ys = series(name, lambda p: p.get("timing", {}).get("iteration_ms"))
    axes[0].plot(xs, ys, "o-", label=f"{name} per iteration")
    xs, ys = series(name, lambda p: p.get("timing", {}).get("fixed_ms"))
    axes[0].plot(xs, ys, "x:", label=f"{name} fixed per call")
    xs, ys = series(name, lambda p: p.get("trace", {}).get("launches_per_iteration"))
    axes[1].plot(xs, ys, "o-", label=f"{name} launches")
    xs, ys = series(name, lambda p: p.get("trace", {}).get("idle_ms_per_iteration"))
    axes[1].plot(xs, [1e3 * y for y in ys], "x:", label=f"{name} idle µs")
  axes[0].set_ylabel("ms")
  axes[1].set_ylabel("per iteration (traced call)")
  peer = result.get("peer", {}).get("rows", {})
  pts = [(r["batch"], r["plain"]["tokens_per_s"]) for r in rows if "tokens_per_s" in r["plain"]]
  if pts:
    axes[2].plot(*zip(*pts), "o-", label="tlt_jax plain")
  for kind in ("eager", "compiled"):
    pts = [(int(b), v[kind]["tokens_per_s"]) for b, v in peer.items()
           if v.get(kind, {}).get("status") == "ok"]
    if pts:
      axes[2].plot(*zip(*pts), "s--", label=f"transformers {kind}")
  axes[2].set_ylabel("tokens/s")
  for ax in axes:
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.legend(fontsize=7)
  axes[2].set_yscale("log")
  fig.suptitle(f"{result['model']} on {result['device']['device_kind']}", fontsize=9)
  save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------- set-up and main


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
  parser.add_argument("--out", required=True, type=pathlib.Path, help="output folder")
  parser.add_argument("--config", default=None, metavar="FILE[:variant]",
                      help=f"config (default {CONFIG}; --quick: {QUICK_CONFIG})")
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="config override (repeatable)")
  parser.add_argument("--weights", choices=("auto", "config", "random"), default="auto",
                      help="the config's weights, or random ones of --shape (auto: the "
                           "config's where its model folder exists)")
  parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="smollm2-135m",
                      help="model shape of --weights random")
  parser.add_argument("--layers", type=int, default=0,
                      help="the model cut to this many layers (random weights: op counts of a "
                           "model's shape on a CPU; 0: all)")
  parser.add_argument("--counts-only", action="store_true",
                      help="compile and count operations; time and trace nothing")
  parser.add_argument("--batches", type=int, nargs="+", default=None,
                      help="row counts (default 1 8 32 128; --quick 1 4)")
  parser.add_argument("--sd-batches", type=int, nargs="*", default=None,
                      help="row counts of the SD programs (default: the batches at or below "
                           "rollout.sd_threshold)")
  parser.add_argument("--arms", nargs="*", default=None,
                      help="SD strategies 'depth,topk,verify' (default: the config's arms; "
                           "--quick: its first)")
  parser.add_argument("--oracle", action="store_true",
                      help="the policy as the EAGLE drafter (greedy: every draft accepted)")
  parser.add_argument("--iterations", type=int, default=None,
                      help="iterations of a long call (default 32; --quick 4)")
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed calls per measurement (default 5; --quick 2)")
  parser.add_argument("--no-trace", action="store_true", help="no jax.profiler traces")
  parser.add_argument("--flags", nargs="*", default=None, metavar="NAME[=FLAGS]",
                      help=f"XLA flag variants: names of {sorted(FLAG_SETS)} or NAME=FLAGS "
                           f"(default {' '.join(DEFAULT_FLAGS)}; none: --flags)")
  parser.add_argument("--flag-batches", type=int, nargs="+", default=None,
                      help="row counts of the variants (default: the first and last batch)")
  parser.add_argument("--peer", action="store_true",
                      help="also transformers on the same shape, eager and compiled")
  parser.add_argument("--peer-compile", choices=("auto", "on", "off"), default="auto",
                      help="torch.compile the peer (auto: on a GPU only: slow on a CPU)")
  parser.add_argument("--peer-new-tokens", type=int, default=None,
                      help="tokens per timed peer call (default 32; --quick 8)")
  parser.add_argument("--time-budget", type=float, default=0.0, metavar="SECONDS",
                      help="start no part once this many seconds have passed (0: no limit)")
  parser.add_argument("--quick", action="store_true",
                      help="CI: the tiny default config, 1 and 4 rows, one arm, 4 iterations")
  parser.add_argument("--variant-of", type=pathlib.Path, default=None,
                      help=argparse.SUPPRESS)  # a flag variant's own process: plain timings only
  args = parser.parse_args(argv)
  for name, (full, quick) in DEFAULTS.items():
    setattr(args, name, getattr(args, name) or (quick if args.quick else full))
  args.flags = list(DEFAULT_FLAGS) if args.flags is None else args.flags
  args.flag_batches = args.flag_batches or sorted({args.batches[0], args.batches[-1]})
  for f in args.flags:
    if "=" not in f and f not in FLAG_SETS:
      parser.error(f"--flags {f}: unknown set; known: {sorted(FLAG_SETS)}, or give NAME=FLAGS")
  if args.iterations < 2 or args.repeats < 1:
    parser.error("--iterations must be >= 2 and --repeats >= 1")
  return args


def plan_of(args, config, arms: list) -> tuple[list, dict]:
  """([(batch, strategy or None)], {batch: [arms]}): plain at every batch, the arms at the SD
  batches."""
  sd_batches = args.sd_batches
  if sd_batches is None:
    sd_batches = [b for b in args.batches if b <= max(config.rollout.sd_threshold, 1)]
  sd = {b: arms for b in args.batches if b in sd_batches}
  return [(b, None) for b in args.batches] + [(b, s) for b in sd for s in arms], sd


def main(argv=None):
  args = parse_args(argv)
  # JAX takes 75% of a GPU's memory when it starts unless told not to: the flag variants' own
  # processes and transformers (--peer) need memory beside this process's programs. (Set here,
  # before JAX's first use, not on import.)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  cache_dir = enable_compilation_cache()
  args.out.mkdir(parents=True, exist_ok=True)
  config, cfg, params, drafters, model, mesh, arms = load(args)
  plan, sd = plan_of(args, config, arms)
  floors = {strategy_label(s): weight_read_floor(cfg, drafters["eagle"].settings, s.depth)
            if "eagle" in s.drafts else 1.0 for s in arms}
  gpu = jax.default_backend() == "gpu"
  result = {**run_metadata(), "model": model, "config": args.config, "sets": args.set,
            "dtype": cfg.dtype, "attention_impl": cfg.attention_impl,
            "scan_layers": cfg.scan_layers, "prompt_len": config.rollout.max_prompt_len,
            "max_new_tokens": config.rollout.max_new_tokens,
            "temperature": config.rollout.temperature, "iterations": args.iterations,
            "repeats": args.repeats, "batches": args.batches, "sd_batches": sorted(sd),
            "arms": sorted({strategy_label(s) for arms in sd.values() for s in arms}),
            "oracle": args.oracle,
            "compilation_cache": cache_dir, "time_budget_s": args.time_budget or None,
            "skipped": [], "rows": [],
            "trace_note": ("a traced GPU program runs op by op: XLA turns its command buffers "
                           "off while profiling, so the trace shows every launch"
                           if gpu else "XLA:CPU ops on the host's threads")}
  json_path = args.out / ("profile_decode.json" if not args.variant_of else "variant.json")
  save = lambda: write_json(args.variant_of or json_path, result)  # noqa: E731
  print(f"{model}: compiling {len(plan)} decode programs on {usable_cpus()} threads", flush=True)
  bench = Bench(config, cfg, params, drafters, mesh, args.batches, plan)
  result.update(capacity=bench.capacity, compile_wall_s=bench.compile_wall_s,
                compiles=bench.pool.report()["bill"])
  save()

  traces, greedy = args.out / ".traces", bench.sp.temperature == 0
  for b in args.batches:
    row, reference = {"batch": b, "plain": {}, "sd": {}}, None
    result["rows"].append(row)
    for strategy in [None] + sd.get(b, []):
      name = "plain" if strategy is None else strategy_label(strategy)
      if spent(args):
        result["skipped"].append(f"{name} at {b} rows: time budget spent")
        continue
      entry = {}
      if not args.counts_only:
        entry["timing"], state = time_program(bench, b, strategy, args.iterations,
                                              args.repeats)
        if strategy is None:
          reference = jax.device_get((state.out, state.num_out))
        else:
          entry.update(against_plain(row["plain"], entry["timing"], state, reference, greedy),
                       weight_floor_vs_plain=floors[name])
        del state
      if not args.variant_of:
        entry["op_counts"] = count_ops(bench, b, strategy)
      if not (args.variant_of or args.no_trace or args.counts_only):
        entry["trace"], path = trace_program(bench, b, strategy, args.iterations,
                                             traces / f"{name}_{b}")
        if strategy is None and b == args.batches[0] and \
           os.path.getsize(path) <= RAW_TRACE_LIMIT:
          shutil.copyfile(path, args.out / f"trace_plain_{b}.xplane.pb")
      t = entry.get("timing", {})
      if strategy is None and t.get("iteration_ms", 0) > 0:
        entry["tokens_per_s"] = b / t["iteration_ms"] * 1e3
      (row["sd"].__setitem__(name, entry) if strategy else row.__setitem__("plain", entry))
      save()
      c = entry.get("op_counts", {}).get("per_iteration", {})
      print(f"{name:>10} at {b:>3} rows: " + (
          f"{t['iteration_ms']:.3f} ms per iteration, {t['fixed_ms']:.2f} ms fixed per call"
          if t else f"{c.get('ops')} ops per iteration"), flush=True)
  shutil.rmtree(traces, ignore_errors=True)
  if args.variant_of:
    return
  del bench
  result["variants"] = {}
  for spec in args.flags:
    name, _, flags = spec.partition("=")
    flags = flags if "=" in spec else FLAG_SETS[name]
    if spent(args):
      result["variants"][name] = {"flags": flags, "status": "skipped: time budget spent"}
    else:
      result["variants"][name] = run_variant(name, flags, args, args.out)
    print(f"variant {name}: {result['variants'][name]['status']}", flush=True)
    save()
  if args.peer:
    run_peer(args, cfg, result, gpu, save)
  result["targets"] = check_targets(result)
  result["wall_s"] = time.perf_counter() - T0
  save()
  plot(result, args.out / "profile_decode.png")
  print(table(result))
  print(f"wrote {json_path} ({result['wall_s']:.0f} s)")


def run_peer(args, cfg, result: dict, gpu: bool, save) -> None:
  """transformers at every batch, eager and (on GPU, or --peer-compile on) compiled."""
  compiled = args.peer_compile == "on" or (args.peer_compile == "auto" and gpu)
  peer = {"status": "ok", "rows": {}, "new_tokens": args.peer_new_tokens,
          "compiled": compiled if compiled else
          f"skipped: torch.compile off on {jax.default_backend()} (slow there); "
          f"--peer-compile on runs it"}
  result["peer"] = peer
  if not all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
    peer["status"] = "skipped: torch or transformers is not installed"
    return
  import torch
  torch.backends.cuda.matmul.allow_tf32 = True  # as JAX's default float32 matmuls on a GPU
  peer["versions"] = {m: importlib.metadata.version(m) for m in ("torch", "transformers")}
  for b in args.batches:
    row = peer["rows"].setdefault(str(b), {})
    for kind in ("eager", "compiled") if compiled else ("eager",):
      if spent(args):
        row[kind] = {"status": "skipped: time budget spent"}
        continue
      row[kind] = peer_row(cfg, b, result["prompt_len"], result["capacity"],
                           args.peer_new_tokens, kind == "compiled", cfg.dtype)
      print(f"transformers {kind} at {b} rows: {row[kind].get('status')}"
            + (f", {row[kind]['tokens_per_s']:.0f} tokens/s" if "tokens_per_s" in row[kind]
               else ""), flush=True)
      save()


def spent(args) -> bool:
  """Whether --time-budget seconds have passed since the script started."""
  return bool(args.time_budget) and time.perf_counter() - T0 > args.time_budget


if __name__ == "__main__":
  main()
