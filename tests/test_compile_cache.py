"""The persistent compilation cache: rollout slices share one compile of a program; programs a
cached copy could stall stay out of it; the environment turns it off."""

import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests import cheap_compiles
from tlt_jax.compile_cache import (COMPILES, CompileCounter, collectives_in_several_sequences,
                                   guard_cpu_collectives, share_across_devices)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_program_compiled_for_one_slice_is_loaded_for_another():
  """Two 2-device slices run one sharded program (its sum over the sharded axis is a
  collective): the second slice loads the first one's executable from the cache, runs on its
  own devices and computes the same."""
  assert share_across_devices()
  counter = CompileCounter()
  counter.start()
  salt = np.float32(time.time_ns() % 100_003)  # a program no earlier run has cached

  def program(x, w):
    for _ in range(4):
      x = jnp.tanh(x @ w + salt)
    return x, x.sum()

  results = []
  for devices in (jax.devices()[0:2], jax.devices()[2:4]):
    mesh = Mesh(np.asarray(devices), ("batch",))
    x = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100,
                       NamedSharding(mesh, P("batch")))
    w = jax.device_put(np.eye(16, dtype=np.float32) / 2, NamedSharding(mesh, P()))
    before = (counter.requests, counter.hits)
    out, total = jax.jit(program)(x, w)
    assert out.sharding.device_set == set(devices) == total.sharding.device_set
    results.append((np.asarray(out), float(total), counter.requests - before[0],
                    counter.hits - before[1]))
  (out0, total0, asked0, hits0), (out1, total1, asked1, hits1) = results
  assert asked0 == asked1 >= 1
  assert hits0 == 0 and hits1 == asked1  # compiled once, loaded for the second slice
  np.testing.assert_array_equal(out0, out1)
  assert total0 == total1


def _fsdp_programs(mesh, salt):
  """Two programs over `mesh`'s 2 devices: `looped` gathers each layer's sharded weight inside
  a scan and sums a batch-sharded mask outside it (collectives in two computations, as in the
  SFT step); `flat` has its collectives in its entry computation only."""

  def looped(ws, x, mask):
    def layer(h, w):
      w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
      return jnp.tanh(h @ w + salt), None
    h, _ = jax.lax.scan(layer, x, ws)
    return h.sum(), mask.sum()

  def flat(ws, x, mask):
    return (x @ ws[0] + salt).sum(), mask.sum()

  ws = jax.device_put(np.ones((3, 16, 16), np.float32) / 16, NamedSharding(mesh, P(None, "d")))
  x = jax.device_put(np.ones((4, 16), np.float32), NamedSharding(mesh, P("d")))
  return looped, flat, (ws, x, x)


def test_collectives_in_a_loop_and_outside_it_are_found_in_the_hlo():
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("d",))
  looped, flat, args = _fsdp_programs(mesh, np.float32(0.5))
  assert collectives_in_several_sequences(jax.jit(looped).lower(*args).compile().as_text())
  assert not collectives_in_several_sequences(jax.jit(flat).lower(*args).compile().as_text())


def test_programs_a_cached_copy_could_stall_never_come_from_the_cache():
  """XLA:CPU's deserializer drops the order between a loop's collectives and the others
  (tlt_jax.compile_cache.guard_cpu_collectives): such a program is compiled in every process,
  never written to the cache nor loaded from it, even from an entry an earlier version wrote;
  a program with its collectives in one computation is still loaded."""
  from jax._src import compilation_cache

  assert guard_cpu_collectives()  # conftest installed it; a second call changes nothing
  counter = CompileCounter()
  counter.start()
  mesh = Mesh(np.asarray(jax.devices()[:2]), ("d",))
  salt = np.float32(time.time_ns() % 100_003)  # programs no earlier run has cached

  def hits_of(program, args) -> int:
    jax.clear_caches()  # the next call looks the program up in the persistent cache again
    before = counter.hits
    jax.block_until_ready(jax.jit(program)(*args))
    return counter.hits - before

  looped, flat, args = _fsdp_programs(mesh, salt)
  assert [hits_of(flat, args) for _ in range(2)] == [0, 1]
  kept_out = COMPILES.kept_out
  assert [hits_of(looped, args) for _ in range(2)] == [0, 0]
  assert COMPILES.kept_out - kept_out == 2  # the jobs' summaries say so

  # An entry written before the guard existed is not loaded either.
  unguarded_put = compilation_cache.put_executable_and_time.__wrapped__
  original = compilation_cache.put_executable_and_time
  compilation_cache.put_executable_and_time = unguarded_put
  try:
    assert hits_of(looped, args) == 0  # compiled, and now written
  finally:
    compilation_cache.put_executable_and_time = original
  assert hits_of(looped, args) == 0
  np.testing.assert_allclose(jax.jit(looped)(*args)[1], 4 * 16)


def test_no_compilation_cache_wins_over_jax_compilation_cache_dir(tmp_path):
  """TLT_JAX_NO_COMPILATION_CACHE=1 turns the cache off even where JAX_COMPILATION_CACHE_DIR
  names a folder (which JAX reads by itself): nothing is written there."""
  script = ("import jax, jax.numpy as jnp\n"
            "from tlt_jax.compile_cache import enable_compilation_cache\n"
            "assert enable_compilation_cache() is None\n"
            "jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones(5)).block_until_ready()\n")
  env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "cache"),
             TLT_JAX_NO_COMPILATION_CACHE="1", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             PYTHONPATH=REPO)
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                        text=True)
  assert proc.returncode == 0, proc.stderr[-2000:]
  written = list((tmp_path / "cache").rglob("*")) if (tmp_path / "cache").exists() else []
  assert written == []


@pytest.mark.slow
def test_sft_from_a_warm_cache_beside_a_cpu_load_never_stalls(tmp_path):
  """The SFT job of tiny_sft.py:runlocal's shape, run from a warm compilation cache while
  another process keeps a core busy: the run ends. (Its step, loaded from the cache before
  the guard, had its two devices wait in different collectives until XLA aborted the
  process, on the first warm run, in every run tried; `python tests/sft_cache_stress.py`
  runs it as often as asked, and ran 20 warm runs without a stall.) XLA:CPU's fusion
  emitters, as the jobs compile: the suite's older emitters (tests/cheap_compiles.py) make a
  step that did not stall in 8 warm runs."""
  runs = 2  # the first fills the cache
  flags = os.environ.get("XLA_FLAGS", "").replace(cheap_compiles.FLAG, "").strip()
  env = dict(os.environ, XLA_FLAGS=flags, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  # The load runs at the lowest priority: it keeps a core busy whenever the core would idle,
  # as the stall needed, and yields it to the suite's other tests on a busy machine.
  load = subprocess.Popen([sys.executable, "-c", "import os\nos.nice(19)\nwhile True: pass"])
  try:
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "tests", "sft_cache_stress.py"),
         str(tmp_path / "cache"), str(tmp_path / "runs"), str(runs)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1800)
  finally:
    load.kill()
    load.wait()
  assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
  lines = [line for line in proc.stdout.splitlines() if line.startswith("run ")]
  assert len(lines) == runs
  loaded = [int(line.split(", ")[1].split()[0]) for line in lines]
  assert loaded[0] == 0 and min(loaded[1:]) > 0  # every later run loads from the cache
