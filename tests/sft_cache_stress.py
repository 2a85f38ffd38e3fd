"""Runs the SFT job (tiny settings, two emulated devices) RUNS times in one process with the
persistent compilation cache in CACHE: the first run fills it (when empty), every later one
loads its programs from there (JAX's in-memory caches are cleared between runs, so each run
looks every program up again, as a new process would). Workdirs go under ROOT:

  python tests/sft_cache_stress.py CACHE ROOT RUNS

Prints one line per run. A program whose devices fall out of step aborts the process (XLA's
rendezvous timeout, rc 134), so the exit status says whether every run finished.
"""

import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 2)

from tlt_jax import cli  # noqa: E402
from tlt_jax.compile_cache import COMPILES, enable_compilation_cache  # noqa: E402
from tlt_jax.job import Job  # noqa: E402
from tlt_jax.sft import _sft  # noqa: E402

# The smoke config (two devices, FSDP, scanned layers), cut to a few steps and a tiny
# held-out evaluation: the train step is the program that stalled.
OVERRIDES = ("sft.steps=3", "sft.checkpoint_every=0", "sft.num_eval_examples=2",
             "sft.eval_batch_size=2", "sft.eval_max_new_tokens=4", "sft.log_every=1")


def main(cache: str, root: str, runs: int) -> None:
  config = cli.config_from_file("configs/tiny_sft.py:runlocal", OVERRIDES)
  assert enable_compilation_cache(cache) == cache
  for run in range(runs):
    jax.clear_caches()
    before = COMPILES.report()
    t0 = time.perf_counter()
    with Job(os.path.join(root, str(run)), show_progress=False) as job:
      assert not _sft(config, job)
    after = COMPILES.report()
    print(f"run {run}: {time.perf_counter() - t0:.1f} s, "
          f"{after['xla_cache_hits'] - before['xla_cache_hits']} programs from the cache, "
          f"{after['xla_compiles'] - before['xla_compiles']} compiled", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
