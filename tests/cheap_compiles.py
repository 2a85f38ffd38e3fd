"""The XLA:CPU flags that make the suite's compiles cheaper.

`--xla_cpu_use_fusion_emitters=false`: XLA:CPU's older emitters compile the suite's programs
faster than its fusion emitters (tests/speculative/test_sd_greedy.py: 67 s -> 39 s on 2
cores, the same tests passing). XLA aborts a process on a flag it does not know, and jaxlib
0.11 dropped this one (the GPU machine's stack), so it is added only below 0.11.

`--xla_cpu_parallel_codegen_split_count=<the CPUs this process may use>`: XLA:CPU splits a
program's machine code into 32 LLVM modules by default, to compile them on as many threads.
Each module pays LLVM's fixed costs, and a test worker runs on one core
(tests/conftest.py), where the 32 compile one after the other: with one module, the SD decode
program's compile took 25% less time (tests/rollout/test_engine.py::
test_sampled_sd_engine_emits_what_the_plain_engine_emits on one core: 26.6 s of compiles ->
19.8 s, 2026-11-29). jaxlib 0.10 and 0.11 know it.

No jax import here: .ci/run reads it too.
"""

import importlib.metadata
import os

FLAG = "--xla_cpu_use_fusion_emitters=false"
NAME = FLAG.split("=")[0]
SPLIT = "--xla_cpu_parallel_codegen_split_count"


def usable_cpus() -> int:
  """The CPUs this process may run on (its affinity where the OS has one). As
  experiments.common.usable_cpus, which imports the package (and jax) that this file must not."""
  if hasattr(os, "sched_getaffinity"):
    return max(len(os.sched_getaffinity(0)), 1)
  return os.cpu_count() or 1


def xla_flags(current: str) -> str:
  """`current` (an XLA_FLAGS string) plus the flags above that it does not set already: the
  older emitters where jaxlib knows the flag, and one code module per usable CPU."""
  given = {word.split("=")[0] for word in current.split()}
  added = []
  major_minor = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
  if major_minor < (0, 11) and NAME not in given:
    added.append(FLAG)
  if SPLIT not in given:
    added.append(f"{SPLIT}={usable_cpus()}")
  return " ".join([current.strip(), *added]).strip()


if __name__ == "__main__":
  print(xla_flags(os.environ.get("XLA_FLAGS", "")))
