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

The persistent compilation cache keys a program on these flags: `.ci/run`'s smoke run takes
the flags of a test worker (`--workers 2`, as its test command runs), so that the suite loads
the programs the smoke run compiled instead of compiling them again. No jax import here:
.ci/run runs this file as a script.
"""

import argparse
import importlib.metadata
import os

FLAG = "--xla_cpu_use_fusion_emitters=false"
NAME = FLAG.split("=")[0]
SPLIT = "--xla_cpu_parallel_codegen_split_count"


def _cpus() -> list[int]:
  """The CPUs this process may run on (its affinity where the OS has one)."""
  if hasattr(os, "sched_getaffinity"):
    return sorted(os.sched_getaffinity(0))
  return list(range(os.cpu_count() or 1))


def usable_cpus() -> int:
  """How many CPUs this process may run on. As experiments.common.usable_cpus, which imports
  the package (and jax) that this file must not."""
  return max(len(_cpus()), 1)


def worker_cpus(index: int, count: int) -> list[int]:
  """The CPUs of pytest-xdist worker `index` of `count` (tests/conftest.py pins it to them):
  every count-th CPU of this process's, from the index-th on."""
  cpus = _cpus()
  return cpus[index::count] or [cpus[index % len(cpus)]]


def xla_flags(current: str, cpus: int | None = None) -> str:
  """`current` (an XLA_FLAGS string) plus the flags above that it does not set already: the
  older emitters where jaxlib knows the flag, and one code module per CPU (`cpus`, by default
  the CPUs this process may use)."""
  given = {word.split("=")[0] for word in current.split()}
  added = []
  major_minor = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
  if major_minor < (0, 11) and NAME not in given:
    added.append(FLAG)
  if SPLIT not in given:
    added.append(f"{SPLIT}={cpus or usable_cpus()}")
  return " ".join([current.strip(), *added]).strip()


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description="Prints XLA_FLAGS with the suite's flags added.")
  parser.add_argument("--workers", type=int, default=0,
                      help="size the split as the first of this many test workers does")
  workers = parser.parse_args().workers
  print(xla_flags(os.environ.get("XLA_FLAGS", ""),
                  len(worker_cpus(0, workers)) if workers > 1 else None))
