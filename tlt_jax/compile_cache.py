"""JAX's persistent compilation cache, on by default for every job and experiment.

Compiles dominate the first minutes of a run (on GPU an unrolled 7B prefill takes about a
minute), and a rerun of the same config compiles the same programs. With the cache on, a
rerun loads them from disk instead. XLA's GPU autotuning results are cached with them.

The folder: `JAX_COMPILATION_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tlt_jax/jax` (by
default `~/.cache/tlt_jax/jax`). `TLT_JAX_NO_COMPILATION_CACHE=1` turns it off.

The cache also lets rollout slices share programs: the same program on another slice's
devices is a hit (`share_across_devices`), so each is compiled once per run, not once per
slice.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading

import jax

_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"


def default_cache_dir() -> str:
  """`JAX_COMPILATION_CACHE_DIR`, else the user's cache folder for tlt_jax."""
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    return os.environ["JAX_COMPILATION_CACHE_DIR"]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "tlt_jax", "jax")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns the persistent cache on (every program, however fast it compiles, and XLA's
  autotune results) and returns its folder; None when turned off by the environment."""
  if os.environ.get("TLT_JAX_NO_COMPILATION_CACHE"):
    return None
  path = path or default_cache_dir()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_enable_xla_caches",
                    "xla_gpu_per_fusion_autotune_cache_dir")
  share_across_devices()
  COMPILES.start()
  return path


def share_across_devices() -> bool:
  """Keys cached programs without the devices they run on, on every backend, so a program
  compiled for one rollout slice is loaded for the others (JAX loads a cached executable for
  the devices of the call that asks for it). JAX keys programs this way on GPU already (for
  multi-process jobs); on CPU it keys in the device ids, so each emulated slice compiled its
  own copy. Returns False, changing nothing, on a JAX whose cache key has no such switch."""
  try:
    from jax._src import cache_key
    hash_options = cache_key._hash_serialized_compile_options
  except (ImportError, AttributeError):
    return _no_sharing("jax._src.cache_key._hash_serialized_compile_options is gone")
  if getattr(hash_options, "_tlt_shares_devices", False):
    return True
  if "strip_device_assignment" not in inspect.signature(hash_options).parameters:
    return _no_sharing("its strip_device_assignment argument is gone")

  @functools.wraps(hash_options)
  def without_devices(hash_obj, compile_options, strip_device_assignment=False):
    del strip_device_assignment
    return hash_options(hash_obj, compile_options, strip_device_assignment=True)
  without_devices._tlt_shares_devices = True
  cache_key._hash_serialized_compile_options = without_devices
  return True


def _no_sharing(why: str) -> bool:
  logging.getLogger(__name__).warning(
      "slices do not share compiled programs on jax %s (%s): each compiles its own",
      jax.__version__, why)
  return False


class CompileCounter:
  """Counts the XLA compiles that go through the persistent cache, and how many of them it
  served: `new` is what this process really compiled."""

  def __init__(self):
    self.requests = 0
    self.hits = 0
    self._started = False
    self._lock = threading.Lock()

  def start(self) -> None:
    with self._lock:
      if not self._started:
        jax.monitoring.register_event_listener(self._on_event)
        self._started = True

  def _on_event(self, event: str, **kwargs) -> None:
    if event == _REQUESTS:
      self.requests += 1
    elif event == _HITS:
      self.hits += 1

  @property
  def new(self) -> int:
    return self.requests - self.hits

  def report(self) -> dict:
    """{'xla_compiles': programs compiled by this process, 'xla_cache_hits': loaded}."""
    return {"xla_compiles": self.new, "xla_cache_hits": self.hits}


COMPILES = CompileCounter()
