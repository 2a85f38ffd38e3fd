"""Programs traced once for every slice of one shape: the same results on each slice's own
devices, one trace, and a fallback for programs that cannot be exported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.rollout.pool import ExecutablePool


def _slices():
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  return [Mesh(row, ("fsdp",)) for row in devices]


def _program(traced: list):
  """A sharded step with a random key, a donated input and a pinned output layout."""
  def fn(w, x, key):
    traced.append(1)
    noise = jax.random.normal(key, (x.shape[0], w.shape[1]))
    return jnp.tanh(x @ w) + noise, jax.random.split(key)[0]
  return fn


def _args(mesh):
  w = jax.device_put(jnp.linspace(-1, 1, 64).reshape(8, 8), NamedSharding(mesh, P(None, "fsdp")))
  x = jax.device_put(jnp.arange(32.0).reshape(4, 8) / 32, NamedSharding(mesh, P("fsdp")))
  return w, x, jax.device_put(jax.random.key(3), NamedSharding(mesh, P()))


def _layout(mesh):
  return lambda out: (NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P()))


def test_slices_share_one_trace_and_each_runs_on_its_own_devices():
  pool, traced = ExecutablePool(), []
  slices = _slices()
  pool.compile_ahead((1, "step"), _program(traced), _args(slices[1]), donate_argnums=(1,),
                     out_shardings=_layout(slices[1]), mesh=slices[1], share="step")
  outs = []
  for s, mesh in enumerate(slices):
    exe = pool.get((s, "step"), _program(traced), _args(mesh), donate_argnums=(1,),
                   out_shardings=_layout(mesh), mesh=mesh, share="step")
    args = _args(mesh)
    out, key = exe(*args)
    assert args[1].is_deleted()  # donated
    assert out.sharding == NamedSharding(mesh, P("fsdp"))
    assert out.sharding.device_set == set(mesh.devices.flat) == key.sharding.device_set
    outs.append((np.asarray(out), np.asarray(jax.random.key_data(key))))
  assert len(traced) == 1  # the model code ran once for both slices
  assert (pool.traces.traced, pool.traces.reused) == (1, 1)
  with jax.set_mesh(slices[0]):
    direct = jax.jit(_program([]))(*_args(slices[0]))
  for out, key in outs:
    np.testing.assert_array_equal(out, np.asarray(direct[0]))
    np.testing.assert_array_equal(key, np.asarray(jax.random.key_data(direct[1])))


def test_other_shapes_and_unshared_programs_are_traced_apart():
  pool, traced = ExecutablePool(), []
  mesh = _slices()[0]
  w, x, key = _args(mesh)
  wider = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P(None, "fsdp")))
  pool.get("a", _program(traced), (w, x, key), mesh=mesh, share="step")
  pool.get("b", _program(traced), (wider, x, key), mesh=mesh, share="step")  # other shapes
  pool.get("c", _program(traced), (w, x, key), mesh=mesh)  # no share key
  assert len(traced) == 3 and pool.traces.traced == 2 and pool.traces.reused == 0


def test_a_program_that_cannot_be_exported_is_traced_on_each_slice_with_one_warning():
  """A host callback has no exported form: each slice traces it, and the run says why."""
  pool, traced = ExecutablePool(), []

  def with_callback(x):
    traced.append(1)
    return jax.pure_callback(lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype),
                             x)
  with pytest.warns(RuntimeWarning, match="callback_double: traced on every slice"):
    for s, mesh in enumerate(_slices()):
      x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
      exe = pool.get((s, "cb"), with_callback, (x,), mesh=mesh, share="cb",
                     kind="callback_double")
      np.testing.assert_allclose(exe(x), 2 * np.arange(4.0))
  assert pool.traces.traced == 0 and len(traced) >= 2
