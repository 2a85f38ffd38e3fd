"""The slice scheduler on its own: host decisions from the queue and the rows, no JAX."""

import pytest

from tlt_jax.rollout.scheduler import (Compact, Decode, Refill, SliceScheduler, Start,
                                       bucket)
from tlt_jax.speculative.strategy import Strategy

SD = Strategy(3, 2, 6)


def test_bucket():
  assert [bucket(n, 8) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 8]


def test_start_refill_and_decode_while_requests_wait():
  s = SliceScheduler(range(10, 16), max_batch=4, iterations_per_call=16)
  assert s.next_action() == Start((10, 11, 12, 13), 4)
  # Requests wait: every finished row is work for the host, so the call stops at the first.
  assert s.next_action() == Decode(None, 4, 4, 16, False)
  assert s.finished([2, 0]) == [10, 12]
  assert s.next_action() == Refill((14, 15), 2, (0, 2))
  assert s.rows == [14, 11, 15, 13]
  assert s.next_action() == Decode(None, 4, 3, 16, False)  # nothing waits: half the batch


def test_compaction_and_the_switch_to_sd():
  chosen = []

  def choose(running):
    chosen.append(running)
    return SD
  s = SliceScheduler(range(8), max_batch=8, sd_threshold=2, iterations_per_call=32,
                     choose_strategy=choose)
  assert s.next_action() == Start(tuple(range(8)), 8)
  # Plain decoding until 4 rows fit half the batch; the tail starts at 2.
  assert s.next_action() == Decode(None, 8, 5, 32, False)
  s.finished([0, 3, 5, 6])
  assert s.next_action() == Compact((1, 2, 4, 7))
  assert s.rows == [1, 2, 4, 7]
  assert s.next_action() == Decode(None, 4, 3, 32, False)  # 3 = sd_threshold + 1
  s.finished([1])
  assert s.next_action() == Decode(None, 3, 3, 32, False)
  s.finished([0])
  assert s.next_action() == Compact((2, 3))
  # The tail: the tuner picks; any finish ends the call (a new batch size for the tuner).
  assert s.next_action() == Decode(SD, 2, 2, 32, True)
  assert chosen == [2]
  s.finished([1])
  assert s.next_action() == Compact((0,))
  assert s.next_action() == Decode(SD, 1, 1, 32, True)
  assert s.finished([0]) == [4]
  assert not s.busy and s.next_action() is None and s.rows == []


def test_a_tuner_may_choose_plain_decoding_in_the_tail():
  s = SliceScheduler([0, 1], max_batch=2, sd_threshold=2, choose_strategy=lambda n: None)
  s.next_action()
  assert s.next_action() == Decode(None, 2, 2, 1, True)


def test_rows_done_at_prefill_and_repeated_reports():
  s = SliceScheduler([7, 8, 9], max_batch=2)
  assert s.next_action() == Start((7, 8), 2)
  assert s.finished([0, 1]) == [7, 8]  # both ended in the prefill
  assert s.finished([0]) == []         # already free: ignored
  assert s.next_action() == Refill((9,), 1, (0,))
  assert s.next_action() == Compact((0,))
  assert s.next_action() == Decode(None, 1, 1, 1, False)


def test_padding_rows_of_a_small_start():
  s = SliceScheduler([4, 5, 6], max_batch=8)
  assert s.next_action() == Start((4, 5, 6), 4)
  assert s.rows == [4, 5, 6, -1] and s.running == 3


def test_bad_settings():
  with pytest.raises(ValueError, match="power of two"):
    SliceScheduler([1], max_batch=3)
  with pytest.raises(ValueError, match="iterations_per_call=0"):
    SliceScheduler([1], max_batch=2, iterations_per_call=0)


def test_a_batch_ladder_sets_where_batches_start_and_compact():
  """With program batch sizes (1, 4) under max_batch 16, a batch starts at 16 and compacts
  straight to 4 once 4 rows run, and to 1 at the last; plain decoding runs until the rows
  fit the next smaller size."""
  assert bucket(3, 16, (1, 4, 16)) == 4 and bucket(5, 16, (1, 4, 16)) == 16
  s = SliceScheduler(range(10), max_batch=16, iterations_per_call=8, batch_sizes=(4, 1))
  assert s.sizes == (1, 4, 16)
  assert s.next_action() == Start(tuple(range(10)), 16)
  assert s.next_action() == Decode(None, 10, 5, 8, False)  # until 4 rows fit a batch of 4
  s.finished([0, 1, 2, 3, 4, 5])
  assert s.next_action() == Compact((6, 7, 8, 9))
  assert s.next_action() == Decode(None, 4, 2, 8, False)
  s.finished([0, 1, 2])
  assert s.next_action() == Compact((3,))
  assert s.next_action() == Decode(None, 1, 1, 8, False)


def test_a_tail_call_runs_until_the_tuners_choice_or_the_batch_changes():
  """With a floor (the tuner bucket's first batch size), rows that finish inside the bucket
  and the program batch do not end the call; an exploring choice caps its iterations."""
  s = SliceScheduler(range(8), max_batch=8, sd_threshold=8, iterations_per_call=32,
                     choose_strategy=lambda n: SD if n >= 3 else None,
                     choice_floor=lambda n: 3 if n >= 3 else 1,
                     iterations_for=lambda n, strategy: 4 if strategy is None else None)
  s.next_action()
  # 8 rows: until 4 fit half the batch (the bucket's floor, 3, is lower).
  assert s.next_action() == Decode(SD, 8, 5, 32, True)
  s.finished([0, 1, 2, 3])
  assert s.next_action() == Compact((4, 5, 6, 7))
  assert s.next_action() == Decode(SD, 4, 3, 32, True)  # the bucket ends below 3 rows
  s.finished([0, 1])
  assert s.next_action() == Compact((2, 3))
  assert s.next_action() == Decode(None, 2, 2, 4, True)  # explored: 4 iterations at most
