"""The XLA:CPU flag that makes the suite's compiles cheaper, where this XLA has it.

XLA:CPU's older emitters compile the suite's programs faster than its fusion emitters
(tests/speculative/test_sd_greedy.py: 67 s -> 39 s on 2 cores, the same tests passing). XLA
aborts a process on a flag it does not know, and jaxlib 0.11 dropped this one (the GPU
machine's stack), so it is added only below 0.11. No jax import here: .ci/run reads it too.
"""

import importlib.metadata
import os

FLAG = "--xla_cpu_use_fusion_emitters=false"
NAME = FLAG.split("=")[0]


def xla_flags(current: str) -> str:
  """`current` (an XLA_FLAGS string) plus FLAG where jaxlib knows it and `current` does not
  set it already."""
  major_minor = tuple(int(x) for x in importlib.metadata.version("jaxlib").split(".")[:2])
  if major_minor >= (0, 11) or NAME in current:
    return current
  return f"{current} {FLAG}".strip()


if __name__ == "__main__":
  print(xla_flags(os.environ.get("XLA_FLAGS", "")))
