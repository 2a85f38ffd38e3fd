"""Test setup: 8 emulated CPU devices, configured before JAX initialises a backend."""

import atexit
import os
import shutil
import tempfile

from tests import cheap_compiles

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Compiles dominate test time on CPU. A persistent compilation cache, fresh for each session
# and shared with the command-line runs that tests start (they inherit the environment),
# compiles each program once per session instead of once per engine or process.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache = tempfile.mkdtemp(prefix="tlt_jax_xla_cache_")
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Tests check behaviour, not speed, and on CPU their time goes to compiles: XLA's cheapest
# compiles (most optimisation passes off) take about 40% less time. The command-line runs
# that tests start inherit it; the jobs and benchmarks themselves keep XLA's defaults.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _run_on_this_workers_share_of_the_cpus() -> None:
  """Under pytest-xdist, each worker (and the runs it starts, which inherit it) runs on its
  own share of the CPUs. JAX sizes its CPU thread pool by the CPUs a process may use, and the
  tests' programs are too small to gain from threads: with 2 workers on 2 cores each worker's
  8 emulated devices spread threads over both cores, and a test file took 28 s alone and 60 s
  beside two busy processes; on one core, 25 s and 35 s (tests/speculative/
  test_tree_and_strategy.py, 2026-11-29)."""
  worker = os.environ.get("PYTEST_XDIST_WORKER", "")
  count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
  if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
    return
  os.sched_setaffinity(0, cheap_compiles.worker_cpus(int(worker[2:]), count))


_run_on_this_workers_share_of_the_cpus()
# XLA:CPU's older emitters, where this XLA has them, and one code module per CPU this worker
# may use: cheaper compiles still (tests/cheap_compiles.py). From the XLA_FLAGS the session
# started with: xdist's workers inherit the controller's environment, flags included, and
# each sizes its own after the pinning above.
_session_flags = os.environ.setdefault("TLT_JAX_TESTS_SESSION_XLA_FLAGS",
                                      os.environ.get("XLA_FLAGS", ""))
os.environ["XLA_FLAGS"] = cheap_compiles.xla_flags(_session_flags)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

from tlt_jax.compile_cache import guard_cpu_collectives, share_across_devices  # noqa: E402

share_across_devices()  # the emulated slices share compiled programs, as the jobs' do
guard_cpu_collectives()  # and keep the programs a cached copy could stall out of it, as theirs

import importlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from tlt_jax.models import ModelConfig, RopeConfig, init_params  # noqa: E402
from tlt_jax.plugins import import_plugins  # noqa: E402

# Plug-ins a test session registers before it collects (TLT_PLUGINS, in the config's `plugins`
# syntax): the shared tests read the registries as they are collected, so a drafter, algorithm
# or task of your own is covered by them without an edit to a test (docs/extending.md).
import_plugins(os.environ.get("TLT_PLUGINS", ""))


@pytest.fixture(scope="module")
def optimised_compiles():
  """XLA's default optimisation for a module's compiles: for tests that spend their time
  running a real model rather than compiling it. (Tests of XLA's memory analysis need it
  not: the one-GPU demo's programs peak at the same bytes either way, compiled in 26% less
  time without it.) The previous setting is restored after the module."""
  before = jax.config.values["jax_disable_most_optimizations"]
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
  """A tiny Qwen2-style policy: GQA 4 -> 2, QKV bias, untied head; every test shares it."""
  return ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope=RopeConfig(theta=10000.0),
                     qkv_bias=True, max_position_embeddings=512, attention_impl="reference")


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
  return init_params(tiny_cfg, jax.random.key(0))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def repo_config(name: str, arg: str | None = None):
  """`configs/<name>.py`'s get_config(arg), as the CLI would load it."""
  sys.path.insert(0, REPO)
  try:
    module = importlib.import_module(f"configs.{name}")
  finally:
    sys.path.pop(0)
  return module.get_config(arg)



def pytest_configure(config):
  # Under `-n 2 --dist loadfile`, xdist hands out files largest-count-first by default, which
  # leaves the end-to-end files (few tests, minutes each) for last, one worker running them
  # alone. Files are handed out in collection order instead (see below).
  if hasattr(config.option, "loadscopereorder"):
    config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
  """Files with slow tests first, most slow tests first (a longest-first schedule, so the two
  workers finish together); order within a file, and among the other files, unchanged."""
  slow: dict[str, int] = {}
  for item in items:
    slow.setdefault(item.path, 0)
    slow[item.path] += item.get_closest_marker("slow") is not None
  rank = {path: i for i, path in enumerate(sorted(slow, key=lambda p: -slow[p]))}
  items.sort(key=lambda item: rank[item.path])
