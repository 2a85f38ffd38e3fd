"""The persistent compilation cache: rollout slices share one compile of a program."""

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.compile_cache import CompileCounter, share_across_devices


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
