"""Cluster simulator: idle device-time in one synchronous RL step, and what TLT wins back.

A discrete-event model of one GRPO step on N devices split into R = N / devices_per_slice
rollout replicas ("slices"). Requests go round-robin to slices (slice s serves requests s,
s + R, ..., as tlt_jax.rollout.engine does); each slice runs continuous batching with up to
max_batch rows, refilling from its queue as rows finish; one iteration advances every running
row by one token (plain decode) or by the accept length (SD, once running rows <= threshold).
Iteration times come from a cost table by batch size. For each N it compares the baseline
(plain decode, no spot training) with TLT (SD in the tail + drafter training on idle slices).

  python -m experiments.simulate_cluster --out results/sim
  python -m experiments.simulate_cluster --out /tmp/sim --quick
  python -m experiments.simulate_cluster --out results/sim --lengths runs/lengths/lengths.json \
      --max-new-tokens 256 --costs costs.json
  python -m experiments.simulate_cluster --out results/sim --costs-from-bench results/rollout.json
  python -m experiments.simulate_cluster --out results/sim --sd-threshold 8 \
      --costs-from-decode docs/results/gpu_h100_2026-11-26/decode_7b.json

Writes OUT/simulation.json (inputs, cost table, per-N results with per-slice finish times),
OUT/simulation.csv (one row per N) and OUT/simulation.png (idle share without TLT, reclaimed
share and projected speedup vs N). experiments/simulate_vs_run.py checks the simulator against
a measured run.

Cost file (--costs, seconds per iteration of one slice, at each batch size):
  {"batch": [1, 2, 4, ...], "plain_s": [...], "sd_s": [...], "accept_len": [...],
   "prefill_s": 0.0, "call_s": 0.0}
accept_len is the mean number of tokens a running row gains per SD iteration (accepted drafts
plus the bonus token); it may be one number. prefill_s (optional) is the cost of one prefill
call, paid each time a slice admits requests; call_s (optional) what each compiled decode call
costs besides its iterations (dispatch, the host's wait for its results).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time


import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tlt_jax.rollout.scheduler import (Compact, Refill, SliceScheduler, Start,
                                       bucket)
from tlt_jax.speculative.strategy import Strategy

from .common import write_json

_EPS = 1e-9  # tokens: remaining work at or below this counts as done (float SD progress)


# ---------------------------------------------------------------- cost model

@dataclasses.dataclass(frozen=True)
class CostModel:
  """Per-iteration costs of one slice by batch size (the program's batch, see `bucket`).

  batch: ascending batch sizes; plain_s / sd_s: seconds per plain / SD iteration at each;
  accept_len: tokens per running row per SD iteration; prefill_s: seconds per prefill call;
  call_s: seconds per compiled decode call besides its iterations. Values between table
  points are interpolated linearly; see `check_covers` for the range.
  """
  batch: np.ndarray
  plain_s: np.ndarray
  sd_s: np.ndarray
  accept_len: np.ndarray
  prefill_s: float = 0.0
  source: str = ""
  call_s: float = 0.0

  def __post_init__(self):
    n = len(self.batch)
    for name in ("plain_s", "sd_s", "accept_len"):
      if len(getattr(self, name)) != n:
        raise ValueError(f"cost table {self.source!r}: {name} has {len(getattr(self, name))} "
                         f"entries but batch has {n}; give one value per batch size")
    if n == 0 or np.any(np.diff(self.batch) <= 0) or self.batch[0] < 1:
      raise ValueError(f"cost table {self.source!r}: batch must be ascending sizes >= 1, got "
                       f"{self.batch.tolist()}")
    if (np.any(self.plain_s < 0) or np.any(self.sd_s < 0) or self.prefill_s < 0
        or self.call_s < 0):
      raise ValueError(f"cost table {self.source!r}: iteration times must be >= 0 seconds")
    if np.any(self.accept_len < 1):
      raise ValueError(f"cost table {self.source!r}: accept_len must be >= 1 token per SD "
                       f"iteration (the bonus token alone is 1), got {self.accept_len.tolist()}")

  def plain_at(self, b):
    return np.interp(b, self.batch, self.plain_s)

  def sd_at(self, b):
    return np.interp(b, self.batch, self.sd_s)

  def accept_at(self, b):
    return np.interp(b, self.batch, self.accept_len)

  def sd_pays_at(self, b) -> bool:
    """Whether an SD iteration costs less per token than a plain step at program batch b."""
    return bool(self.sd_at(b) / self.accept_at(b) < self.plain_at(b))

  def check_covers(self, max_batch: int) -> None:
    """Raises unless the table reaches the largest program batch a slice runs."""
    if bucket(max_batch, max_batch) > self.batch[-1]:
      raise ValueError(f"cost table {self.source!r} covers batch sizes up to "
                       f"{self.batch[-1]:g} but max_batch={max_batch} needs "
                       f"{bucket(max_batch, max_batch):g}; measure larger batches or lower "
                       f"--max-batch")

  def to_dict(self) -> dict:
    return {"source": self.source, "batch": self.batch.tolist(), "plain_s": self.plain_s.tolist(),
            "sd_s": self.sd_s.tolist(), "accept_len": self.accept_len.tolist(),
            "prefill_s": self.prefill_s, "call_s": self.call_s}


def make_costs(batch, plain_s, sd_s, accept_len, prefill_s=0.0, source="",
               call_s=0.0) -> CostModel:
  """A CostModel from lists or arrays; a scalar accept_len applies to every batch size."""
  batch = np.asarray(batch, np.float64)

  def as_table(v):
    return np.broadcast_to(np.asarray(v, np.float64), batch.shape).copy()

  return CostModel(batch, as_table(plain_s), as_table(sd_s), as_table(accept_len),
                   float(prefill_s), source, float(call_s))


def pow2_upto(max_batch: int) -> np.ndarray:
  return 2.0 ** np.arange(int(np.log2(bucket(max_batch, max_batch))) + 1)


def default_costs(max_batch: int = 1024) -> CostModel:
  """Illustrative (not measured) costs of a 7B policy with one H100-class device per slice.

  Plain decode is memory-bound: each iteration reads the weights once (6 ms) plus every row's
  KV cache (0.15 ms per row at a few thousand tokens of context). An SD iteration runs the
  one-layer drafter for 8 steps and verifies a tree of v tokens per row, v from the BEG-MAB
  buckets (48 at batch 1, 32 up to 4, 16 up to 20, 8 beyond): 11 ms + (0.15 ms + 0.04 ms * v)
  per row. Accept length shrinks with the tree: 6.4, 5.5, 4.5, 3.5 tokens for v = 48, 32, 16,
  8 (community runs of the original report ~6.5 with 48). Use measured costs (--costs) for
  projections about a real system.
  """
  b = pow2_upto(max_batch)
  verify = np.select([b <= 1, b <= 4, b <= 20], [48.0, 32.0, 16.0], 8.0)
  accept = np.interp(verify, [8, 16, 32, 48], [3.5, 4.5, 5.5, 6.4])
  return make_costs(b, 6e-3 + 1.5e-4 * b, 11e-3 + b * (1.5e-4 + 4e-5 * verify), accept,
                    prefill_s=0.0, source="built-in illustrative 7B/H100 model")


def read_json(path: str, what: str):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r} not found; check the path")
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None


def load_costs(path: str) -> CostModel:
  """Reads a measured cost table (format in the module docstring) from a JSON file."""
  data = read_json(path, "cost file")
  need = ("batch", "plain_s", "sd_s", "accept_len")
  missing = [k for k in need if not isinstance(data, dict) or k not in data]
  if missing:
    raise ValueError(f"cost file {path!r} lacks {missing}; it needs keys {list(need)} "
                     f"(seconds per iteration by batch size; see the module docstring)")
  return make_costs(data["batch"], data["plain_s"], data["sd_s"], data["accept_len"],
                    data.get("prefill_s", 0.0), source=path, call_s=data.get("call_s", 0.0))


def costs_from_rollout_json(path: str, max_batch: int = 64) -> CostModel:
  """A cost table from the JSON of experiments/bench_rollout.py (its `modes` summaries).

  max_batch: the --max-batch that run used (its JSON does not record it; 64 is its default).
  Plain: two points of a linear model a + c * b. The tail (running rows <= sd_threshold) gives
  seconds per call at the tail's mean batch (a plain call emits one token per running row, so
  that batch is tail_tokens / tail_calls); the rest of the run is taken as full batches
  (min(max_batch, requests)), its seconds per token times that batch giving the second point
  (prefill calls included, so c is an overestimate). SD: the best SD mode's tail seconds per
  call over the plain model at its tail batch, a ratio applied at every batch size (measured
  only up to the run's sd_threshold); accept_len is that mode's mean.
  """
  data = read_json(path, "bench_rollout JSON")
  try:
    plain, sd = data["modes"]["plain"], data["modes"][data["best_sd_mode"]]
    full = float(min(max_batch, data["prompts"] * data["samples"]))
    keys = ("tail_tokens", "tail_calls", "tail_s", "tail_s_per_call", "tokens", "wall_s")
    p = {k: plain[k] for k in keys}
    s = {k: sd[k] for k in ("tail_tokens", "tail_calls", "tail_s_per_call", "accept_len")}
  except (KeyError, TypeError) as e:
    raise ValueError(f"{path!r} is not a bench_rollout.py result (missing {e}); make it with "
                     f"`python -m experiments.bench_rollout --out FILE.json`") from None
  if not p["tail_calls"] or not s["tail_calls"] or not s["accept_len"]:
    raise ValueError(f"{path!r} has no tail-phase calls to time; rerun bench_rollout.py with a "
                     f"larger --sd-threshold")
  b_tail = p["tail_tokens"] / p["tail_calls"]
  bulk_tokens = p["tokens"] - p["tail_tokens"]
  slope = 0.0
  if bulk_tokens > 0 and full > b_tail:
    full_s = (p["wall_s"] - p["tail_s"]) * full / bulk_tokens
    slope = float(np.clip((full_s - p["tail_s_per_call"]) / (full - b_tail), 0.0,
                          p["tail_s_per_call"] / b_tail))
  fixed = p["tail_s_per_call"] - slope * b_tail
  b_sd = s["tail_tokens"] / (s["tail_calls"] * s["accept_len"])
  ratio = s["tail_s_per_call"] / (fixed + slope * b_sd)
  b = pow2_upto(int(max_batch))
  return make_costs(b, fixed + slope * b, ratio * (fixed + slope * b), s["accept_len"],
                    source=f"{path} (fitted from bench_rollout modes)")


def costs_from_decode_json(path: str, max_batch: int = 64, sd_key: str | None = None,
                           accept_len: float = 6.4, kv_s_per_row: float = 1.5e-4
                           ) -> tuple[CostModel, int]:
  """A cost table from experiments/bench_decode.py's JSON (e.g. the 7B shape on a GPU):
  seconds per plain step and per SD iteration as measured at its batch sizes, and the
  largest batch it measured (SD beyond it would be extrapolated: keep --sd-threshold at or
  below it).

  Each is a least-squares line a + c * b through the measured batches (c >= 0), read off at
  powers of two up to max_batch, plus kv_s_per_row * b: the benchmark's prompts are short
  (1024 tokens), so it cannot show what each row's cache costs at the context of long
  responses; the default is the built-in model's (a few thousand tokens on an H100).
  sd_key: which of the JSON's SD strategies (default: the fastest at the smallest batch).
  accept_len: not measured by that benchmark (random weights); the default, 6.4, is the
  built-in model's for a 48-token tree.
  """
  data = read_json(path, "bench_decode JSON")
  rows = [r for r in data.get("rows", []) if isinstance(r, dict) and r.get("complete")]
  if not rows or any("tlt_plain_ms" not in r or not r.get("sd") for r in rows):
    raise ValueError(f"{path!r} holds no complete bench_decode.py rows with SD timings; make "
                     f"it with `python -m experiments.bench_decode --out FILE.json`")
  keys = sorted(rows[0]["sd"], key=lambda k: rows[0]["sd"][k]["iteration_ms"])
  key = sd_key or keys[0]
  if any(key not in r["sd"] for r in rows):
    raise ValueError(f"{path!r}: no SD strategy {key!r} at every batch; it has {keys}")
  batch = np.asarray([r["batch"] for r in rows], np.float64)

  def line(ms):
    y = np.asarray(ms, np.float64) * 1e-3
    slope = max(float(np.polyfit(batch, y, 1)[0]), 0.0) if len(set(batch)) > 1 else 0.0
    return float(np.mean(y - slope * batch)), slope

  (a_p, c_p), (a_s, c_s) = line([r["tlt_plain_ms"] for r in rows]), line(
      [r["sd"][key]["iteration_ms"] for r in rows])
  b = pow2_upto(int(max_batch))
  device = data.get("device", "?")
  device = device.get("device_kind", "?") if isinstance(device, dict) else device
  source = (f"{path} ({device}, {data.get('shape', '?')}, SD {key}, "
            f"measured at batch {sorted(set(batch.astype(int).tolist()))}; assumed: accept "
            f"length {accept_len}, {kv_s_per_row * 1e3:g} ms per row of long context)")
  kv = kv_s_per_row * b
  return make_costs(b, a_p + c_p * b + kv, a_s + c_s * b + kv, accept_len, source=source), \
      int(batch.max())


# ---------------------------------------------------------------- response lengths

def load_lengths(path: str) -> np.ndarray:
  """Response lengths in tokens from a JSON file: the `lengths` list of
  experiments/length_histogram.py's lengths.json, a plain list, or (.jsonl) one object per
  line with a `tokens` count, as in a run's rollouts.jsonl."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"lengths file {path!r} not found; check the path")
  if path.endswith(".jsonl"):
    with open(path) as f:
      rows = [json.loads(line) for line in f if line.strip()]
    if not rows or any("tokens" not in r for r in rows):
      raise ValueError(f"{path!r}: every line needs a `tokens` count (a rollouts.jsonl)")
    lengths = [r["tokens"] for r in rows]
  else:
    data = read_json(path, "lengths file")
    lengths = data.get("lengths") if isinstance(data, dict) else data
    if not isinstance(lengths, list) or not lengths:
      raise ValueError(f"{path!r} needs a non-empty `lengths` list (as written by "
                       f"experiments/length_histogram.py) or to be a list of lengths")
  return np.asarray(lengths, np.int64)


def sample_lengths(rng: np.random.Generator, n: int, dist: str, max_new_tokens: int,
                   median: float = 3000.0, sigma: float = 1.0, body_mean: float = 2000.0,
                   tail_prob: float = 0.1, tail_alpha: float = 0.5,
                   pool: np.ndarray | None = None) -> np.ndarray:
  """n response lengths in tokens, in [1, max_new_tokens].

  dist: "lognormal" (median, sigma of log-length); "geozipf", a geometric body with mean
  body_mean mixed with probability tail_prob with a Zipf tail P(L) ~ L ** -tail_alpha on
  [1, max_new_tokens] (the shape of tlt_jax.rl.tasks' step counts; geometric draws past the
  cap are redrawn); "measured", drawn with replacement from `pool`.
  """
  if dist == "lognormal":
    out = np.rint(median * np.exp(sigma * rng.standard_normal(n)))
  elif dist == "geozipf":
    out = rng.geometric(1.0 / max(body_mean, 1.0), n).astype(np.float64)
    while (over := out > max_new_tokens).any():
      out[over] = rng.geometric(1.0 / max(body_mean, 1.0), int(over.sum()))
    tail = rng.random(n) < tail_prob
    support = np.arange(1, max_new_tokens + 1, dtype=np.float64)
    weights = support ** -tail_alpha
    out[tail] = rng.choice(support, int(tail.sum()), p=weights / weights.sum())
  elif dist == "measured":
    if pool is None or len(pool) == 0:
      raise ValueError("dist='measured' needs a pool of lengths (--lengths FILE)")
    out = rng.choice(np.asarray(pool, np.float64), n)
  else:
    raise ValueError(f"unknown length distribution {dist!r}; use lognormal, geozipf or "
                     f"measured")
  return np.clip(out, 1, max_new_tokens).astype(np.int64)


# ---------------------------------------------------------------- the rollout

def simulate_rollout(lengths, num_slices: int, max_batch: int, costs: CostModel,
                     sd_threshold: int = 0, schedule: str = "parallel",
                     iterations_per_call: int = 1, batch_sizes=(),
                     sd_where_it_pays: bool = False, choice_floor=None) -> dict:
  """One rollout: every slice driven by the engine's own scheduler
  (`tlt_jax.rollout.scheduler.SliceScheduler`), with iteration times from the cost model.

  lengths: tokens per response, request order (request i goes to slice i % num_slices). The
  prefill emits a response's first token, so a response of L tokens needs L - 1 decode
  tokens. sd_threshold: SD when a slice's running rows <= it (0: plain decode only).
  iterations_per_call: decode iterations per compiled call, at most (the engine's
  rollout.iterations_per_call); "interleaved" and the costs' call_s depend on it.
  batch_sizes: the program batch sizes (the engine's rollout.batch_sizes; () = powers of two).
  sd_where_it_pays: at or below sd_threshold, SD only at program batches where it costs less
  per token than a plain step (`CostModel.sd_pays_at`), as a tuner that measures both would.
  choice_floor: the scheduler's (`SliceScheduler`): a tail call runs until the rows fall
  below it; None, until a row finishes.
  schedule: "parallel", slices advance concurrently (one host per slice, a cluster);
  "interleaved", one host loop makes one call per busy slice in turn and waits for each
  (slices whose calls never overlap).

  Between two events (a row finishing, rows being admitted) a slice's program batch and so
  its iteration cost and tokens per iteration are constant, so each decode decision jumps
  straight to the next event: exact for this model, and as many steps as responses per
  slice, not tokens.

  Returns a dict of numpy arrays / floats (seconds since the rollout start): finish_s [R]
  (when each slice ran out of work; 0 for a slice without requests), rollout_s (max),
  calls [R] (compiled decode calls + prefill calls), sd_iterations [R], prefill_calls [R].
  """
  if schedule not in ("parallel", "interleaved"):
    raise ValueError(f"schedule must be 'parallel' or 'interleaved', got {schedule!r}")
  if num_slices < 1 or max_batch < 1:
    raise ValueError(f"need num_slices >= 1 and max_batch >= 1, got {num_slices}, {max_batch}")
  costs.check_covers(max_batch)
  work = np.asarray(lengths, np.float64) - 1.0
  if work.size and work.min() < 0:
    raise ValueError("response lengths must be >= 1 token (the prefill emits the first)")
  runs = [_simulate_slice(work, range(s, work.size, num_slices), max_batch, costs, sd_threshold,
                          iterations_per_call, batch_sizes, sd_where_it_pays, choice_floor)
          for s in range(num_slices)]
  finish = np.asarray([r["trace"][-1][1] if r["trace"][-1][0] else 0.0 for r in runs])
  if schedule == "interleaved":
    finish = _interleave([np.asarray(r["trace"]) for r in runs])
  return {"finish_s": finish, "rollout_s": float(finish.max()),
          "calls": np.asarray([r["trace"][-1][0] for r in runs], np.float64),
          "sd_iterations": np.asarray([r["sd_iterations"] for r in runs], np.float64),
          "prefill_calls": np.asarray([r["prefill_calls"] for r in runs], np.float64)}


# Any strategy stands for SD here: the cost model has one SD cost per batch size.
_SD = Strategy(1, 1, 2)


def _simulate_slice(work: np.ndarray, requests, max_batch: int, costs: CostModel,
                    sd_threshold: int, iterations_per_call: int, batch_sizes=(),
                    sd_where_it_pays: bool = False, choice_floor=None) -> dict:
  """One slice's rollout. trace: (calls, seconds) breakpoints of its own clock, linear in
  between (the calls of one decode decision all cost the same)."""
  def choose(running):
    if not sd_where_it_pays:
      return _SD
    return _SD if costs.sd_pays_at(bucket(running, max_batch, sched.sizes)) else None
  sched = SliceScheduler(list(requests), max_batch, sd_threshold, iterations_per_call,
                         choose if sd_threshold else None, batch_sizes,
                         choice_floor=choice_floor)
  rem: dict[int, float] = {}  # decode tokens left, by row
  t, calls, sd_iterations, prefill_calls = 0.0, 0, 0.0, 0
  trace = [(0, 0.0)]
  while sched.busy:
    action = sched.next_action()
    if isinstance(action, (Start, Refill)):
      rows = range(len(action.requests)) if isinstance(action, Start) else action.rows
      if isinstance(action, Start):
        rem = {}
      for row, r in zip(rows, action.requests):
        rem[row] = work[r]
      t += costs.prefill_s
      calls += 1
      prefill_calls += 1
      sched.finished([i for i in rows if rem[i] <= _EPS])  # the prefill emitted them whole
    elif isinstance(action, Compact):
      rem = {new: rem[old] for new, old in enumerate(action.order) if old in rem}
    else:  # Decode, until fewer than min_running rows run (calls of iterations_per_call each)
      batch = float(sched.batch)
      sd = action.strategy is not None
      per_iter = float(costs.accept_at(batch)) if sd else 1.0
      cost = float(costs.sd_at(batch) if sd else costs.plain_at(batch))
      running = {i: rem[i] for i, r in enumerate(sched.rows) if r >= 0}
      iterations, done = 0.0, []
      while len(running) >= action.min_running:
        k = max(np.ceil((min(running.values()) - _EPS) / per_iter), 1.0)
        iterations += k
        running = {i: x - k * per_iter for i, x in running.items()}
        done += [i for i, x in running.items() if x <= _EPS]
        running = {i: x for i, x in running.items() if x > _EPS}
      for i in running:
        rem[i] = running[i]
      n_calls = int(np.ceil(iterations / iterations_per_call))
      t += iterations * cost + n_calls * costs.call_s
      calls += n_calls
      sd_iterations += iterations * sd
      sched.finished(done)
    trace.append((calls, t))
  return {"trace": trace, "sd_iterations": sd_iterations, "prefill_calls": prefill_calls}


def _interleave(traces: list[np.ndarray]) -> np.ndarray:
  """Finish times when one loop makes call j of every busy slice in slice order, round after
  round, waiting for each call (one host loop whose slices' calls never overlap).

  traces: per slice, [E, 2] breakpoints (calls, seconds) of its own clock (linear in
  between). Slice s finishes with its last call n_s, after every slice's calls of earlier
  rounds and round n_s - 1's calls of slices before it: sum over s' <= s of T_s'(min(n_s',
  n_s)) plus sum over s' > s of T_s'(min(n_s', n_s - 1)).
  """
  n = np.asarray([tr[-1, 0] for tr in traces])
  r = len(n)
  finish = np.zeros(r)
  for j in range(r):  # one interpolation per slice j, over all slices' query points
    upto = np.where(np.arange(r) >= j, np.minimum(n[j], n), np.minimum(n[j], n - 1))
    finish += np.interp(np.maximum(upto, 0), traces[j][:, 0], traces[j][:, 1])
  return np.where(n > 0, finish, 0.0)


# ---------------------------------------------------------------- one RL step

@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What one simulated step needs besides lengths and costs.

  devices_per_slice: devices of one rollout replica; max_batch: rows per slice;
  sd_threshold: TLT's SD switch (running rows per slice); drafter_steps_per_s: drafter
  updates per second on one idle slice; spot_startup_s: seconds an idle slice spends before
  its first drafter step (freeing the KV cache, placing the drafter); update_s +
  update_s_per_token * tokens / devices: the policy update, data-parallel over all devices;
  schedule, iterations_per_call: see simulate_rollout.
  """
  devices_per_slice: int = 1
  max_batch: int = 64
  sd_threshold: int = 32
  drafter_steps_per_s: float = 4.0
  spot_startup_s: float = 5.0
  update_s: float = 0.0
  update_s_per_token: float = 2e-4
  schedule: str = "parallel"
  iterations_per_call: int = 1

  def check(self, costs: CostModel) -> None:
    if self.devices_per_slice < 1 or self.max_batch < 1:
      raise ValueError("devices_per_slice and max_batch must be >= 1")
    if not 0 <= self.sd_threshold <= self.max_batch:
      raise ValueError(f"sd_threshold={self.sd_threshold} must be in [0, max_batch="
                       f"{self.max_batch}]; above max_batch SD would run from the first "
                       f"iteration: lower --sd-threshold or raise --max-batch")
    if min(self.drafter_steps_per_s, self.spot_startup_s, self.update_s,
           self.update_s_per_token) < 0:
      raise ValueError("drafter, start-up and update times must be >= 0")
    costs.check_covers(self.max_batch)


def idle_summary(finish_s: np.ndarray, devices_per_slice: int, spot_startup_s: float = 0.0,
                 drafter_steps_per_s: float = 0.0) -> dict:
  """Idle device-time of one rollout from its slices' finish times (seconds).

  idle_device_s = sum over slices of (rollout end - slice finish) * devices_per_slice;
  idle_share = that over the rollout's device-time (end * devices); reclaimed_device_s: the
  idle time after each slice's spot_startup_s, all of it used for drafter training;
  drafter_steps: whole steps that buys at drafter_steps_per_s per slice.
  """
  end = float(finish_s.max()) if finish_s.size else 0.0
  idle = end - finish_s
  usable = np.maximum(idle - spot_startup_s, 0.0)
  device_s = end * finish_s.size * devices_per_slice
  idle_device_s = float(idle.sum() * devices_per_slice)
  reclaimed_device_s = float(usable.sum() * devices_per_slice)
  return {"rollout_s": end, "idle_slice_s": float(idle.sum()), "idle_device_s": idle_device_s,
          "idle_share": idle_device_s / device_s if device_s > 0 else 0.0,
          "reclaimed_device_s": reclaimed_device_s,
          "reclaimed_share": reclaimed_device_s / device_s if device_s > 0 else 0.0,
          "drafter_steps": int(np.floor(usable * drafter_steps_per_s + 1e-9).sum())}


def simulate_step(lengths, num_devices: int, cfg: StepConfig, costs: CostModel) -> dict:
  """Baseline (plain decode, idle slices wait) vs TLT (SD at <= sd_threshold running rows,
  idle slices train the drafter) for one step's responses on num_devices devices.

  Returns {"baseline": ..., "tlt": ...} (idle_summary plus update_s, step_s = rollout_s +
  update_s, and finish_s per slice) with speedup_rollout and speedup_step, baseline over TLT.
  """
  if num_devices % cfg.devices_per_slice:
    raise ValueError(f"{num_devices} devices do not split into slices of "
                     f"{cfg.devices_per_slice}; pick --devices multiples of "
                     f"--devices-per-slice")
  slices = num_devices // cfg.devices_per_slice
  lengths = np.asarray(lengths)
  update_s = cfg.update_s + cfg.update_s_per_token * float(lengths.sum()) / num_devices
  out = {}
  for name, threshold, spot in (("baseline", 0, False), ("tlt", cfg.sd_threshold, True)):
    sim = simulate_rollout(lengths, slices, cfg.max_batch, costs, threshold, cfg.schedule,
                           cfg.iterations_per_call)
    row = idle_summary(sim["finish_s"], cfg.devices_per_slice, cfg.spot_startup_s,
                       cfg.drafter_steps_per_s)
    if not spot:  # the baseline trains no drafter: nothing is reclaimed
      row.update(reclaimed_device_s=0.0, reclaimed_share=0.0, drafter_steps=0)
    row.update(update_s=update_s, step_s=row["rollout_s"] + update_s,
               sd_iterations=float(sim["sd_iterations"].sum()), finish_s=sim["finish_s"])
    out[name] = row
  base, tlt = out["baseline"], out["tlt"]
  out["speedup_rollout"] = base["rollout_s"] / tlt["rollout_s"] if tlt["rollout_s"] else 1.0
  out["speedup_step"] = base["step_s"] / tlt["step_s"] if tlt["step_s"] else 1.0
  return out


# ---------------------------------------------------------------- the sweep

_SCALARS = ("rollout_s", "idle_device_s", "idle_share", "reclaimed_device_s",
            "reclaimed_share", "drafter_steps", "update_s", "step_s")


def sweep(devices: list[int], cfg: StepConfig, costs: CostModel, prompts_per_step: int,
          samples: int, scaling: str, trials: int, seed: int, length_args: dict) -> list[dict]:
  """simulate_step at each device count, averaged over `trials` independent length draws.

  scaling: "weak", prompts_per_step prompts per 8 devices (the paper's 7B setting: 64
  prompts x 8 samples on 8 GPUs), so each slice's share is the same at every N; "strong",
  prompts_per_step in total at every N. length_args: sample_lengths keywords.
  Returns one dict per device count: the trial means of the scalars, the per-trial values
  and trial 0's per-slice finish times.
  """
  if scaling not in ("weak", "strong"):
    raise ValueError(f"scaling must be 'weak' or 'strong', got {scaling!r}")
  rows = []
  for n in devices:
    prompts = max(1, round(prompts_per_step * n / 8)) if scaling == "weak" else prompts_per_step
    per_trial = []
    for trial in range(trials):
      rng = np.random.default_rng([seed, n, trial])
      per_trial.append(simulate_step(sample_lengths(rng, prompts * samples, **length_args), n,
                                     cfg, costs))
    row = {"devices": n, "slices": n // cfg.devices_per_slice, "prompts": prompts,
           "responses": prompts * samples}
    for mode in ("baseline", "tlt"):
      row[mode] = {k: float(np.mean([s[mode][k] for s in per_trial])) for k in _SCALARS}
      row[mode]["finish_s"] = per_trial[0][mode]["finish_s"].round(4).tolist()
    for k in ("speedup_rollout", "speedup_step"):
      row[k] = float(np.mean([s[k] for s in per_trial]))
    row["trials"] = [{m: {k: s[m][k] for k in _SCALARS} for m in ("baseline", "tlt")}
                     for s in per_trial]
    rows.append(row)
  return rows


def write_outputs(rows: list[dict], record: dict, out: str) -> None:
  """OUT/simulation.json (record + rows), simulation.csv and simulation.png."""
  os.makedirs(out, exist_ok=True)
  write_json(os.path.join(out, "simulation.json"), {**record, "results": rows})
  with open(os.path.join(out, "simulation.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["devices", "slices", "responses"] + [f"baseline_{k}" for k in _SCALARS] +
               [f"tlt_{k}" for k in _SCALARS] + ["speedup_rollout", "speedup_step"])
    for r in rows:
      w.writerow([r["devices"], r["slices"], r["responses"]] +
                 [f"{r[m][k]:.6g}" for m in ("baseline", "tlt") for k in _SCALARS] +
                 [f"{r['speedup_rollout']:.4f}", f"{r['speedup_step']:.4f}"])
  n = [r["devices"] for r in rows]
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=110)
  ax1.plot(n, [100 * r["baseline"]["idle_share"] for r in rows], "o-", label="idle, no TLT")
  ax1.plot(n, [100 * r["tlt"]["idle_share"] for r in rows], "s--", label="idle, TLT")
  ax1.plot(n, [100 * r["tlt"]["reclaimed_share"] for r in rows], "^-",
           label="reclaimed by spot training")
  ax1.set_ylabel("% of rollout device-time")
  ax2.plot(n, [r["speedup_step"] for r in rows], "o-", label="step (rollout + update)")
  ax2.plot(n, [r["speedup_rollout"] for r in rows], "s--", label="rollout")
  ax2.axhline(1.0, color="k", lw=0.6)
  ax2.set_ylabel("projected TLT speedup (x)")
  for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("devices")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  source = record["costs"]["source"]
  fig.suptitle(f"{record['title']}\ncosts: {os.path.basename(source)}", fontsize=8)
  fig.tight_layout()
  fig.savefig(os.path.join(out, "simulation.png"))
  plt.close(fig)


# ---------------------------------------------------------------- command line

def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", required=True, help="output folder")
  parser.add_argument("--quick", action="store_true", help="two small device counts, 1 trial")
  parser.add_argument("--costs", help="measured cost table (JSON); default: built-in model")
  parser.add_argument("--costs-from-bench", help="derive costs from bench_rollout.py's JSON")
  parser.add_argument("--costs-from-decode",
                      help="iteration times from bench_decode.py's JSON (e.g. measured on a GPU)")
  parser.add_argument("--decode-sd", help="with --costs-from-decode: its SD strategy key")
  parser.add_argument("--accept-len", type=float, default=6.4,
                      help="with --costs-from-decode: tokens per SD iteration (not measured)")
  parser.add_argument("--lengths", help="measured lengths: lengths.json or rollouts.jsonl")
  parser.add_argument("--dist", default="lognormal", choices=("lognormal", "geozipf"),
                      help="parametric lengths when --lengths is not given")
  parser.add_argument("--median", type=float, default=3000.0, help="lognormal median tokens")
  parser.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
  parser.add_argument("--body-mean", type=float, default=2000.0, help="geozipf body mean")
  parser.add_argument("--tail-prob", type=float, default=0.1, help="geozipf tail share")
  parser.add_argument("--tail-alpha", type=float, default=0.5, help="geozipf tail exponent")
  parser.add_argument("--max-new-tokens", type=int, default=32768)
  parser.add_argument("--devices", type=int, nargs="+",
                      default=[8, 16, 32, 64, 128, 256, 512, 1024])
  parser.add_argument("--devices-per-slice", type=int, default=1)
  parser.add_argument("--prompts-per-step", type=int, default=64)
  parser.add_argument("--samples", type=int, default=8, help="responses per prompt")
  parser.add_argument("--scaling", default="weak", choices=("weak", "strong"),
                      help="weak: prompts per step per 8 devices; strong: in total")
  parser.add_argument("--max-batch", type=int, help="rows per slice (default 64)")
  parser.add_argument("--sd-threshold", type=int, help="SD at <= this many rows (default 32)")
  parser.add_argument("--drafter-steps-per-s", type=float, default=4.0)
  parser.add_argument("--spot-startup-s", type=float, default=5.0)
  parser.add_argument("--update-s", type=float, default=0.0, help="fixed update seconds")
  parser.add_argument("--update-s-per-token", type=float, default=2e-4,
                      help="update seconds per response token per device")
  parser.add_argument("--schedule", default="parallel", choices=("parallel", "interleaved"))
  parser.add_argument("--trials", type=int, default=8, help="length draws per device count")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  try:
    sweep_main(args)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"error: {e}") from None


def sweep_main(args) -> None:
  if args.quick:
    args.devices, args.trials, args.prompts_per_step = [8, 64], 1, 16
    args.max_new_tokens = min(args.max_new_tokens, 4096)
  max_batch = args.max_batch or 64
  sources = [a for a in ("costs", "costs_from_bench", "costs_from_decode") if getattr(args, a)]
  if len(sources) > 1:
    flags = " and ".join("--" + a.replace("_", "-") for a in sources)
    raise ValueError(f"give one cost source, not {flags}")
  if args.costs_from_decode:
    costs, measured_upto = costs_from_decode_json(args.costs_from_decode, max_batch,
                                                  args.decode_sd, args.accept_len)
    threshold = 32 if args.sd_threshold is None else args.sd_threshold
    if threshold > measured_upto:
      raise ValueError(f"--sd-threshold {threshold}: {args.costs_from_decode} measured SD up to "
                       f"batch {measured_upto}; use --sd-threshold {measured_upto} or less")
  else:
    costs = (load_costs(args.costs) if args.costs else
             costs_from_rollout_json(args.costs_from_bench, max_batch)
             if args.costs_from_bench else default_costs(max_batch))
  cfg = StepConfig(devices_per_slice=args.devices_per_slice, max_batch=max_batch,
                   sd_threshold=32 if args.sd_threshold is None else args.sd_threshold,
                   drafter_steps_per_s=args.drafter_steps_per_s,
                   spot_startup_s=args.spot_startup_s, update_s=args.update_s,
                   update_s_per_token=args.update_s_per_token, schedule=args.schedule)
  cfg.check(costs)
  length_args = dict(dist="lognormal", max_new_tokens=args.max_new_tokens)
  if args.lengths:
    length_args.update(dist="measured", pool=load_lengths(args.lengths))
    source = f"{args.lengths} (drawn with replacement)"
  else:
    length_args.update(dist=args.dist, median=args.median, sigma=args.sigma,
                       body_mean=args.body_mean, tail_prob=args.tail_prob,
                       tail_alpha=args.tail_alpha)
    source = args.dist
  t0 = time.perf_counter()
  rows = sweep(args.devices, cfg, costs, args.prompts_per_step, args.samples, args.scaling,
               args.trials, args.seed, length_args)
  seconds = time.perf_counter() - t0
  config = {k: v for k, v in vars(args).items()}
  config.update(max_batch=cfg.max_batch, sd_threshold=cfg.sd_threshold)
  title = (f"{source} lengths, cap {args.max_new_tokens}; {args.prompts_per_step}x{args.samples}"
           f" responses {'per 8 devices' if args.scaling == 'weak' else 'per step'}; "
           f"batch {cfg.max_batch}, SD at <= {cfg.sd_threshold} rows")
  lengths_record = {k: v for k, v in length_args.items() if k != "pool"}
  if "pool" in length_args:
    pool = length_args["pool"]
    lengths_record.update(count=int(pool.size), mean=float(pool.mean()), max=int(pool.max()))
  write_outputs(rows, {"title": title, "command": " ".join(["python", *sys.argv]),
                       "date": time.strftime("%Y-%m-%d"), "device": "CPU (a simulation)",
                       "config": config, "step": dataclasses.asdict(cfg),
                       "costs": costs.to_dict(), "lengths": lengths_record,
                       "simulation_s": seconds}, args.out)
  for r in rows:
    base, tlt = r["baseline"], r["tlt"]
    print(f"{r['devices']:5d} devices {r['slices']:5d} slices: idle {base['idle_share']:6.1%} "
          f"-> TLT idle {tlt['idle_share']:6.1%}, reclaimed {tlt['reclaimed_share']:6.1%}; "
          f"speedup rollout {r['speedup_rollout']:.2f}x, step {r['speedup_step']:.2f}x")
  print(f"simulated in {seconds:.1f}s; wrote {args.out}/simulation.{{json,csv,png}}")


if __name__ == "__main__":
  main()
