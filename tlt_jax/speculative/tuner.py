"""Choosing the SD strategy per batch size: BEG-MAB, a fixed table, or one fixed strategy.

A rollout engine asks `choose(batch_size)` between compiled SD calls, runs them with the
returned `Strategy`, then reports `update(batch_size, strategy, accepted_tokens,
iteration_seconds)`. Everything here is host-side Python/numpy: decisions happen between
compiled calls, never inside them.

An arm may also be `PLAIN` (None): decode plainly at this batch size. With it among a bucket's
arms, BEG-MAB learns from the same goodput measurements where no strategy beats plain
decoding (an SD iteration can cost more than the tokens it gains), so adaptive SD is never
slower than the baseline beyond noise.

Batch sizes map to buckets by thresholds: with [1, 2, 5, 21], bs 1 -> bucket 0, 2-4 -> 1,
5-20 -> 2, >= 21 -> 3. One bucket per verify-token budget, because the best tree size shrinks as
the batch grows (verification stops being free once decode is compute-bound).

The cheapest-per-token tuner (`CheapestTuner`) compares arms by what a token costs: an arm's
seconds per iteration over the tokens a row gains in it, with each compiled call's fixed
seconds shared out over a call's iterations, plain decoding always among the arms. It explores
in short calls (`iterations_for`), so a losing arm costs a few iterations, and it may be given
every row count (rollout.sd_threshold = max_batch): SD then runs wherever it pays.

`strategies()` lists every strategy a tuner may return and `strategies_for(batch_size)` those of
one bucket. The engine compiles a strategy's program the first time it is chosen (a pool keyed
by strategy and batch bucket), so an arm never chosen costs no compile; or, compiling ahead, it
passes `choose(batch_size, ready)` a predicate and only arms whose program is ready are
eligible (PLAIN when none is): nothing waits for a compile.
"""

from __future__ import annotations

import abc
import bisect
import math
import numbers
import statistics
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

from tlt_jax.drafters import check_strategy
from tlt_jax.speculative.strategy import Strategy

DEFAULT_THRESHOLDS = (1, 2, 5, 21)
# Verify budgets 48/32/16/8 as in the original system; several arms per bucket that differ in
# depth and width, so that exploration compares genuinely different trees. Narrow shallow trees
# such as (4, 2, 16) or (2, 2, 8) cannot fill their budget (`check_strategy` rejects them), hence
# (3, 3, 16) and (2, 4, 8) as the shallow, wide arms.
DEFAULT_ARMS = (
    ((8, 4, 48), (6, 4, 48), (10, 4, 48)),
    ((8, 4, 32), (6, 3, 32), (4, 4, 32)),
    ((6, 2, 16), (4, 4, 16), (3, 3, 16)),
    ((4, 2, 8), (3, 2, 8), (2, 4, 8)),
)
# The original system's one arm per bucket; as a table it needs no exploration.
DEFAULT_TABLE = ((8, 4, 48), (8, 4, 32), (8, 4, 16), (8, 4, 8))
DEFAULT_STRATEGY = (8, 4, 48)
DEFAULT_EPSILON = 0.1
DEFAULT_WINDOW = 300
# The arm that decodes without speculation; spelled "plain" in configs and checkpoints.
PLAIN = None
PLAIN_NAME = "plain"
# choose()'s readiness predicate: whether a strategy's program can run now (None: all can).
Ready = Callable[[Strategy], bool] | None


# ---------------------------------------------------------------------------------------------
# Helpers: buckets, validation, rewards.
# ---------------------------------------------------------------------------------------------

def _is_int(value) -> bool:
  """Python or numpy integers; bools are excluded since True as a size is always a mistake."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def validate_thresholds(thresholds) -> tuple[int, ...]:
  """Thresholds as a tuple of ints: start at 1 (every batch size has a bucket), strictly rising."""
  values = tuple(thresholds)
  if not values:
    raise ValueError("thresholds are empty; pass at least [1] (one bucket for every batch size)")
  if not all(_is_int(t) for t in values):
    raise ValueError(f"thresholds {list(values)} must be integers, e.g. {list(DEFAULT_THRESHOLDS)}")
  values = tuple(int(t) for t in values)
  if values[0] != 1:
    raise ValueError(f"thresholds {list(values)} must start at 1 so that batch size 1 has a "
                     f"bucket, e.g. {list(DEFAULT_THRESHOLDS)}")
  if any(b <= a for a, b in zip(values, values[1:])):
    raise ValueError(f"thresholds {list(values)} must be strictly increasing, "
                     f"e.g. {list(DEFAULT_THRESHOLDS)}")
  return values


def check_batch_size(batch_size) -> int:
  """A batch size as an int >= 1 (the number of running sequences)."""
  if not _is_int(batch_size) or batch_size < 1:
    raise ValueError(f"batch_size must be an integer >= 1 (running sequences), got {batch_size!r}")
  return int(batch_size)


def bucket_of(thresholds: Sequence[int], batch_size: int) -> int:
  """Index of the last threshold <= batch_size."""
  return bisect.bisect_right(thresholds, check_batch_size(batch_size)) - 1


def bucket_range(thresholds: Sequence[int], bucket: int) -> tuple[int, int | None]:
  """Smallest and largest batch size of a bucket; None as the largest for the last bucket."""
  if not 0 <= bucket < len(thresholds):
    raise ValueError(f"bucket {bucket} does not exist; there are {len(thresholds)} buckets "
                     f"(thresholds {list(thresholds)})")
  high = thresholds[bucket + 1] - 1 if bucket + 1 < len(thresholds) else None
  return thresholds[bucket], high


def describe_bucket(thresholds: Sequence[int], bucket: int) -> str:
  """'2-4', '1' or '>=21': the batch sizes of a bucket, for messages and reports."""
  low, high = bucket_range(thresholds, bucket)
  if high is None:
    return f">={low}"
  return str(low) if low == high else f"{low}-{high}"


def goodput(batch_size: int, accepted_tokens: float, iteration_seconds: float) -> float:
  """Tokens per second over the whole batch: mean tokens emitted per sequence x batch size / time.

  Raw acceptance length alone would always favour the biggest tree; dividing by the measured
  iteration time charges each strategy for the verification work it costs at this batch size.
  """
  accepted_tokens, iteration_seconds = float(accepted_tokens), float(iteration_seconds)
  if not math.isfinite(accepted_tokens) or accepted_tokens < 0:
    raise ValueError(f"accepted_tokens must be a finite number >= 0 (mean tokens emitted per "
                     f"sequence), got {accepted_tokens!r}")
  if not math.isfinite(iteration_seconds) or iteration_seconds <= 0:
    raise ValueError(f"iteration_seconds must be a finite number > 0 (wall time of the "
                     f"iteration), got {iteration_seconds!r}")
  return accepted_tokens * batch_size / iteration_seconds


def parse_arm(value) -> Strategy | None:
  """A strategy from a Strategy, (depth, topk, verify) or 's,k,v'; PLAIN from None/'plain'.
  ValueError for a malformed one, or one its drafters cannot fill (`check_strategy`)."""
  if value is PLAIN or value == PLAIN_NAME:
    return PLAIN
  strategy = Strategy.parse(value)
  check_strategy(strategy)
  return strategy


def arm_name(arm: Strategy | None):
  """What an arm looks like in JSON: [depth, topk, verify] or 'plain'."""
  return PLAIN_NAME if arm is PLAIN else list(arm.as_tuple())


def _parse_strategies(values, what: str, allow_plain: bool = False) -> tuple:
  """Arms from Strategy/tuple/'s,k,v' (and 'plain' if allowed) entries; the error names
  which entry is bad."""
  parsed = []
  for i, value in enumerate(values):
    try:
      arm = parse_arm(value)
    except (TypeError, ValueError) as e:
      raise ValueError(f"{what}, entry {i} ({value!r}): {e}") from e
    if arm is PLAIN and not allow_plain:
      raise ValueError(f"{what}, entry {i}: 'plain' is an arm of BEG-MAB only")
    parsed.append(arm)
  return tuple(parsed)


def _bucket_arms(thresholds: tuple, arms, plain_arm: bool) -> tuple:
  """One tuple of distinct arms per bucket (PLAIN appended with plain_arm); the error names
  the bucket."""
  arms = list(arms)
  if len(arms) != len(thresholds):
    raise ValueError(f"got {len(arms)} arm lists for {len(thresholds)} buckets "
                     f"(thresholds {list(thresholds)}); pass one list of strategies per "
                     f"threshold")
  parsed = []
  for b, bucket_arms in enumerate(arms):
    what = f"bucket {b} (batch sizes {describe_bucket(thresholds, b)})"
    bucket_arms = _parse_strategies(bucket_arms, what, allow_plain=True)
    if plain_arm and PLAIN not in bucket_arms:
      bucket_arms = bucket_arms + (PLAIN,)
    if not bucket_arms:
      raise ValueError(f"{what} has no arms; give it at least one strategy")
    if len(set(bucket_arms)) != len(bucket_arms):
      raise ValueError(f"{what} lists a strategy twice: {_tuples(bucket_arms)}; "
                       f"each arm must be distinct so rewards have one owner")
    parsed.append(bucket_arms)
  return tuple(parsed)


def _check_epsilon(epsilon) -> None:
  if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or not 0 <= epsilon <= 1:
    raise ValueError(f"epsilon is the exploration probability and must be in [0, 1], "
                     f"got {epsilon!r}")


def _tuples(strategies: Sequence) -> list:
  return [arm_name(s) for s in strategies]


def _is_ready(arm: Strategy | None, ready: Ready) -> bool:
  return arm is PLAIN or ready is None or ready(arm)


def _unique(strategies) -> list[Strategy]:
  """First occurrence order, duplicates and PLAIN dropped: one executable per strategy."""
  return [s for s in dict.fromkeys(strategies) if s is not PLAIN]


# ---------------------------------------------------------------------------------------------
# The interface the rollout engine programs against.
# ---------------------------------------------------------------------------------------------

class Tuner(abc.ABC):
  """Per-bucket strategy choice. Subclasses set `thresholds` and `arms` (a tuple per bucket)."""

  kind: str = ""
  thresholds: tuple[int, ...]
  arms: tuple[tuple[Strategy, ...], ...]

  @abc.abstractmethod
  def choose(self, batch_size: int, ready: Ready = None) -> Strategy | None:
    """The strategy for the next SD call at this batch size (PLAIN: decode plainly).
    ready(strategy) -> bool, if given: only strategies it accepts are eligible (PLAIN, which
    needs no program of its own, always is); PLAIN when none is."""

  def knows(self, batch_size: int, strategy) -> bool:
    """Whether `strategy` is an arm of the bucket of batch_size (an update may report it);
    PLAIN chosen because nothing was ready is not, unless it is an arm itself."""
    return parse_arm(strategy) in self.arms[self.bucket_of(batch_size)]

  def update(self, batch_size: int, strategy, accepted_tokens: float,
             iteration_seconds: float, iterations: int = 1) -> float:
    """Report a call of `iterations` iterations of `strategy` (their mean seconds and tokens
    per running row); returns its reward (goodput). Default: nothing is learnt."""
    bucket = self.bucket_of(batch_size)
    self._arm_index(bucket, strategy)
    return goodput(batch_size, accepted_tokens, iteration_seconds)

  def iterations_for(self, batch_size: int, strategy) -> int | None:
    """At most how many iterations the call about to run `strategy` (what `choose` just
    returned) should take; None: as many as the engine's calls take. Default: None."""
    del batch_size, strategy
    return None

  @abc.abstractmethod
  def state_dict(self) -> dict:
    """A plain JSON-serialisable dict that `load_state_dict` restores exactly."""

  @abc.abstractmethod
  def load_state_dict(self, state: dict) -> None:
    """Restore `state_dict()` output into a tuner built with the same configuration."""

  def summary(self) -> list[dict]:
    """One row per (bucket, arm): bucket, batch_sizes, strategy, pulls, median_reward."""
    return [dict(bucket=b, batch_sizes=describe_bucket(self.thresholds, b),
                 strategy=PLAIN_NAME if s is PLAIN else s.as_tuple(), pulls=None,
                 median_reward=None)
            for b, arms in enumerate(self.arms) for s in arms]

  def bucket_of(self, batch_size: int) -> int:
    """The bucket index that `batch_size` falls in."""
    return bucket_of(self.thresholds, batch_size)

  def bucket_range(self, bucket: int) -> tuple[int, int | None]:
    """(smallest, largest) batch size of `bucket`; largest is None for the last bucket."""
    return bucket_range(self.thresholds, bucket)

  def strategies(self) -> list[Strategy]:
    """Every SD strategy this tuner may ever return, each once, in bucket order."""
    return _unique(s for arms in self.arms for s in arms)

  def strategies_for(self, batch_size: int) -> list[Strategy]:
    """The SD strategies the bucket of `batch_size` may return, in arm order."""
    return [s for s in self.arms[self.bucket_of(batch_size)] if s is not PLAIN]

  def _arm_index(self, bucket: int, strategy) -> int:
    """Position of `strategy` among the bucket's arms; an unknown strategy is a caller bug."""
    strategy = parse_arm(strategy)
    arms = self.arms[bucket]
    if strategy not in arms:
      show = lambda a: PLAIN_NAME if a is PLAIN else str(a.as_tuple())  # noqa: E731
      raise ValueError(
          f"strategy {show(strategy)} is not an arm of bucket {bucket} (batch sizes "
          f"{describe_bucket(self.thresholds, bucket)}); its arms are "
          f"[{', '.join(show(a) for a in arms)}]. Update with the strategy that choose() "
          f"returned for this batch size")
    return arms.index(strategy)

  def _check_config(self, state: dict, **expected) -> None:
    """A checkpoint only fits a tuner with the same kind and arms (executables are per arm)."""
    expected = dict(kind=self.kind, **expected)
    for key, want in expected.items():
      got = state.get(key) if isinstance(state, dict) else None
      if got != want:
        raise ValueError(f"tuner state does not match this tuner: {key} is {got!r} in the state "
                         f"but {want!r} here; build the tuner with the configuration the state "
                         f"was saved from")


# ---------------------------------------------------------------------------------------------
# BEG-MAB: bucketed epsilon-greedy multi-armed bandit.
# ---------------------------------------------------------------------------------------------

class BegMabTuner(Tuner):
  """Per bucket: untried arms first, then epsilon-random, else the best windowed median reward.

  The median (not the mean) over a sliding window resists the occasional slow iteration (a host
  hiccup, a recompile) and lets the choice follow the drafter as spot training improves it and
  the policy drifts away from it. plain_arm=True adds PLAIN to every bucket's arms.
  """

  kind = "beg_mab"

  def __init__(self, thresholds=DEFAULT_THRESHOLDS, arms=DEFAULT_ARMS, epsilon=DEFAULT_EPSILON,
               window=DEFAULT_WINDOW, seed=0, plain_arm=False):
    self.thresholds = validate_thresholds(thresholds)
    self.arms = _bucket_arms(self.thresholds, arms, plain_arm)
    _check_epsilon(epsilon)
    self.epsilon = float(epsilon)
    if not _is_int(window) or window < 1:
      raise ValueError(f"window is the number of rewards kept per arm and must be an integer "
                       f">= 1, got {window!r}")
    self.window = int(window)
    self.seed = int(seed)
    self._rng = np.random.default_rng(self.seed)
    self._rewards = [[deque(maxlen=self.window) for _ in a] for a in self.arms]
    self._medians = [[None] * len(a) for a in self.arms]  # cached: choose() runs every iteration
    self._pulls = [[0] * len(a) for a in self.arms]

  def choose(self, batch_size: int, ready: Ready = None) -> Strategy | None:
    bucket = self.bucket_of(batch_size)
    arms, pulls = self.arms[bucket], self._pulls[bucket]
    eligible = [i for i, a in enumerate(arms) if _is_ready(a, ready)]
    if not eligible:
      return PLAIN
    for i in eligible:
      if pulls[i] == 0:  # no randomness spent here, so the untried phase is the same for every seed
        return arms[i]
    if self._rng.random() < self.epsilon:
      return arms[eligible[int(self._rng.integers(len(eligible)))]]
    medians = self._medians[bucket]
    return arms[max(eligible, key=lambda i: (medians[i], -i))]  # ties: earliest arm

  def update(self, batch_size: int, strategy, accepted_tokens: float,
             iteration_seconds: float, iterations: int = 1) -> float:
    """accepted_tokens: mean tokens per running row per iteration (1 for a PLAIN arm)."""
    bucket = self.bucket_of(batch_size)
    arm = self._arm_index(bucket, strategy)
    reward = goodput(batch_size, accepted_tokens, iteration_seconds)
    window = self._rewards[bucket][arm]
    window.append(reward)
    self._medians[bucket][arm] = statistics.median(window)
    self._pulls[bucket][arm] += 1
    return reward

  def summary(self) -> list[dict]:
    rows = super().summary()
    flat = [(b, i) for b, a in enumerate(self.arms) for i in range(len(a))]
    for row, (b, i) in zip(rows, flat):
      row.update(pulls=self._pulls[b][i], median_reward=self._medians[b][i])
    return rows

  def state_dict(self) -> dict:
    return dict(
        kind=self.kind, thresholds=list(self.thresholds),
        arms=[_tuples(a) for a in self.arms], epsilon=self.epsilon, window=self.window,
        # PCG64 state holds 128-bit Python ints: fine for json, not for 64-bit-only formats.
        rng=self._rng.bit_generator.state,
        rewards=[[list(w) for w in bucket] for bucket in self._rewards],
        pulls=[list(p) for p in self._pulls])

  def load_state_dict(self, state: dict) -> None:
    self._check_config(state, thresholds=list(self.thresholds),
                       arms=[_tuples(a) for a in self.arms], window=self.window)
    missing = [k for k in ("rng", "rewards", "pulls") if k not in state]
    if missing:
      raise ValueError(f"tuner state lacks {missing}; pass what BegMabTuner.state_dict() returned")
    rewards = [[deque((float(r) for r in w), maxlen=self.window) for w in bucket]
               for bucket in state["rewards"]]
    pulls = [[int(n) for n in bucket] for bucket in state["pulls"]]
    if ([len(b) for b in rewards] != [len(a) for a in self.arms]
        or [len(b) for b in pulls] != [len(a) for a in self.arms]):
      raise ValueError("tuner state has reward windows or pull counts that do not match the "
                       "arms; the state is corrupt or from another tuner")
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    # Epsilon stays as constructed: it is configuration, while the state carries what was
    # learnt (windows, counts) and where the random stream stands (so the seed no longer matters).
    self._rng, self._rewards, self._pulls = rng, rewards, pulls
    self._medians = [[statistics.median(w) if w else None for w in bucket] for bucket in rewards]


# ---------------------------------------------------------------------------------------------
# The cheapest arm per token, plain decoding included.
# ---------------------------------------------------------------------------------------------

class CheapestTuner(Tuner):
  """Per bucket, the arm whose token costs the fewest seconds, as measured in the run.

  Every arm (PLAIN always among them) keeps its last `window` calls: iterations, seconds and
  tokens gained per running row per iteration. A call's seconds are a fixed part (dispatch,
  the host's wait; one estimate shared by all arms) plus the arm's seconds per iteration
  times its iterations. An arm's cost per token is (its median seconds per iteration + the
  fixed part / iterations_per_call) / its mean tokens per iteration: what a token costs in the
  calls the engine runs. Running rows cancel out of the comparison (a bucket runs at one
  program batch, whose iteration costs the same whatever its rows), so an arm measured at 100
  rows and one at 40 compare fairly.

  Untried arms first, then with probability epsilon a random ready arm, else the cheapest.
  Those exploring choices run `explore_iterations` iterations (`iterations_for`): a losing arm
  costs a few iterations, never a whole call.
  """

  kind = "cheapest"

  def __init__(self, thresholds=DEFAULT_THRESHOLDS, arms=DEFAULT_ARMS, epsilon=0.05,
               window=64, seed=0, explore_iterations=4, iterations_per_call=32):
    self.thresholds = validate_thresholds(thresholds)
    self.arms = _bucket_arms(self.thresholds, arms, plain_arm=True)
    _check_epsilon(epsilon)
    for name, value in (("window", window), ("explore_iterations", explore_iterations),
                        ("iterations_per_call", iterations_per_call)):
      if not _is_int(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    self.epsilon, self.window, self.seed = float(epsilon), int(window), int(seed)
    self.explore_iterations = int(explore_iterations)
    self.iterations_per_call = int(iterations_per_call)
    self._rng = np.random.default_rng(self.seed)
    self._calls = [[deque(maxlen=self.window) for _ in a] for a in self.arms]
    self._call_s = 0.0
    self._exploring = False

  def choose(self, batch_size: int, ready: Ready = None) -> Strategy | None:
    bucket = self.bucket_of(batch_size)
    arms, calls = self.arms[bucket], self._calls[bucket]
    eligible = [i for i, a in enumerate(arms) if _is_ready(a, ready)]
    self._exploring = True
    for i in eligible:
      if not calls[i]:
        return arms[i]
    if self._rng.random() < self.epsilon:
      return arms[eligible[int(self._rng.integers(len(eligible)))]]
    self._exploring = False
    costs = [self.cost_per_token(bucket, i) for i in eligible]
    return arms[eligible[int(np.argmin(costs))]]  # ties: earliest arm

  def iterations_for(self, batch_size: int, strategy) -> int | None:
    return self.explore_iterations if self._exploring else None

  def cost_per_token(self, bucket: int, arm: int) -> float:
    """Seconds per token of arm `arm` of `bucket` in a call of iterations_per_call (inf when
    it has no calls yet)."""
    calls = self._calls[bucket][arm]
    if not calls:
      return math.inf
    n, seconds, tokens = (np.asarray(x, np.float64) for x in zip(*calls))
    per_iteration = max(float(np.median((seconds - self._call_s) / n)), 0.0)
    accept = float(np.sum(tokens * n) / np.sum(n))
    return (per_iteration + self._call_s / self.iterations_per_call) / max(accept, 1e-9)

  def update(self, batch_size: int, strategy, accepted_tokens: float,
             iteration_seconds: float, iterations: int = 1) -> float:
    """accepted_tokens: mean tokens per running row per iteration (1 for PLAIN);
    iteration_seconds: the call's seconds over its iterations."""
    bucket = self.bucket_of(batch_size)
    arm = self._arm_index(bucket, strategy)
    reward = goodput(batch_size, accepted_tokens, iteration_seconds)
    if not _is_int(iterations) or iterations < 1:
      raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    self._calls[bucket][arm].append((int(iterations), float(iteration_seconds) * iterations,
                                     float(accepted_tokens)))
    self._call_s = self._fit_call_s()
    return reward

  def _fit_call_s(self) -> float:
    """The calls' fixed seconds: least squares of seconds = fixed + (the arm's seconds per
    iteration) x iterations over every kept call. Only an arm whose calls ran different
    numbers of iterations tells the two apart; without one, 0 (and then nothing needs it)."""
    kept = [(n, s, (b, i)) for b, arms in enumerate(self._calls) for i, calls in enumerate(arms)
            for n, s, _ in calls]
    lengths: dict = {}
    for n, _, arm in kept:
      lengths.setdefault(arm, set()).add(n)
    if not any(len(v) > 1 for v in lengths.values()):
      return 0.0
    arms = sorted(lengths)
    a = np.zeros((len(kept), 1 + len(arms)))
    a[:, 0] = 1.0
    for row, (n, _, arm) in enumerate(kept):
      a[row, 1 + arms.index(arm)] = n
    solution = np.linalg.lstsq(a, np.asarray([s for _, s, _ in kept]), rcond=None)[0]
    return max(float(solution[0]), 0.0)

  def summary(self) -> list[dict]:
    rows = super().summary()
    flat = [(b, i) for b, a in enumerate(self.arms) for i in range(len(a))]
    for row, (b, i) in zip(rows, flat):
      cost = self.cost_per_token(b, i)
      row.update(pulls=len(self._calls[b][i]),
                 median_reward=None if math.isinf(cost) else 1.0 / cost)
    return rows

  def state_dict(self) -> dict:
    return dict(kind=self.kind, thresholds=list(self.thresholds),
                arms=[_tuples(a) for a in self.arms], window=self.window,
                rng=self._rng.bit_generator.state, call_s=self._call_s,
                calls=[[[list(c) for c in calls] for calls in b] for b in self._calls])

  def load_state_dict(self, state: dict) -> None:
    self._check_config(state, thresholds=list(self.thresholds),
                       arms=[_tuples(a) for a in self.arms], window=self.window)
    if any(k not in state for k in ("rng", "calls", "call_s")):
      raise ValueError("tuner state lacks rng, calls or call_s; pass what "
                       "CheapestTuner.state_dict() returned")
    calls = [[deque((tuple(c) for c in arm), maxlen=self.window) for arm in b]
             for b in state["calls"]]
    if [len(b) for b in calls] != [len(a) for a in self.arms]:
      raise ValueError("tuner state has call windows that do not match the arms; the state "
                       "is corrupt or from another tuner")
    rng = np.random.default_rng()
    rng.bit_generator.state = state["rng"]
    self._rng, self._calls, self._call_s = rng, calls, float(state["call_s"])


# ---------------------------------------------------------------------------------------------
# Fixed policies: the baselines BEG-MAB is compared against.
# ---------------------------------------------------------------------------------------------

class TableTuner(Tuner):
  """One fixed strategy per batch-size bucket; update() learns nothing."""

  kind = "table"

  def __init__(self, thresholds=DEFAULT_THRESHOLDS, strategies=DEFAULT_TABLE):
    self.thresholds = validate_thresholds(thresholds)
    strategies = _parse_strategies(strategies, "table strategies")
    if len(strategies) != len(self.thresholds):
      raise ValueError(f"got {len(strategies)} strategies for {len(self.thresholds)} buckets "
                       f"(thresholds {list(self.thresholds)}); pass one strategy per threshold")
    self.arms = tuple((s,) for s in strategies)

  def choose(self, batch_size: int, ready: Ready = None) -> Strategy | None:
    strategy = self.arms[self.bucket_of(batch_size)][0]
    return strategy if _is_ready(strategy, ready) else PLAIN

  def state_dict(self) -> dict:
    return dict(kind=self.kind, thresholds=list(self.thresholds),
                strategies=[list(a[0].as_tuple()) for a in self.arms])

  def load_state_dict(self, state: dict) -> None:
    self._check_config(state, thresholds=list(self.thresholds),
                       strategies=[list(a[0].as_tuple()) for a in self.arms])


class FixedTuner(Tuner):
  """The same strategy at every batch size (the original system's default is (8, 4, 48))."""

  kind = "fixed"

  def __init__(self, strategy=DEFAULT_STRATEGY):
    self.thresholds = (1,)
    self.arms = (_parse_strategies([strategy], "fixed strategy"),)

  @property
  def strategy(self) -> Strategy:
    return self.arms[0][0]

  def choose(self, batch_size: int, ready: Ready = None) -> Strategy | None:
    check_batch_size(batch_size)
    return self.strategy if _is_ready(self.strategy, ready) else PLAIN

  def state_dict(self) -> dict:
    return dict(kind=self.kind, strategy=list(self.strategy.as_tuple()))

  def load_state_dict(self, state: dict) -> None:
    self._check_config(state, strategy=list(self.strategy.as_tuple()))


# ---------------------------------------------------------------------------------------------
# Construction from configs.
# ---------------------------------------------------------------------------------------------

TUNERS = {"beg_mab": BegMabTuner, "cheapest": CheapestTuner, "table": TableTuner,
          "fixed": FixedTuner}


def make_tuner(kind: str, **kwargs) -> Tuner:
  """A tuner by name ("beg_mab", "cheapest", "table", "fixed"); kwargs go to its
  constructor."""
  if kind not in TUNERS:
    raise ValueError(f"rollout.speculative.tuner={kind!r} is not allowed; allowed values: "
                     f"{tuple(TUNERS)}")
  return TUNERS[kind](**kwargs)
