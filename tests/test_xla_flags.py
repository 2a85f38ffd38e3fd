"""The XLA flags the package adds to XLA_FLAGS on import (tlt_jax/xla_flags.py)."""

import os
import subprocess
import sys

import pytest

from tests import cheap_compiles
from tests.conftest import REPO
from tlt_jax import xla_flags


def test_the_flags_are_added_and_a_users_own_setting_wins():
  flag = "--xla_gpu_exclude_nondeterministic_ops"
  excess = "--xla_allow_excess_precision=false"
  assert xla_flags.with_flags("") == f"{flag}=true {excess}"
  assert xla_flags.with_flags(" --xla_dump_to=/tmp/x ") == \
      f"--xla_dump_to=/tmp/x {flag}=true {excess}"
  assert xla_flags.with_flags(f"{flag}=false --xla_allow_excess_precision=true") == \
      f"{flag}=false --xla_allow_excess_precision=true"
  # Applying twice adds nothing.
  env = {"XLA_FLAGS": "--xla_dump_to=/d"}
  assert xla_flags.apply(env) == xla_flags.apply(env) == f"--xla_dump_to=/d {flag}=true {excess}"


def test_importing_the_package_sets_flags_that_this_xla_accepts():
  # XLA aborts the process on a flag it does not know: this catches a renamed or removed flag.
  code = ("import jax, jax.numpy as jnp, os, tlt_jax; "
          "print(os.environ['XLA_FLAGS']); print(float(jnp.arange(4.0).sum()))")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ["--xla_gpu_exclude_nondeterministic_ops=true",
                                 "--xla_allow_excess_precision=false", "6.0"]


def test_the_suites_cheap_compile_flag_is_one_this_xla_knows():
  # tests/conftest.py adds it for every test and .ci/run for its smoke run: a flag this XLA
  # does not know would abort every process of the suite.
  env = dict(os.environ, XLA_FLAGS=cheap_compiles.xla_flags(""))
  done = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(jnp.ones(3).sum())"],
                        env=env, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split() == ["3.0"]
  own = f"{cheap_compiles.NAME}=true {cheap_compiles.SPLIT}=3"
  assert cheap_compiles.xla_flags(own) == own  # settings of one's own win


def test_the_suite_compiles_one_code_module_per_cpu_of_its_worker():
  # Each worker runs on its share of the CPUs (tests/conftest.py); its flags, which the runs it
  # starts inherit, split XLA:CPU's code into as many modules (not the controller's count,
  # which the worker's environment inherits).
  if cheap_compiles.SPLIT in os.environ["TLT_JAX_TESTS_SESSION_XLA_FLAGS"]:
    pytest.skip("the session's XLA_FLAGS set the split themselves")
  split = [w for w in os.environ["XLA_FLAGS"].split() if w.startswith(cheap_compiles.SPLIT)]
  assert split == [f"{cheap_compiles.SPLIT}={cheap_compiles.usable_cpus()}"]



@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or (os.cpu_count() or 1) < 2,
                    reason="needs CPU affinity and at least 2 CPUs")
def test_the_smoke_run_compiles_with_the_flags_of_a_test_worker():
  # .ci/run's smoke run fills the compilation cache that the suite loads from, and the cache
  # keys on the XLA flags: what it computes on the whole machine (`--workers 2`, the test
  # command's -n 2) must be what the first worker computes once conftest.py has pinned it.
  worker = ("import os, sys; sys.path.insert(0, 'tests'); import cheap_compiles; "
            "os.sched_setaffinity(0, cheap_compiles.worker_cpus(0, 2)); "
            "print(cheap_compiles.xla_flags(''))")

  def flags(*argv):  # run on every CPU of the machine, as the smoke run is
    return subprocess.run(
        [sys.executable, *argv], env=dict(os.environ, XLA_FLAGS=""), cwd=REPO,
        capture_output=True, text=True, timeout=60, check=True,
        preexec_fn=lambda: os.sched_setaffinity(0, range(os.cpu_count()))).stdout.strip()
  smoke = flags("tests/cheap_compiles.py", "--workers", "2")
  assert smoke == flags("-c", worker)
  assert smoke != flags("tests/cheap_compiles.py")  # the whole machine's split differs
