"""The two layouts of one set of weights, on 8 emulated devices: training (FSDP over the whole
mesh) and rollout (whole weights or tensor-parallel per replica slice). The same tokens and
the same GRPO update whatever the mesh; no weight gathers inside a decode program; training
state split evenly over the devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from tests.engines import engine_config
from tests.speculative.drafters import drafter_set, random_drafter
from tlt_jax.mesh import (DEFAULT_RULES, logical_shardings, logical_to_mesh_spec, make_mesh,
                          shard_pytree)
from tlt_jax.models import ModelConfig, RopeConfig, init_params, param_logical_axes
from tlt_jax.optim import init_optimizer
from tlt_jax.rl.algorithms import Grpo
from tlt_jax.rl.policy_update import PolicyUpdater
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

# (replica, fsdp, tensor): one device; 2 slices of 2 devices that split each slice's rows;
# 2 tensor-parallel slices of 4; 8 slices of 1 (training only: 8 slices compile 8 copies of
# every rollout program on CPU, and 2 slices already show a slice's own copy).
ROLLOUT_LAYOUTS = [(1, 1, 1), (2, 2, 1), (2, 1, 4)]
LAYOUTS = ROLLOUT_LAYOUTS + [(8, 1, 1)]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [3, 3], [20, 1]]


@pytest.fixture(scope="module")
def model():
  """Dimensions that every layout divides (8 heads / 4 KV heads on tensor=4; hidden 64 on 8)."""
  cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=8, num_kv_heads=4, head_dim=8, rope=RopeConfig(theta=10000.0),
                    qkv_bias=True, max_position_embeddings=256, attention_impl="reference")
  return cfg, init_params(cfg, jax.random.key(0))


def _mesh(replica, fsdp, tensor):
  n = replica * fsdp * tensor
  return make_mesh({"replica": replica, "fsdp": fsdp, "tensor": tensor}, jax.devices()[:n])


def _training_params(cfg, params, mesh):
  return shard_pytree(params, param_logical_axes(cfg), mesh, DEFAULT_RULES)


@pytest.mark.slow  # a minute on one core: scheduled with the end-to-end tests (conftest.py)
def test_every_layout_generates_the_same_tokens_with_sd_and_gathers_no_weights(model):
  """Greedy and sampled generation with SD give the same tokens on every rollout layout; and
  as each device of a slice holds whole weights (or its tensor-parallel part), the compiled
  decode loops gather no weights (what they gather is a small fraction of them)."""
  cfg, params = model
  # Two batch sizes and one prefill width: the programs of a sharded slice hold collectives
  # and so compile anew on CPU (tlt_jax.compile_cache.guard_cpu_collectives); fewer programs,
  # the same tokens.
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=8, sd_threshold=8,
                    batch_sizes=(8, 2), prompt_widths=(8,))
  drafter = random_drafter(cfg, seed=1)
  weight_elements = sum(x.size for x in jax.tree.leaves((params, drafter[1])))
  results = {}
  for layout in ROLLOUT_LAYOUTS:
    mesh = _mesh(*layout)
    engine = RolloutEngine(cfg, _training_params(cfg, params, mesh), mesh, ec,
                           drafters=drafter_set(drafter),
                           tuner=FixedTuner((3, 2, 6)))
    for sp in (SamplingParams(0.0), SamplingParams(0.9, top_p=0.95)):
      res = engine.generate(PROMPTS, 2, sp, jax.random.key(7))
      assert any(r.mode == "sd" for r in res.timeline), layout
      results[layout, sp] = res.tokens
    decodes = [exe for key, exe in engine.pool._exes.items() if key[1] == "decode"]
    assert decodes
    for exe in decodes:
      # Rows split over a slice's fsdp devices may be gathered (activations: ~1/6 of the
      # weights here, far less at a real size); FSDP weights would be gathered whole.
      gathered = sum(int(np.prod([int(d) for d in shape.split(",")])) for shape in re.findall(
          r"= \w+\[([\d,]+)\][^\n]*all-gather\(", exe.as_text()))
      assert gathered < weight_elements / 2, (layout, gathered, weight_elements)
  for (layout, sp), tokens in results.items():
    assert tokens == results[ROLLOUT_LAYOUTS[0], sp], (layout, sp)


def test_a_qwen3_policy_generates_the_same_tokens_on_a_tensor_parallel_slice(model):
  """Qwen3's per-head q/k norms (weights [L, D], replicated) under tensor parallelism: 4-way
  split heads give one device's greedy tokens, plain and with SD."""
  cfg = model[0].replace(model_type="qwen3", qkv_bias=False, qk_norm=True)
  params = init_params(cfg, jax.random.key(3))
  attn = params["layers"]["self_attn"]
  for name in ("q_norm", "k_norm"):  # non-trivial norms: a missed or misplaced one shows
    attn[name]["weight"] = 1.0 + 0.3 * jax.random.normal(jax.random.key(len(name)),
                                                         attn[name]["weight"].shape)
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=8, sd_threshold=4,
                    batch_sizes=(4, 1), prompt_widths=(8,))
  drafter = random_drafter(cfg, seed=1)
  tokens = []
  for layout in ((1, 1, 1), (1, 1, 4)):
    mesh = _mesh(*layout)
    engine = RolloutEngine(cfg, _training_params(cfg, params, mesh), mesh, ec,
                           drafters=drafter_set(drafter),
                           tuner=FixedTuner((3, 2, 6)))
    res = engine.generate(PROMPTS[:3], 2, SamplingParams(0.0), jax.random.key(7))
    assert any(r.mode == "sd" for r in res.timeline), layout
    tokens.append(res.tokens)
  assert tokens[1] == tokens[0]


def test_training_state_is_split_over_every_device(model):
  """FSDP over replica x fsdp: each device holds 1/8 of the weights and of AdamW's state
  (within the few small leaves, e.g. biases, that tensor axes would split)."""
  cfg, params = model
  mesh = _mesh(8, 1, 1)
  sharded = _training_params(cfg, params, mesh)
  opt_state, _ = init_optimizer(optax.adamw(1e-3), sharded, mesh)
  device = jax.devices()[0]
  for tree in (sharded, opt_state):
    leaves = [x for x in jax.tree.leaves(tree) if x.ndim]
    total = sum(x.nbytes for x in leaves)
    mine = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == device)
    assert mine <= total / 8 * 1.05, (mine, total)


def test_the_grpo_update_is_the_same_on_every_layout(model):
  cfg, params = model
  completions = [[5, 6, 7, 8, 9], [1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [2, 2]]
  prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
  advantages = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
  updated = []
  for layout in LAYOUTS:  # training: FSDP over replica x fsdp, tensor-parallel over tensor
    mesh = _mesh(*layout)
    start = _training_params(cfg, jax.tree.map(jnp.copy, params), mesh)
    updater = PolicyUpdater(cfg, Grpo(), optax.sgd(0.5), start, mesh, DEFAULT_RULES,
                            ppo_epochs=1, mini_batches=1, micro_batch_rows=8)
    new, metrics, _ = updater(start, prompts, completions, {"advantages": advantages}, 0,
                              max_width=16)
    assert metrics["nonfinite"] == 0.0
    updated.append(jax.device_get(new))
  for other in updated[1:]:
    for a, b in zip(jax.tree.leaves(updated[0]), jax.tree.leaves(other)):
      np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert not np.allclose(updated[0]["lm_head"]["kernel"], params["lm_head"]["kernel"])


def test_a_mesh_axis_that_does_not_divide_a_dimension_is_an_error(model):
  """A vocabulary of 60 on tensor=8 names the leaf, the axis, the size and the fix; KV heads
  are marked optional (fewer KV heads than tensor devices: each keeps whole heads) and rows
  too (a batch bucket of 1 on a slice of 2), so those are replicated instead."""
  cfg, _ = model
  mesh = _mesh(1, 1, 8)
  odd = cfg.replace(vocab_size=60)
  shapes = jax.eval_shape(lambda k: init_params(odd, k), jax.random.key(0))
  with pytest.raises(ValueError, match=r"\['embed'\]\['embedding'\].*mesh axis 'tensor' "
                     r"\(8 devices\) does not divide dimension 0 \('vocab', size 60\).*"
                     r"\('vocab', 'tensor\?'\)"):
    logical_shardings(param_logical_axes(odd), mesh, DEFAULT_RULES, shapes)
  spec = logical_to_mesh_spec(P("batch", "kv_heads"), (1, 3), _mesh(2, 1, 4), DEFAULT_RULES)
  assert spec == P(None, None)
  relaxed = tuple((n, "tensor?") if n == "vocab" else (n, a) for n, a in DEFAULT_RULES)
  placed = logical_shardings(param_logical_axes(odd), mesh, relaxed, shapes)
  assert placed["embed"]["embedding"].spec == P(None, None)
