"""The executable pool: compiles on demand and ahead, the bill, queue order, failures."""

import gc
import os
import subprocess
import sys
import threading
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.rollout.pool import ExecutablePool, merge_bills, wait_for_compiles_ahead

X = jax.ShapeDtypeStruct((4,), jnp.float32)


def _wait(pool, timeout=60):
  deadline = time.time() + timeout
  while pool.pending() and time.time() < deadline:
    time.sleep(0.01)
  assert not pool.pending()


def _blocker(gate: threading.Event, traced: list, name: str):
  """A program whose tracing waits for `gate`: it holds the background thread."""
  def fn(x):
    traced.append(name)
    assert gate.wait(60)
    return x + 1
  return fn


def _program(traced: list, name: str, scale: float = 2.0):
  def fn(x):
    traced.append(name)
    return x * scale
  return fn


def test_compiled_ahead_is_ready_and_served_without_compiling_again():
  pool = ExecutablePool()
  traced = []
  pool.compile_ahead("double", _program(traced, "double"), (X,), kind="decode")
  pool.compile_ahead("double", _program(traced, "double"), (X,), kind="decode")  # once only
  _wait(pool)
  assert pool.ready("double") and traced == ["double"]
  exe = pool.get("double", _program(traced, "unused"), (X,), kind="decode")
  np.testing.assert_allclose(exe(jnp.ones(4)), 2 * np.ones(4))
  assert traced == ["double"] and pool.compiles == 0 and pool.ahead_compiles == 1
  pool.get("half", _program(traced, "half", 0.5), (X,), kind="decode")  # on demand
  line = pool.bill["decode"]
  assert (line["programs"], line["ahead_programs"]) == (1, 1)
  assert line["seconds"] > 0 and line["ahead_seconds"] > 0
  assert pool.first_uses == 2
  other = ExecutablePool()
  other.get("one", _program([], "one"), (X,), kind="decode")
  other.get("two", _program([], "two"), (X,), kind="prefill")
  merged = merge_bills([pool, other])
  assert list(merged) == ["decode", "prefill"]
  assert merged["decode"]["programs"] == 2 and merged["decode"]["ahead_programs"] == 1
  assert merged["prefill"]["programs"] == 1


def test_queue_runs_by_priority_and_a_queued_key_asked_for_compiles_at_once():
  pool = ExecutablePool()
  gate, traced = threading.Event(), []
  pool.compile_ahead("hold", _blocker(gate, traced, "hold"), (X,))
  while traced != ["hold"]:  # the background thread is busy with it
    time.sleep(0.01)
  pool.compile_ahead("late", _program(traced, "late"), (X,), priority=1)
  pool.compile_ahead("first", _program(traced, "first"), (X,))
  pool.compile_ahead("second", _program(traced, "second"), (X,))
  pool.compile_ahead("now", _program(traced, "now"), (X,))
  assert not pool.ready("now") and pool.pending() == 5
  pool.get("now", _program(traced, "now"), (X,))  # queued, not started: compiled here
  assert traced == ["hold", "now"] and pool.compiles == 1
  pool.close()  # drops what is queued; the running compile finishes
  gate.set()
  _wait(pool)
  assert traced == ["hold", "now"] and pool.ready("hold") and not pool.ready("first")
  gate.clear()
  pool.compile_ahead("hold2", _blocker(gate, traced, "hold2"), (X,))
  while traced[-1] != "hold2":
    time.sleep(0.01)
  pool.compile_ahead("late", _program(traced, "late"), (X,), priority=1)
  pool.compile_ahead("first", _program(traced, "first"), (X,))
  pool.compile_ahead("second", _program(traced, "second"), (X,))
  gate.set()
  _wait(pool)
  # The lowest priority number first, then the order asked.
  assert traced[2:] == ["hold2", "first", "second", "late"]


def test_a_queued_compile_does_not_keep_its_arrays_alive():
  """The rollout queues its tail's programs with the weights of the moment; after an update
  those weights must be freed, not held by compiles still waiting in the queue."""
  pool = ExecutablePool()
  gate, traced = threading.Event(), []
  pool.compile_ahead("hold", _blocker(gate, traced, "hold"), (X,))
  while traced != ["hold"]:
    time.sleep(0.01)
  weights = jnp.arange(4.0)
  alive = weakref.ref(weights)
  pool.compile_ahead("scaled", lambda w, x: w * x, (weights, X))
  del weights
  gc.collect()
  assert alive() is None and not pool.ready("scaled")
  gate.set()
  _wait(pool)
  exe = pool.get("scaled", None, ())
  np.testing.assert_allclose(exe(jnp.arange(4.0), jnp.ones(4)), np.arange(4.0))


def test_waiting_for_compiles_ahead_outlasts_the_compile_a_closed_pool_left_running():
  """Closing a pool drops its queued compiles, not the one running; waiting returns only
  after that one ended (what must happen before its compilation cache folder goes)."""
  pool, gate, traced = ExecutablePool(), threading.Event(), []
  pool.compile_ahead("running", _blocker(gate, traced, "running"), (X,))
  pool.compile_ahead("queued", _program(traced, "queued"), (X,))
  deadline = time.time() + 60
  while not traced and time.time() < deadline:
    time.sleep(0.01)
  pool.close()
  waiter = threading.Thread(target=wait_for_compiles_ahead)
  waiter.start()
  waiter.join(0.5)
  assert waiter.is_alive()  # the running compile holds it
  gate.set()
  waiter.join(60)
  assert not waiter.is_alive()
  assert pool.ready("running") and not pool.pending()
  assert traced == ["running"]  # the queued one was dropped, not compiled


def test_a_failed_compile_ahead_is_raised_where_the_key_is_used():
  pool = ExecutablePool()

  def broken(x):
    raise ValueError("shapes do not fit")
  pool.compile_ahead("broken", broken, (X,))
  _wait(pool)
  with pytest.raises(RuntimeError, match="compiling 'broken' ahead failed: shapes do not fit"):
    pool.ready("broken")
  with pytest.raises(RuntimeError, match="ahead failed"):
    pool.get("broken", broken, (X,))


def test_a_full_pool_is_an_error_that_names_the_key():
  pool = ExecutablePool(max_size=1)
  pool.get("a", _program([], "a"), (X,))
  with pytest.raises(RuntimeError, match="pool is full \\(1\\); new key 'b'"):
    pool.compile_ahead("b", _program([], "b"), (X,))


def test_an_exiting_process_drops_the_compiles_still_queued():
  """At exit the compile in flight finishes and the queued ones do not run: with four
  compiles that take 3 s each to trace, the process ends about 2.5 s after its last line,
  not 11.5 s. Four functions, not one: JAX would trace one function once for all four."""
  script = """
import time, jax, jax.numpy as jnp
from tlt_jax.rollout.pool import ExecutablePool
def slow(i):
  def program(x):
    time.sleep(3)
    return x + i
  return program
pool = ExecutablePool()
for i in range(4):
  pool.compile_ahead(i, slow(i), (jax.ShapeDtypeStruct((2,), jnp.float32),))
time.sleep(0.5)
print(time.time(), flush=True)
"""
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode == 0, out.stderr[-2000:]
  assert time.time() - float(out.stdout.split()[-1]) < 7
