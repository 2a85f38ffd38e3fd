"""Spot training: drafter steps only on slices whose rollout is done, never after the rollout,
no effect on the rollout itself, and what it buys (accept length) on the tiny policy."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engines import engine_config
from tests.conftest import REPO, repo_config
from tests.speculative.drafters import drafter_set, example_drafters, random_drafter
from tlt_jax.drafters import EagleDrafter, trainable_part, trained_drafters
from tlt_jax.components import task_prompts
from tlt_jax.rollout.engine import accept_length
from tlt_jax.drafter_training.spot import SpotConfig, SpotTrainer, _average_slices
from tlt_jax.drafter_training.train_step import DrafterOptConfig, DrafterTrainState
from tlt_jax.mesh import make_mesh
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

GREEDY = SamplingParams(0.0)


def test_slice_copies_average_by_their_step_counts():
  # Three slices' copies began at step 10; slices 0 and 1 ran 3 and 5 steps, slice 2 none.
  stacked = DrafterTrainState(params={"w": jnp.asarray([[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]])},
                              opt_state=(jnp.asarray([3, 5, 0]),),
                              step=jnp.asarray([13, 15, 10]))
  out = _average_slices(stacked, jnp.asarray([3, 5, 0]))
  np.testing.assert_allclose(out.params["w"], (3 * np.asarray([1.0, 2.0]) +
                                               5 * np.asarray([3.0, 4.0])) / 8)
  assert int(out.opt_state[0]) == 5
  assert int(out.step) == 18  # 10 + all 8 steps
  # No steps anywhere: the state the rollout began with (slice 0's copy), exactly.
  idle = _average_slices(stacked, jnp.asarray([0, 0, 0]))
  np.testing.assert_array_equal(idle.params["w"], [1.0, 2.0])


@pytest.mark.parametrize("families", [("eagle",), trained_drafters()],
                         ids=["eagle", "every-trained-family"])
def test_spot_steps_run_only_on_idle_slices_and_stop_with_the_rollout(tiny_cfg, tiny_params,
                                                                      families):
  """With EAGLE alone, and with every registered trained family (their examples) trained
  together on the idle slice: each family's weights change."""
  mesh = make_mesh({"replica": 2, "fsdp": 2, "tensor": 1}, jax.devices()[:4])
  # One row per slice and no EOS: slice 0 serves two requests back to back, slice 1 one, so
  # slice 1 sits idle for the second half of the rollout.
  ec = engine_config(max_batch=1, max_prompt_len=8, max_new_tokens=64, sd_threshold=0)
  # A reduced draft vocabulary (EAGLE-3): its int32 map rides along untrained.
  dcfg, dparams = random_drafter(tiny_cfg, seed=4, draft_vocab_size=32)
  examples = {**example_drafters(tiny_cfg, seed=5),
              "eagle": EagleDrafter(params=dparams, settings=dcfg)}
  engine = RolloutEngine(tiny_cfg, tiny_params, mesh, ec, drafters=drafter_set((dcfg, dparams)),
                         tuner=FixedTuner((2, 2, 4)), log_features=True)
  prompts = [[1, 2, 3], [4, 5], [6]]
  spot = SpotTrainer(tiny_cfg, {n: examples[n].settings for n in families},
                     DrafterOptConfig(learning_rate=1e-3, lr_warmup_steps=1),
                     {n: examples[n].params for n in families}, mesh,
                     SpotConfig(window=32, windows=4, batch_rows=2))
  spot.precompile(engine.slices, engine.policy_on)
  before = jax.device_get(spot.params)

  spot.begin(0, engine.policy_on)
  res = engine.generate(prompts, 1, GREEDY, jax.random.key(0), on_slice_idle=spot.on_slice_idle)
  metrics = spot.finish()
  off = engine.generate(prompts, 1, GREEDY, jax.random.key(0))
  assert res.tokens == off.tokens  # spot training never touches the rollout

  recs = spot.records
  assert metrics["drafter_steps"] == len(recs) >= 1
  assert {r.slice for r in recs} == {1}  # slice 0 decodes until the end
  t_stop = metrics["rollout_end"]
  assert t_stop <= res.t_end  # the last slice's idle moment stopped the trainer
  for s in {r.slice for r in recs}:
    slice_devices = {d.id for d in engine.slices[s].devices.flat}
    mine = [r for r in recs if r.slice == s]
    for r in mine:
      assert r.devices <= slice_devices  # the step's outputs live on the idle slice only
      assert spot.idle_since[s] <= r.t_dispatch <= t_stop  # after idle, before the end
    # Within one step of the end: at most one step of a slice finishes after it.
    assert sum(r.t_done > t_stop for r in mine) <= 1
  assert metrics["idle_slice_s"] > metrics["reclaimed_slice_s"] > 0
  assert metrics["drafter_tokens"] == sum(r.tokens for r in recs) > 0

  # The averaged state is the new drafter, on the home mesh; its step counts every update.
  after = jax.device_get(spot.params)
  assert int(spot.state.step) == metrics["drafter_steps"] and set(after) == set(families)
  assert not np.allclose(before["eagle"]["fc"]["kernel"], after["eagle"]["fc"]["kernel"])
  assert not np.allclose(before["eagle"]["lm_head"]["kernel"],
                         after["eagle"]["lm_head"]["kernel"])
  np.testing.assert_array_equal(after["eagle"]["d2t"], np.arange(32))
  for name in families:  # every family's trained weights moved
    trainable = jax.tree.leaves(trainable_part(before[name]))
    moved = jax.tree.leaves(trainable_part(after[name]))
    assert any(not np.allclose(a, b) for a, b in zip(trainable, moved)), name
  engine.update_params(drafter_params=spot.params)  # a reshard onto every slice
  assert engine.generate(prompts, 1, GREEDY, jax.random.key(0)).tokens == off.tokens


# ---------------------------------------------------------------- on the tiny policy


@pytest.fixture(scope="module")
def tiny_policy():
  from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
  path = os.path.join(REPO, "assets", "tiny-policy")
  cfg = load_hf_config(path, attention_impl="reference")
  config = repo_config("default")
  tok = load_tokenizer(path)
  # Slice 0 gets the long problems and slice 1 the short ones (requests alternate between
  # slices), so slice 1 is idle for most of each rollout: a long tail, made on purpose.
  examples, prompts = task_prompts(config, tok, 400)
  steps = [ex.metadata["num_ops"] for ex in examples]
  long_ = [p for p, n in zip(prompts, steps) if n >= 6][:12]
  short = [p for p, n in zip(prompts, steps) if n <= 2][:12]
  train = [p for pair in zip(long_, short) for p in pair]
  _, held_out = task_prompts(config, tok, 12, eval_split=True)
  return cfg, load_hf_params(path, cfg), tok.eos_token_id, train, held_out


def _spot_rollouts(cfg, params, dcfg, dparams, eos, prompts, min_steps, max_rollouts=8):
  """RL-like steps with a fixed policy: rollouts (sampled, 2 slices) with spot training,
  until the drafter took min_steps updates. Returns the new drafter params and step count."""
  mesh = make_mesh({"replica": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
  # Two batch sizes and one prefill width: fewer programs to build, the same tokens.
  ec = engine_config(max_batch=8, max_prompt_len=128, max_new_tokens=192, sd_threshold=0,
                    eos_id=eos, batch_sizes=(8, 2), prompt_widths=(128,))
  engine = RolloutEngine(cfg, params, mesh, ec, log_features=True)
  spot = SpotTrainer(cfg, {"eagle": dcfg},
                     DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=10), {"eagle": dparams},
                     mesh, SpotConfig(window=128, windows=16, batch_rows=4))
  spot.precompile(engine.slices, engine.policy_on)
  steps = 0
  for rl_step in range(max_rollouts):
    spot.begin(rl_step, engine.policy_on)
    engine.generate(prompts, 1, SamplingParams(1.0), jax.random.key(rl_step),
                    on_slice_idle=spot.on_slice_idle)
    steps += spot.finish()["drafter_steps"]
    if steps >= min_steps:
      break
  return jax.device_get(spot.params["eagle"]), steps


def _accept(engine, dparams, prompts):
  engine.update_params(drafter_params={"eagle": dparams})
  return accept_length(engine.generate(prompts, 1, GREEDY, jax.random.key(0)))


def _permute_hidden(cfg, params, seed):
  from tlt_jax.models.decoder import param_logical_axes
  rng = np.random.default_rng(seed)
  perm = rng.permutation(cfg.hidden_size)

  def one(x, names):
    for axis, name in enumerate(names):
      if name == "embed":
        x = jnp.take(x, perm, axis=axis)
    return x
  return jax.tree.map(one, params, param_logical_axes(cfg),
                      is_leaf=lambda n: isinstance(n, jax.sharding.PartitionSpec))


def _sd_engine(cfg, params, dcfg, dparams, eos):
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  ec = engine_config(max_batch=4, max_prompt_len=128, max_new_tokens=96, sd_threshold=4,
                    eos_id=eos, batch_sizes=(4, 1), prompt_widths=(128,))
  return RolloutEngine(cfg, params, mesh, ec, drafters=drafter_set((dcfg, dparams)),
                       tuner=FixedTuner((4, 2, 8)))


@pytest.mark.slow
def test_spot_training_raises_accept_length_and_recovers_it_after_a_policy_change(tiny_policy):
  cfg, params, eos, train, held_out = tiny_policy
  dcfg, untrained = random_drafter(cfg, seed=5)
  sd = _sd_engine(cfg, params, dcfg, untrained, eos)
  base = _accept(sd, untrained, held_out)

  trained, steps = _spot_rollouts(cfg, params, dcfg, untrained, eos, train, min_steps=60)
  assert steps >= 60
  learned = _accept(sd, trained, held_out)
  assert learned > base + 0.3, (base, learned)

  # A change of the policy that moves its feature space under the drafter: the hidden
  # dimensions are permuted in every weight (an exact reparametrisation, so the policy's
  # tokens stay the same while the features the drafter reads and predicts move).
  changed = _permute_hidden(cfg, params, seed=0)
  sd_changed = _sd_engine(cfg, changed, dcfg, trained, eos)
  same_tokens = sd_changed.generate(held_out, 1, GREEDY, jax.random.key(0)).tokens
  assert same_tokens == sd.generate(held_out, 1, GREEDY, jax.random.key(0)).tokens
  frozen = _accept(sd_changed, trained, held_out)
  assert frozen < learned - 0.3, (learned, frozen)  # the frozen drafter went stale

  adapted, steps = _spot_rollouts(cfg, changed, dcfg, trained, eos, train, min_steps=60)
  recovered = _accept(sd_changed, adapted, held_out)
  # It wins back at least half of what the policy change took.
  assert recovered > frozen + 0.5 * (learned - frozen), (learned, frozen, recovered)
  print(f"accept length: untrained {base:.2f}, spot-trained {learned:.2f}; after the policy "
        f"change: frozen {frozen:.2f}, spot-trained {recovered:.2f}")
