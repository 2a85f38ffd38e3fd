"""The attention kernel on a mesh: one call per shard of rows and KV heads (kernels.per_shard),
in interpret mode on 8 emulated devices. The model's tree verification gives the same logits
on every layout as the reference on one device, and its program contains the per-shard call
(a manual computation) instead of one whole-mesh kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from tlt_jax.kernels.per_shard import kernel_specs
from tlt_jax.mesh import ROLLOUT_RULES, make_mesh, on_mesh, shard_pytree
from tlt_jax.models import ModelConfig, RopeConfig, init_cache, init_params, param_logical_axes
from tlt_jax.models.decoder import prefill, verify


def _abstract(replica, fsdp, tensor):
  return AbstractMesh((replica, fsdp, tensor), ("replica", "fsdp", "tensor"),
                      axis_types=(AxisType.Auto,) * 3)


def test_kernel_specs_split_rows_and_whole_gqa_groups():
  mesh = _abstract(2, 2, 4)
  assert kernel_specs(mesh, batch=8, heads=8, kv_heads=4) == (("replica", "fsdp"), "tensor")
  # rows as far as the axes divide them; heads only where the axis divides both head counts
  assert kernel_specs(mesh, batch=2, heads=8, kv_heads=2) == (("replica",), None)
  assert kernel_specs(mesh, batch=1, heads=8, kv_heads=4) == ((), "tensor")
  assert kernel_specs(_abstract(1, 1, 1), 8, 8, 4) == ((), None)


@pytest.fixture(scope="module")
def setup():
  """A tiny policy (8 heads / 4 KV heads), a 4-row cache after prefill and a 4-node tree,
  with the reference logits of its verification on one device."""
  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=8, num_kv_heads=4, head_dim=16, rope=RopeConfig(theta=10000.0),
                    qkv_bias=True, max_position_embeddings=256, attention_impl="reference")
  params = init_params(cfg, jax.random.key(0))
  prompts = jax.random.randint(jax.random.key(1), (4, 12), 0, cfg.vocab_size)
  lengths = jnp.array([12, 5, 9, 1], jnp.int32)
  cache = prefill(params, prompts, lengths, init_cache(cfg, 4, 64), cfg)[2]
  tree = jax.random.randint(jax.random.key(2), (4, 4), 0, cfg.vocab_size)
  depths = jnp.broadcast_to(jnp.array([0, 1, 1, 2], jnp.int32), (4, 4))
  mask = jnp.broadcast_to(jnp.array([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                                    bool), (4, 4, 4))
  reference = jax.jit(lambda *a: verify(*a, cfg=cfg)[0])(params, tree, depths, mask, cache)
  return cfg, params, cache, (tree, depths, mask), reference


@pytest.mark.parametrize("layout", [(2, 2, 1), (1, 2, 4)])
def test_verify_runs_the_kernel_per_shard_with_the_reference_logits(setup, layout):
  """(replica, fsdp, tensor): rows over 4 devices; rows over 2 and KV heads over 4."""
  cfg, params, cache, (tree, depths, mask), reference = setup
  kcfg = cfg.replace(attention_impl="pallas_interpret")
  replica, fsdp, tensor = layout
  mesh = make_mesh({"replica": replica, "fsdp": fsdp, "tensor": tensor},
                   jax.devices()[:replica * fsdp * tensor])
  placed = shard_pytree(params, param_logical_axes(cfg), mesh, ROLLOUT_RULES)
  placed_cache = shard_pytree(cache, cache.logical_axes(), mesh, ROLLOUT_RULES)
  run = jax.jit(lambda *a: verify(*a, cfg=kcfg)[0])
  with on_mesh(mesh):
    lowered = run.lower(placed, tree, depths, mask, placed_cache)
    logits = run(placed, tree, depths, mask, placed_cache)
  assert "manual_computation" in lowered.as_text()
  np.testing.assert_allclose(np.asarray(logits), np.asarray(reference), rtol=2e-5, atol=2e-5)
