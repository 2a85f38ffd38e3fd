"""JAX's persistent compilation cache, on by default for every job and experiment.

Compiles dominate the first minutes of a run (on GPU an unrolled 7B prefill takes about a
minute), and a rerun of the same config compiles the same programs. With the cache on, a
rerun loads them from disk instead. XLA's GPU autotuning results are cached with them.

The folder: `JAX_COMPILATION_CACHE_DIR` if set, else `$XDG_CACHE_HOME/tlt_jax/jax` (by
default `~/.cache/tlt_jax/jax`). `TLT_JAX_NO_COMPILATION_CACHE=1` turns it off, whatever else
is set (`JAX_COMPILATION_CACHE_DIR` included).

The cache also lets rollout slices share programs: the same program on another slice's
devices is a hit (`share_across_devices`), so each is compiled once per run, not once per
slice.

One kind of program stays out of the cache on CPU (`guard_cpu_collectives`): XLA:CPU's
deserializer gives the collectives of each nested thunk sequence (a loop body, a branch) their
own ordering resource, so a program loaded from the cache may run a collective in a loop and
one outside it in either order on each device; two devices that pick different orders wait
for each other until XLA aborts the process. Such a program is compiled in every process.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import re
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


def cache_turned_off() -> bool:
  """Whether TLT_JAX_NO_COMPILATION_CACHE asks for no persistent cache (any value but '',
  '0' or 'false')."""
  return os.environ.get("TLT_JAX_NO_COMPILATION_CACHE", "").lower() not in ("", "0", "false")


def enable_compilation_cache(path: str | None = None) -> str | None:
  """Turns the persistent cache on (every program, however fast it compiles, and XLA's
  autotune results) and returns its folder; None when TLT_JAX_NO_COMPILATION_CACHE turns it
  off, which it does whatever else is set (JAX itself would use JAX_COMPILATION_CACHE_DIR)."""
  if cache_turned_off():
    jax.config.update("jax_enable_compilation_cache", False)
    return None
  path = path or default_cache_dir()
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_enable_xla_caches",
                    "xla_gpu_per_fusion_autotune_cache_dir")
  share_across_devices()
  if not guard_cpu_collectives() and jax.default_backend() == "cpu":
    logging.getLogger(__name__).warning(
        "the persistent compilation cache is off: jax %s has no cache functions that tlt_jax "
        "can keep stall-prone CPU programs out of (tlt_jax.compile_cache.guard_cpu_collectives)",
        jax.__version__)
    jax.config.update("jax_enable_compilation_cache", False)
    return None
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


# A collective's opcode in XLA's HLO text (also the async -start form).
_COLLECTIVE = re.compile(r"\b(?:all-gather|all-reduce|reduce-scatter|all-to-all|ragged-all-to-all|"
                         r"collective-permute|collective-broadcast)(?:-start)?\(")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{\s*$")


def collectives_in_several_sequences(hlo_text: str) -> bool:
  """Whether a compiled program's collectives sit in more than one computation of its HLO (the
  entry and a loop body, two loop bodies, ...): XLA:CPU runs each as its own thunk sequence,
  and after a round trip through the cache nothing orders one sequence's collectives against
  another's (see `guard_cpu_collectives`)."""
  if not _COLLECTIVE.search(hlo_text):  # most programs: one scan, no lines
    return False
  holders, current = set(), None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(1)
    elif _COLLECTIVE.search(line):
      holders.add(current)
  return len(holders) > 1


def _unsafe_on_cpu(executable, backend) -> bool:
  """A CPU program whose collectives a cached copy could run out of order (see
  `guard_cpu_collectives`)."""
  if getattr(backend, "platform", None) != "cpu":
    return False
  try:
    return any(collectives_in_several_sequences(m.to_string())
               for m in executable.hlo_modules())
  except Exception:  # noqa: BLE001 -- no HLO to read: keep it out rather than risk a stall
    return True


def guard_cpu_collectives() -> bool:
  """Keeps CPU programs whose collectives sit in several thunk sequences out of the persistent
  cache: neither written nor, if an earlier version wrote one, loaded (it is compiled again).

  Why: XLA:CPU orders a program's collectives through one shared resource, so every device
  runs them in the same order. Its deserializer (openxla/xla,
  xla/backends/cpu/runtime/thunk_proto_serdes.cc: WhileThunkFromProto, ConditionalThunkFromProto
  and CallThunkFromProto build the nested sequence with a ThunkSequenceSerDesProtobuf of their
  own) gives each nested sequence fresh resources. A program loaded from the cache then has
  no order between a loop holding collectives and a collective outside it, and its devices
  may take them in different orders: the SFT step (FSDP all-gathers and all-reduces in its
  scanned layers, all-reduces outside them) waited in an all-gather on one device and an
  all-reduce on the other until XLA aborted the process. Compiled in the process, the order
  holds. GPU programs are serialized another way and keep using the cache.

  Returns False, changing nothing, on a JAX without the cache functions patched here (then
  CPU runs turn the cache off: `enable_compilation_cache`)."""
  try:
    from jax._src import compilation_cache as cc
    get, put = cc.get_executable_and_time, cc.put_executable_and_time
  except (ImportError, AttributeError):
    return False
  if getattr(get, "_tlt_guarded", False):
    return True

  @functools.wraps(get)
  def get_ordered(cache_key, compile_options, backend, *args, **kwargs):
    executable, compile_time = get(cache_key, compile_options, backend, *args, **kwargs)
    if executable is not None and _unsafe_on_cpu(executable, backend):
      return None, None  # compiled again, and not written (below)
    return executable, compile_time

  @functools.wraps(put)
  def put_ordered(cache_key, module_name, executable, backend, *args, **kwargs):
    if _unsafe_on_cpu(executable, backend):
      COMPILES.kept_out += 1
    else:
      put(cache_key, module_name, executable, backend, *args, **kwargs)

  get_ordered._tlt_guarded = True
  cc.get_executable_and_time, cc.put_executable_and_time = get_ordered, put_ordered
  return True


class CompileCounter:
  """Counts the XLA compiles that go through the persistent cache, and how many of them it
  served: `new` is what this process really compiled."""

  def __init__(self):
    self.requests = 0
    self.hits = 0
    self.kept_out = 0  # compiled, and not written: see guard_cpu_collectives
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
    """{'xla_compiles': programs compiled by this process, 'xla_cache_hits': loaded,
    'xla_kept_out_of_cache': compiled programs that `guard_cpu_collectives` did not write
    (a rerun compiles them again)}."""
    return {"xla_compiles": self.new, "xla_cache_hits": self.hits,
            "xla_kept_out_of_cache": self.kept_out}


COMPILES = CompileCounter()
