"""The host-side scheduler of one rollout slice: a pure state machine over its queue and rows.

No JAX here: the scheduler decides, the engine (or the cluster simulator) carries the decision
out and reports which rows finished. Rows are the slots of the slice's batch; row i holds
request `rows[i]` or -1 when free. Decisions, in order:

  start     no batch yet: prefill the first `max_batch` queued requests into a batch of the
            smallest power-of-two size that holds them;
  refill    requests wait and rows are free: prefill a group of them into the free rows
            (continuous batching);
  compact   nothing waits and the running rows fit a smaller power-of-two batch: gather them
            into it (finished rows ride along as inert padding);
  decode    run up to `iterations_per_call` decode iterations in one compiled call (fewer when
            the tuner explores: `iterations_for`): plain steps, or SD iterations with the
            tuner's strategy once `sd_threshold` or fewer rows run. The call stops early, on
            the device, once fewer than `min_running` rows are running: the first point at
            which one of the decisions above would change (a refill, a smaller program batch,
            the tail's start, or another tuner bucket: `choice_floor`).

A tuner may answer None for a batch size ("decode plainly here"): adaptive SD then never does
worse than plain decoding where no strategy pays.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Sequence

from tlt_jax.speculative.strategy import Strategy


def bucket(n: int, cap: int, sizes: Sequence[int] = ()) -> int:
  """The program batch (or width) for n rows: the smallest of `sizes` that holds n, or with no
  sizes the next power of two; at most cap."""
  if sizes:
    return min([s for s in sizes if s >= n], default=cap)
  return min(cap, 1 << max(0, (n - 1).bit_length()))


def batch_ladder(max_batch: int, sizes: Sequence[int] = ()) -> tuple[int, ...]:
  """The program batch sizes of a slice, ascending: `sizes` and max_batch, or with no sizes
  every power of two up to max_batch."""
  if sizes:
    return tuple(sorted({*sizes, max_batch}))
  return tuple(1 << i for i in range(max_batch.bit_length()))


@dataclasses.dataclass(frozen=True)
class Start:
  """Prefill `requests` into a fresh batch of `batch` rows (rows past them are padding)."""
  requests: tuple[int, ...]
  batch: int


@dataclasses.dataclass(frozen=True)
class Refill:
  """Prefill `requests` as a group of `group` rows and put them into rows `rows` (same
  order; group rows past len(requests) are padding and go nowhere)."""
  requests: tuple[int, ...]
  group: int
  rows: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Compact:
  """Gather rows `order` (running rows first) into a batch of len(order) rows."""
  order: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Decode:
  """Up to `max_iterations` iterations (SD with `strategy`, plain when it is None), stopping once
  fewer than `min_running` rows run. `running` rows run at the start; `tail` says the SD
  decision (the tuner's) was taken for this batch size."""
  strategy: Strategy | None
  running: int
  min_running: int
  max_iterations: int
  tail: bool


Action = Start | Refill | Compact | Decode


class SliceScheduler:
  """The queue and rows of one slice; see the module docstring.

  choose_strategy(running) -> Strategy | None is asked once the slice is in its tail
  (running rows <= sd_threshold); None there, or sd_threshold 0, means plain decoding.
  batch_sizes: the program batch sizes a batch may have (`batch_ladder`; () = every power of
  two): batches start, refill and compact to the smallest of them that holds their rows.
  choice_floor(running) -> int: the fewest running rows for which the tail's choice is the
  one made for `running` (the tuner bucket's first batch size); a tail call runs until the
  rows fall below it or out of the program batch's range. None: until any row finishes.
  iterations_for(running, strategy) -> int | None: at most how many iterations the call
  about to run the tail's choice takes (None: iterations_per_call).
  """

  def __init__(self, requests: Sequence[int], max_batch: int, sd_threshold: int = 0,
               iterations_per_call: int = 1,
               choose_strategy: Callable[[int], Strategy | None] | None = None,
               batch_sizes: Sequence[int] = (),
               choice_floor: Callable[[int], int] | None = None,
               iterations_for: Callable[[int, Strategy | None], int | None] | None = None):
    if max_batch < 1 or max_batch & (max_batch - 1):
      raise ValueError(f"max_batch={max_batch} must be a power of two")
    if iterations_per_call < 1:
      raise ValueError(f"iterations_per_call={iterations_per_call} must be >= 1")
    self.queue = deque(requests)
    self.max_batch = max_batch
    self.sd_threshold = sd_threshold
    self.iterations_per_call = iterations_per_call
    self.choose_strategy = choose_strategy
    self.choice_floor = choice_floor
    self.iterations_for = iterations_for
    self.sizes = batch_ladder(max_batch, batch_sizes)
    self.rows: list[int] = []

  # ---------------------------------------------------------------- state

  @property
  def running(self) -> int:
    return sum(r >= 0 for r in self.rows)

  @property
  def busy(self) -> bool:
    return bool(self.queue) or any(r >= 0 for r in self.rows)

  @property
  def batch(self) -> int:
    """Rows of the current batch (0 before the first start and after the last finish)."""
    return len(self.rows)

  # ---------------------------------------------------------------- decisions

  def next_action(self) -> Action | None:
    """The next thing to do, already applied to the scheduler's rows; None when done.

    Start, Refill and Compact change the rows at once; Decode changes nothing until
    `finished` reports the rows that ended.
    """
    if not self.busy:
      self.rows = []
      return None
    if not self.rows:
      ids = tuple(self._take(self.max_batch))
      batch = self._bucket(len(ids))
      self.rows = list(ids) + [-1] * (batch - len(ids))
      return Start(ids, batch)
    free = [i for i, r in enumerate(self.rows) if r < 0]
    if self.queue and free:
      ids = tuple(self._take(len(free)))
      for row, r in zip(free, ids):
        self.rows[row] = r
      return Refill(ids, self._bucket(len(ids)), tuple(free[:len(ids)]))
    running = [i for i, r in enumerate(self.rows) if r >= 0]
    target = self._bucket(len(running))
    if not self.queue and target < len(self.rows):
      order = (running + free)[:target]
      self.rows = [self.rows[i] for i in order]
      return Compact(tuple(order))
    return self._decode(len(running))

  def _decode(self, running: int) -> Decode:
    tail = self.choose_strategy is not None and running <= self.sd_threshold
    strategy = self.choose_strategy(running) if tail else None
    # Decode until the rows fit the next smaller batch (compaction) ...
    smaller = [b for b in self.sizes if b < len(self.rows)]
    fits_smaller = max(smaller, default=0) + 1
    if self.queue or (tail and self.choice_floor is None):
      # ... unless a finished row is work for the host at once: a refill, or (in the tail,
      # without a floor) a new choice of the tuner.
      min_running = running
    elif tail:  # ... or the tuner's choice changes
      min_running = max(fits_smaller, self.choice_floor(running))
    else:  # ... or the tail begins
      min_running = fits_smaller
      if self.choose_strategy is not None:
        min_running = max(min_running, self.sd_threshold + 1)
    iterations = self.iterations_per_call
    if tail and self.iterations_for is not None:
      iterations = min(iterations, self.iterations_for(running, strategy) or iterations)
    return Decode(strategy, running, min(min_running, running), iterations, tail)

  def finished(self, done_rows: Sequence[int]) -> list[int]:
    """Frees the rows that finished (row indices of the current batch); returns their
    request ids in row order. Rows already free are ignored."""
    out = []
    for i in sorted(done_rows):
      if self.rows[i] >= 0:
        out.append(self.rows[i])
        self.rows[i] = -1
    if not self.busy:
      self.rows = []
    return out

  def _bucket(self, n: int) -> int:
    return bucket(n, self.max_batch, self.sizes)

  def _take(self, n: int) -> list[int]:
    return [self.queue.popleft() for _ in range(min(n, len(self.queue)))]
