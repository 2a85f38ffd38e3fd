"""The cost model of a rollout, and the rollout it prices: what the cluster simulator and the
replay (of a GPU headline or a CPU run) evaluate.

`simulate_rollout` drives the engine's own scheduler (`tlt_jax.rollout.scheduler`) on every
slice with a `CostModel`'s seconds; response lengths come in as JSON (`load_lengths`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

from tlt_jax.rollout.scheduler import (Compact, Refill, SliceScheduler, Start,
                                       bucket)
from tlt_jax.speculative.strategy import Strategy

_EPS = 1e-9  # tokens: remaining work at or below this counts as done (float SD progress)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Per-iteration costs of one slice by program batch (`bucket`), float64 arrays [B].

  batch: ascending batch sizes; plain_s / sd_s: seconds per plain / SD iteration at each (sd_s
  NaN where not measured: the nearest measured batch's, scaled by the plain steps' ratio;
  plain there where none is); accept_len: tokens a running row gains per SD iteration
  (accepted drafts plus the bonus token); prefill_s: seconds per prefill call; call_s:
  seconds per compiled decode call besides its iterations. Linear in between batch sizes.
  """
  batch: np.ndarray
  plain_s: np.ndarray
  sd_s: np.ndarray
  accept_len: np.ndarray
  prefill_s: float = 0.0
  source: str = ""
  call_s: float = 0.0

  def __post_init__(self):
    where = f"cost table {self.source!r}"
    for name in ("plain_s", "sd_s", "accept_len"):
      if len(getattr(self, name)) != len(self.batch):
        raise ValueError(f"{where}: {name} has {len(getattr(self, name))} entries but batch "
                         f"has {len(self.batch)}; give one value per batch size")
    if not len(self.batch) or np.any(np.diff(self.batch) <= 0) or self.batch[0] < 1:
      raise ValueError(f"{where}: batch must be ascending sizes >= 1, got "
                       f"{self.batch.tolist()}")
    if min(np.nanmin(np.r_[self.plain_s, self.sd_s, 0.0]), self.prefill_s, self.call_s) < 0:
      raise ValueError(f"{where}: iteration times must be >= 0 seconds")
    if np.any(self.accept_len < 1):
      raise ValueError(f"{where}: accept_len must be >= 1 token per SD iteration (the bonus "
                       f"token alone is 1), got {self.accept_len.tolist()}")

  @functools.cached_property
  def _sd(self) -> np.ndarray:
    """sd_s with its NaN entries filled (the class docstring's rule)."""
    have = np.flatnonzero(~np.isnan(self.sd_s))
    if not have.size:
      return self.plain_s.copy()
    out = self.sd_s.copy()
    for i in np.flatnonzero(np.isnan(out)):
      near = have[np.argmin(np.abs(np.log(self.batch[have] / self.batch[i])))]
      out[i] = self.sd_s[near] * self.plain_s[i] / self.plain_s[near]
    return out

  def plain_at(self, b):
    return np.interp(b, self.batch, self.plain_s)

  def sd_at(self, b):
    return np.interp(b, self.batch, self._sd)

  def accept_at(self, b):
    return np.interp(b, self.batch, self.accept_len)

  def sd_pays_at(self, b) -> bool:
    """Whether an SD iteration costs less per token than a plain step at program batch b."""
    return bool(self.sd_at(b) / self.accept_at(b) < self.plain_at(b))

  def measured(self, mode: str) -> dict:
    """{batch: seconds per iteration} of `mode` ("plain" or "sd") where the table has one."""
    table = self.plain_s if mode == "plain" else self.sd_s
    return {int(b): float(s) for b, s in zip(self.batch, table) if not np.isnan(s)}

  def with_table(self, plain: dict | None = None, sd: dict | None = None, accept=None,
                 call_s: float | None = None) -> CostModel:
    """This model with {batch: seconds} entries of plain / SD replaced, accept (one number or
    {batch: tokens}) and call_s."""
    tables = {"plain_s": self.plain_s.copy(), "sd_s": self.sd_s.copy(),
              "accept_len": self.accept_len.copy()}
    accept = accept if isinstance(accept, dict) or accept is None else dict.fromkeys(
        self.batch.astype(int).tolist(), accept)
    for name, entries in (("plain_s", plain), ("sd_s", sd), ("accept_len", accept)):
      for b, v in (entries or {}).items():
        if b not in self.batch:
          raise ValueError(f"cost table {self.source!r} has no batch {b}")
        tables[name][self.batch == b] = v
    return dataclasses.replace(self, **tables,
                               call_s=self.call_s if call_s is None else float(call_s))

  def check_covers(self, max_batch: int) -> None:
    """Raises unless the table prices every program batch a slice of max_batch rows runs."""
    if bucket(max_batch, max_batch) > self.batch[-1]:
      raise ValueError(f"cost table {self.source!r} covers batch sizes up to "
                       f"{self.batch[-1]:g} but max_batch={max_batch} needs "
                       f"{bucket(max_batch, max_batch):g}; measure larger batches or lower "
                       f"--max-batch")
    if np.isnan(self.plain_s).any():
      raise ValueError(f"cost table {self.source!r} has no plain step at batch "
                       f"{self.batch[np.isnan(self.plain_s)].tolist()}")

  def to_dict(self) -> dict:
    return {"source": self.source, "batch": self.batch.tolist(), "plain_s": self.plain_s.tolist(),
            "sd_s": self.sd_s.tolist(), "accept_len": self.accept_len.tolist(),
            "prefill_s": self.prefill_s, "call_s": self.call_s}


def make_costs(batch, plain_s, sd_s, accept_len, prefill_s=0.0, source="",
               call_s=0.0) -> CostModel:
  """A CostModel from lists or arrays; a scalar applies to every batch size."""
  batch = np.asarray(batch, np.float64)
  table = lambda v: np.broadcast_to(np.asarray(v, np.float64), batch.shape).copy()  # noqa: E731
  return CostModel(batch, table(plain_s), table(sd_s), table(accept_len), float(prefill_s),
                   source, float(call_s))


# ---------------------------------------------------------------- the rollout

def simulate_rollout(lengths, num_slices: int, max_batch: int, costs: CostModel,
                     sd_threshold: int = 0, schedule: str = "parallel",
                     iterations_per_call: int = 1, batch_sizes=(),
                     sd_where_it_pays: bool = False, choice_floor=None) -> dict:
  """One rollout: every slice driven by the engine's scheduler, priced by `costs`.

  lengths: tokens per response, request order (request i goes to slice i % num_slices); the
  prefill emits a response's first token, so L tokens need L - 1 decode tokens.
  sd_threshold: SD when a slice's running rows <= it (0: plain only). iterations_per_call,
  batch_sizes, choice_floor: the engine's (rollout.iterations_per_call, rollout.batch_sizes,
  the tuner's bucket floors; None: a tail call ends at each finished row).
  sd_where_it_pays: SD only at program batches where a token costs less than a plain step's
  (`CostModel.sd_pays_at`), as a tuner that measures both would. schedule: "parallel",
  slices advance concurrently (a host per slice); "interleaved", one host loop makes one call
  per busy slice in turn and waits for each.

  Between two events (a row finishing, rows admitted) a slice's program batch and so its
  costs are constant, so each decode decision jumps to the next event: exact for this model.
  Returns numpy arrays [R] and floats (seconds since the start): finish_s (0 for a slice
  without requests), rollout_s (max), calls (decode + prefill), sd_iterations, prefill_calls.
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
          **{k: np.asarray([r[k] for r in runs], np.float64)
             for k in ("calls", "sd_iterations", "prefill_calls")}}


_SD = Strategy(1, 1, 2)  # any strategy stands for SD: the model has one SD cost per batch


def _simulate_slice(work: np.ndarray, requests, max_batch: int, costs: CostModel,
                    sd_threshold: int, iterations_per_call: int, batch_sizes=(),
                    sd_where_it_pays: bool = False, choice_floor=None) -> dict:
  """One slice's rollout. trace: (calls, seconds) breakpoints of its own clock, linear in
  between (the calls of one decode decision all cost the same)."""
  def choose(running):
    return None if sd_where_it_pays and not costs.sd_pays_at(
        bucket(running, max_batch, sched.sizes)) else _SD
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
      rem = {} if isinstance(action, Start) else rem
      rem.update({row: work[r] for row, r in zip(rows, action.requests)})
      t, calls, prefill_calls = t + costs.prefill_s, calls + 1, prefill_calls + 1
      sched.finished([i for i in rows if rem[i] <= _EPS])  # the prefill emitted them whole
    elif isinstance(action, Compact):
      rem = {new: rem[old] for new, old in enumerate(action.order) if old in rem}
    else:  # Decode, until fewer than min_running rows run (calls of iterations_per_call each)
      batch, sd = float(sched.batch), action.strategy is not None
      per_iter = float(costs.accept_at(batch)) if sd else 1.0
      running = {i: rem[i] for i, r in enumerate(sched.rows) if r >= 0}
      iterations, done = 0.0, []
      while len(running) >= action.min_running:
        k = max(np.ceil((min(running.values()) - _EPS) / per_iter), 1.0)
        iterations += k
        running = {i: x - k * per_iter for i, x in running.items()}
        done += [i for i, x in running.items() if x <= _EPS]
        running = {i: x for i, x in running.items() if x > _EPS}
      rem.update(running)
      n_calls = int(np.ceil(iterations / iterations_per_call))
      t += iterations * float(costs.sd_at(batch) if sd else costs.plain_at(batch)) + \
          n_calls * costs.call_s
      calls += n_calls
      sd_iterations += iterations * sd
      sched.finished(done)
    trace.append((calls, t))
  return {"trace": trace, "calls": calls, "sd_iterations": sd_iterations,
          "prefill_calls": prefill_calls}


def _interleave(traces: list[np.ndarray]) -> np.ndarray:
  """Finish times when one loop makes call j of every busy slice in slice order, round after
  round, waiting for each. traces: per slice, [E, 2] breakpoints (calls, seconds). Slice s
  finishes after sum over s' <= s of T_s'(min(n_s', n_s)) plus sum over s' > s of
  T_s'(min(n_s', n_s - 1)), n_s its calls."""
  n = np.asarray([tr[-1, 0] for tr in traces])
  finish = np.zeros(len(n))
  for j in range(len(n)):  # one interpolation per slice j, over all slices' query points
    upto = np.where(np.arange(len(n)) >= j, np.minimum(n[j], n), np.minimum(n[j], n - 1))
    finish += np.interp(np.maximum(upto, 0), traces[j][:, 0], traces[j][:, 1])
  return np.where(n > 0, finish, 0.0)


# ---------------------------------------------------------------- response lengths

def read_json(path: str, what: str, lines: bool = False, hint: str = "check the path"):
  """The JSON at path, or with lines=True the list of its JSON lines' objects;
  FileNotFoundError / ValueError naming `what`, the path and `hint`."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{what} {path!r} not found; {hint}")
  with open(path) as f:
    try:
      return [json.loads(line) for line in f if line.strip()] if lines else json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{what} {path!r} is not valid JSON: {e}") from None


def load_lengths(path: str) -> np.ndarray:
  """Response lengths in tokens [N] int64: the `lengths` of experiments/length_histogram.py's
  lengths.json or a plain list; or JSON lines, each with a `tokens` count (a run's
  rollouts.jsonl) or a `completion` of token ids (a responses.jsonl)."""
  if str(path).endswith(".jsonl"):
    rows = read_json(str(path), "lengths file", lines=True)
    if not rows or not all("tokens" in r or "completion" in r for r in rows):
      raise ValueError(f"{path!r}: every line needs a `tokens` count or a `completion`")
    return np.asarray([r["tokens"] if "tokens" in r else len(r["completion"]) for r in rows],
                      np.int64)
  data = read_json(str(path), "lengths file")
  lengths = data.get("lengths") if isinstance(data, dict) else data
  if not isinstance(lengths, list) or not lengths:
    raise ValueError(f"{path!r} needs a non-empty `lengths` list (as written by "
                     f"experiments/length_histogram.py) or to be a list of lengths")
  return np.asarray(lengths, np.int64)


def length_summary(lengths) -> dict:
  """count, mean, median, p90, p99, max, min and max over median of response lengths."""
  a = np.asarray(lengths, np.float64)
  return {"count": int(a.size), "mean": float(a.mean()), "median": float(np.median(a)),
          "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99)),
          "max": int(a.max()), "min": int(a.min()),
          "max_over_median": float(a.max() / max(np.median(a), 1.0))}
