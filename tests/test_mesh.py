"""Mesh construction, logical sharding rules, replica slices, and sharded forward parity."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from tlt_jax.config import base_config
from tlt_jax.mesh import (DEFAULT_RULES, ROLLOUT_RULES, initialize_distributed, local_slices,
                          logical_to_mesh_spec, make_mesh, replica_slices, resolve_axis_sizes,
                          shard_pytree, stack_slices, to_mesh)
from tlt_jax.models import decode, init_cache, param_logical_axes, prefill
from tlt_jax.models.kv_cache import CACHE_KV_AXES, CACHE_LENGTHS_AXES, KVCache

# The tiny policy's 61-token vocabulary does not divide tensor=2: these tests mark that rule
# optional, so the vocabulary is replicated over `tensor` (DEFAULT_RULES would refuse it).
ODD_VOCAB_RULES = tuple((name, "tensor?") if name == "vocab" else (name, axes)
                        for name, axes in DEFAULT_RULES)


def test_eight_emulated_devices():
  assert jax.device_count() == 8


def test_resolve_axis_sizes():
  assert resolve_axis_sizes({"replica": 2, "fsdp": -1, "tensor": 2}, 8) == {
      "replica": 2, "fsdp": 2, "tensor": 2}
  with pytest.raises(ValueError, match="needs 16 devices but 8 are available"):
    resolve_axis_sizes({"replica": 4, "fsdp": 4}, 8)
  with pytest.raises(ValueError, match="do not divide the 8 available devices"):
    resolve_axis_sizes({"replica": 3, "fsdp": -1}, 8)
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    resolve_axis_sizes({"replica": -1, "fsdp": -1}, 8)


def test_replica_slices_partition_the_devices():
  mesh = make_mesh({"replica": 4, "fsdp": 1, "tensor": 2})
  slices = replica_slices(mesh)
  assert len(slices) == 4
  seen = [d.id for s in slices for d in s.devices.flat]
  assert sorted(seen) == list(range(8))
  for s in slices:
    assert dict(s.shape) == {"replica": 1, "fsdp": 1, "tensor": 2}
  one = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  assert len(replica_slices(one)) == 1


def test_logical_rules_drop_axes_that_do_not_divide():
  mesh = make_mesh({"replica": 1, "fsdp": 2, "tensor": 4})
  # 2 kv heads cannot split over tensor=4: replicated; 8 heads can.
  assert logical_to_mesh_spec(P("embed", "kv_heads", "head_dim"), (32, 2, 8), mesh) == P(
      "fsdp", None, None)
  assert logical_to_mesh_spec(P("embed", "heads", "head_dim"), (32, 8, 8), mesh) == P(
      "fsdp", "tensor", None)
  # batch maps to (replica, fsdp); an axis of size 1 is left out of the spec.
  assert logical_to_mesh_spec(P("batch",), (4,), mesh) == P("fsdp")
  assert logical_to_mesh_spec(P("batch",), (3,), mesh) == P(None)
  # The rollout layout keeps whole weights: embed is not split.
  assert logical_to_mesh_spec(P("embed", "heads", "head_dim"), (32, 8, 8), mesh,
                              ROLLOUT_RULES) == P(None, "tensor", None)


def _cache_shardings(mesh, cache):
  spec = KVCache(k=P(*CACHE_KV_AXES), v=P(*CACHE_KV_AXES), lengths=P(*CACHE_LENGTHS_AXES))
  return shard_pytree(cache, spec, mesh)


def test_sharded_forward_equals_single_device(tiny_cfg, tiny_params):
  mesh = make_mesh({"replica": 1, "fsdp": 4, "tensor": 2})
  sharded = shard_pytree(tiny_params, param_logical_axes(tiny_cfg), mesh, ODD_VOCAB_RULES)
  q = sharded["layers"]["self_attn"]["q_proj"]["kernel"]
  assert isinstance(q.sharding, NamedSharding)
  assert q.sharding.spec == P(None, "fsdp", "tensor", None)
  assert len(q.sharding.device_set) == 8

  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (4, 6)), jnp.int32)
  lengths = jnp.asarray([6, 3, 5, 1], jnp.int32)
  pf = jax.jit(functools.partial(prefill, cfg=tiny_cfg))
  dc = jax.jit(functools.partial(decode, cfg=tiny_cfg))

  def run(params, cache):
    logits, _, cache = pf(params, tokens, lengths, cache)
    step_logits, hidden, cache = dc(params, tokens[:, 0], cache)
    return logits, step_logits, hidden, cache

  ref = run(tiny_params, init_cache(tiny_cfg, 4, 10))
  got = run(sharded, _cache_shardings(mesh, init_cache(tiny_cfg, 4, 10)))
  assert len(got[3].k.sharding.device_set) == 8
  for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_hf_load_places_tensors_on_mesh(tiny_cfg, tiny_params, tmp_path):
  from tlt_jax.models.hf import load_hf_params, save_hf_checkpoint
  save_hf_checkpoint(str(tmp_path), tiny_params, tiny_cfg)
  mesh = make_mesh({"replica": 1, "fsdp": 4, "tensor": 2})
  params = load_hf_params(str(tmp_path), tiny_cfg, mesh, ODD_VOCAB_RULES)
  emb = params["embed"]["embedding"]
  assert emb.sharding.spec == P(None, "fsdp")  # vocab 61 is not divisible by tensor=2
  up = params["layers"]["mlp"]["up_proj"]["kernel"]
  assert up.sharding.spec == P(None, "fsdp", "tensor")
  np.testing.assert_array_equal(np.asarray(up), np.asarray(tiny_params["layers"]["mlp"]
                                                           ["up_proj"]["kernel"]))


def test_single_process_needs_no_distributed_runtime(monkeypatch):
  for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    monkeypatch.delenv(var, raising=False)
  dist = dict(base_config().mesh.distributed)
  assert initialize_distributed(dist) is False
  # A coordinator without a process count or id is a setup error named before JAX waits for
  # peers that never come.
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
  with pytest.raises(ValueError, match="JAX_NUM_PROCESSES and JAX_PROCESS_ID"):
    initialize_distributed(dist)
  assert local_slices(replica_slices(make_mesh({"replica": 4, "fsdp": -1}))) == [0, 1, 2, 3]


def test_stack_slices_gathers_one_copy_per_slice_without_the_host():
  mesh = make_mesh({"replica": 2, "fsdp": -1})
  slices = replica_slices(mesh)
  x = np.arange(24, dtype=np.float32).reshape(4, 6)
  trees = {s: {"w": to_mesh(x + 100 * s, NamedSharding(m, P("fsdp"))),
               "n": to_mesh(np.int32(s + 1), NamedSharding(m, P()))}
           for s, m in enumerate(slices)}
  stacked = stack_slices(trees, mesh)
  assert stacked["w"].shape == (2, 4, 6) and stacked["n"].shape == (2,)
  assert stacked["w"].sharding.spec == P("replica", "fsdp")
  np.testing.assert_array_equal(np.asarray(stacked["w"]), np.stack([x, x + 100]))
  np.testing.assert_array_equal(np.asarray(stacked["n"]), [1, 2])
  # Each slice's rows stayed on that slice's devices.
  for shard in stacked["w"].addressable_shards:
    s = next(i for i, m in enumerate(slices) if shard.device in set(m.devices.flat))
    assert shard.index[0] == slice(s, s + 1)
