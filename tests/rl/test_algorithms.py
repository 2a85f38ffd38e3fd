"""RL algorithms (tlt_jax.rl.algorithms): GRPO as before, DAPO's group filter, overlong
shaping and rounds of dynamic sampling, Dr. GRPO's advantages and normaliser, GSPO's
sequence ratio, and their config checks (their losses against TRL: test_trl_parity.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.conftest import REPO
from tlt_jax.cli import config_from_file, set_config_value
from tlt_jax.components import algorithm_from_config, validate_config
from tlt_jax.config import ConfigError, base_config
from tlt_jax.models.hf import load_tokenizer
from tlt_jax.rl.algorithms import (ALGORITHMS, Dapo, DapoSettings, Grpo, GspoSettings,
                                   make_algorithm, register_algorithm)
from tlt_jax.rl.data import PromptIterator
from tlt_jax.rl.loss import ADVANTAGES, SHARED_KNOBS, BatchInput, LossConfig, group_advantages
from tlt_jax.rl.phases import merge_rollouts, sample_step, Rollout
from tlt_jax.rl.tasks import ArithmeticTask
from tlt_jax.rollout.engine import RolloutResult


def _dapo(**settings) -> Dapo:
  return make_algorithm("dapo", LossConfig(clip_eps_high=0.28), 100, settings)


def test_grpo_is_the_group_normalised_advantage_with_one_round():
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1], np.float32)
  grpo = Grpo()
  assert grpo.rounds == 1 and grpo.keep_groups(rewards, 4).tolist() == [True, True]
  np.testing.assert_array_equal(grpo.advantages(rewards, np.full(8, 99), 4),
                                group_advantages(rewards, 4))
  assert grpo.step_metrics(rewards, np.full(8, 99)) == {}


def test_dapo_keeps_only_groups_with_a_spread():
  rewards = np.array([1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0.5, 0], np.float32)
  assert _dapo().keep_groups(rewards, 3).tolist() == [True, False, False, True]


def test_dapo_s_default_buffer_is_a_quarter_of_any_budget_so_the_smoke_config_runs_it():
  """rl.algorithm=dapo alone on the smoke config (48-token responses): no other knob."""
  config = config_from_file(f"{REPO}/configs/default.py:runlocal", ["rl.algorithm=dapo"])
  validate_config(config)
  assert algorithm_from_config(config).buffer == 12
  assert _dapo().buffer == 25 and _dapo(overlong_buffer=0).buffer == 0


def test_dapo_overlong_penalty_ramps_over_the_buffer():
  dapo = _dapo(overlong_buffer=20, overlong_penalty=0.5)  # budget 100: ramp over 80..100
  np.testing.assert_allclose(dapo.overlong_penalty(np.array([10, 80, 90, 95, 100])),
                             [0, 0, -0.25, -0.375, -0.5])
  np.testing.assert_array_equal(_dapo(overlong_buffer=0).overlong_penalty(np.array([100])),
                                [0])
  rewards, lengths = np.array([1, 1, 0, 0], np.float32), np.array([10, 100, 10, 90])
  np.testing.assert_allclose(dapo.advantages(rewards, lengths, 2),
                             group_advantages(rewards + [0, -0.5, 0, -0.25], 2), rtol=1e-6)
  assert dapo.step_metrics(rewards, lengths) == pytest.approx(
      {"overlong_penalty_mean": -0.1875})


@pytest.mark.parametrize("algorithm,key,value,message", [
    ("dapo", "rl.algorithm", "ppo", r"rl.algorithm='ppo' is not allowed; allowed values: "
                                    r"\('grpo', 'dapo', 'dr_grpo', 'gspo'\)"),
    ("dapo", "rl.dapo.overlong_buffer", 256, r"rl.dapo.overlong_buffer=256 must be in \[0, "
                                             r"rollout.max_new_tokens=256\), or -1 for a "
                                             r"quarter of it"),
    ("dapo", "rl.dapo.overlong_buffer", -2, r"rl.dapo.overlong_buffer=-2 must be in \[0, "),
    ("dapo", "rl.dapo.max_rounds", 0, "rl.dapo.max_rounds=0 must be >= 1"),
    ("gspo", "rl.gspo.clip_eps", 0.0, r"rl.gspo.clip_eps=0.0 must be in \(0, 1\)"),
])
def test_algorithm_config_errors_name_the_key(algorithm, key, value, message):
  config = base_config()
  config.rl.algorithm = algorithm
  set_config_value(config, key, value)
  with pytest.raises(ConfigError, match=message):
    validate_config(config)


def test_dr_grpo_centres_without_the_std_and_divides_by_a_constant():
  dr = make_algorithm("dr_grpo", LossConfig(), 10)
  rewards = np.array([1, 0, 0, 0, 1, 1], np.float32)
  np.testing.assert_allclose(dr.advantages(rewards, np.full(6, 3), 3),
                             [2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3], rtol=1e-6)
  mask = np.arange(8)[None] < np.array([[3], [8], [1], [0]])  # a padding row last
  # every token weighs 1 / (3 responses x 10 tokens of budget)
  np.testing.assert_allclose(dr.loss_weights(mask), [3 / 30, 8 / 30, 1 / 30, 0], rtol=1e-6)


def test_gspo_ratio_is_one_per_response():
  gspo = make_algorithm("gspo", LossConfig(), 10)
  assert gspo.clip_range == (3e-4, 4e-4)
  maskf = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  logp, old = np.array([[-1, -2, 0], [-3, 0, 0]], np.float32), np.zeros((2, 3), np.float32)
  np.testing.assert_allclose(gspo.log_ratio(logp, old, maskf), [[-1.5], [-3.0]])
  np.testing.assert_allclose(gspo.loss_weights(maskf > 0), [0.5, 0.5])


@pytest.mark.parametrize("algorithm,key,value", [
    ("dr_grpo", "rl.scale_by_std", False), ("dr_grpo", "rl.loss_agg", "sequence_mean"),
    ("gspo", "rl.clip_eps", 0.1), ("gspo", "rl.clip_eps_high", 0.3),
    ("gspo", "rl.loss_agg", "sequence_mean"), ("dapo", "rl.loss_agg", "sequence_mean")])
def test_a_shared_knob_the_algorithm_ignores_set_away_from_its_default_is_an_error(
    algorithm, key, value):
  config = base_config()
  config.rl.algorithm = algorithm
  set_config_value(config, key, value)
  with pytest.raises(ConfigError) as e:
    validate_config(config)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith(f"{key}={value!r} is set but rl.algorithm={algorithm!r} does not "
                            f"read it")
  assert f"leave {key} at its default" in message
  if algorithm == "gspo":
    assert "rl.gspo.*" in message
  set_config_value(config, key, getattr(LossConfig(), key.split(".")[1]))
  validate_config(config)  # at its default it is fine


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_declares_shared_knobs_that_exist_and_runs_at_the_defaults(name):
  assert set(ALGORITHMS[name].reads) <= set(SHARED_KNOBS)
  config = base_config()
  config.rl.algorithm = name
  validate_config(config)
  assert type(algorithm_from_config(config)) is ALGORITHMS[name]


def test_a_misdeclared_shared_knob_is_refused_when_the_algorithm_registers():
  class Typo(Grpo):
    reads = ("clip_epsilon",)
  with pytest.raises(ValueError, match=r"declares shared knobs that do not exist: "
                                       r"\['clip_epsilon'\]"):
    register_algorithm("typo")(Typo)
  assert "typo" not in ALGORITHMS


def test_every_algorithm_s_settings_are_a_config_section_with_its_defaults():
  config = base_config()
  assert config.rl.dapo.to_dict() == {"max_rounds": 3, "overlong_buffer": -1,
                                      "overlong_penalty": 1.0}
  config.rl.algorithm = "dapo"
  config.rl.dapo.max_rounds = 5
  algorithm = algorithm_from_config(config)
  assert isinstance(algorithm, ALGORITHMS["dapo"])
  assert algorithm.settings == DapoSettings(max_rounds=5)
  assert algorithm.loss.clip_eps_high == config.rl.clip_eps_high
  assert config.rl.gspo.to_dict() == {"clip_eps": 3e-4, "clip_eps_high": 4e-4}
  config.rl.algorithm, config.rl.gspo.clip_eps_high = "gspo", 1e-3
  assert algorithm_from_config(config).settings == GspoSettings(clip_eps_high=1e-3)
  assert "dr_grpo" not in config.rl  # no knobs of its own, no section


class ScriptedEngine:
  """Returns, for the n-th generate call, the scripted responses ('1' right, '0' wrong) of
  its groups; stands in for the rollout engine where only the rounds' logic is tested."""

  def __init__(self, tokenizer, script: list[list[str]]):
    self.tokenizer, self.script, self.calls = tokenizer, script, []

  def generate(self, prompts, num_samples, sampling, key, on_slice_idle=None,
               log_requests=None):
    texts = self.script[len(self.calls)]
    self.calls.append((len(prompts), key))
    assert len(texts) == len(prompts) * num_samples
    tokens = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return RolloutResult(tokens=tokens, lengths=np.array([len(t) for t in tokens]),
                         finish_reasons=["eos"] * len(tokens), timeline=[],
                         slice_done_s=[0.5], wall_s=1.0, pool={}, feature_blocks=[None])


def _right(prompts, completions, **_):
  return [float(c.strip() == "1") for c in completions]


def _sample(algorithm, script):
  tokenizer = load_tokenizer(f"{REPO}/assets/tiny-policy")
  config = base_config()
  config.rl.prompts_per_step, config.rl.num_samples = 2, 2
  engine = ScriptedEngine(tokenizer, script)
  prompts = PromptIterator(ArithmeticTask(seed=0).examples(32), seed=0)
  samples = sample_step(engine, None, prompts, tokenizer, algorithm, _right, _right, None,
                        jax.random.key(0), 0, config)
  return samples, engine, prompts


def test_dapo_rolls_out_rounds_until_enough_groups_have_a_spread():
  # Round 0: groups (1,1) and (1,0) -> one kept; round 1: (0,0), (0,1) -> a second one.
  samples, engine, prompts = _sample(_dapo(), [["1", "1", "1", "0"], ["0", "0", "0", "1"],
                                               ["1", "0", "1", "0"]])
  assert samples.rounds == 2 and len(engine.calls) == 2
  assert samples.train_groups == [1, 3]
  assert len(samples.examples) == len(samples.prompts) == 4
  assert prompts.state_dict()["index"] == 4  # each round takes fresh problems
  np.testing.assert_array_equal(samples.scored.rewards, [1, 1, 1, 0, 0, 0, 0, 1])
  assert samples.rolled.seconds >= 0 and samples.rolled.result.wall_s == 2.0
  assert samples.rolled.spot["idle_slice_s"] == 1.0  # 0.5 slice-seconds per round
  # Each round samples with its own key; the first round's is GRPO's.
  assert not np.array_equal(jax.random.key_data(engine.calls[0][1]),
                            jax.random.key_data(engine.calls[1][1]))


def test_dapo_stops_after_max_rounds_and_grpo_after_one():
  script = [["1", "1", "0", "0"]] * 3
  samples, engine, _ = _sample(_dapo(max_rounds=2), script)
  assert (samples.rounds, samples.train_groups) == (2, [])
  samples, engine, _ = _sample(Grpo(), script)
  assert (samples.rounds, samples.train_groups, len(engine.calls)) == (1, [0, 1], 1)


def test_merged_rounds_average_the_drafter_loss_over_its_steps():
  def rollout(spot):
    result = RolloutResult(tokens=[[1]], lengths=np.array([1]), finish_reasons=["eos"],
                           timeline=[], slice_done_s=[1.0], wall_s=1.0, pool={},
                           feature_blocks=[None])
    return Rollout(result, 1.0, spot)
  merged = merge_rollouts([
      rollout({"drafter_steps": 3, "drafter_loss": 1.0, "idle_slice_s": 2.0}),
      rollout({"drafter_steps": 1, "drafter_loss": 5.0, "idle_slice_s": 1.0}),
      rollout({"drafter_steps": 0, "drafter_loss": None, "idle_slice_s": 0.0})])
  assert merged.spot == {"drafter_steps": 4, "drafter_loss": 2.0, "idle_slice_s": 3.0}
  assert merged.seconds == 3.0 and merged.result.tokens == [[1]] * 3


def test_a_step_trains_on_its_kept_groups_in_the_usual_batch_shape(tiny_cfg, tiny_params):
  """update_policy: a partial batch (one group of two kept) is padded to the full batch's
  shape (no new program), trains only on its own rows, and no kept group updates nothing."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.phases import Scored, StepSamples, update_policy
  from tlt_jax.rl.policy_update import PolicyUpdater
  config = base_config()
  config.rl.prompts_per_step, config.rl.num_samples = 2, 2
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  updater = PolicyUpdater(tiny_cfg, Grpo(), optax.sgd(0.5), jax.tree.map(jnp.copy, tiny_params),
                          mesh, DEFAULT_RULES, ppo_epochs=1, mini_batches=1,
                          micro_batch_rows=4)
  tokens = [[5, 6, 7], [8, 9], [3, 3, 3, 3], [4]]
  result = RolloutResult(tokens=tokens, lengths=np.array([3, 2, 4, 1]),
                         finish_reasons=["eos"] * 4, timeline=[], slice_done_s=[], wall_s=0.0,
                         pool={}, feature_blocks=[])

  def samples(groups, rewards):
    return StepSamples(examples=[None, None], prompts=[[1, 2], [3]],
                       rolled=Rollout(result, 0.0, {}),
                       scored=Scored(["x"] * 4, np.array(rewards, np.float32), np.zeros(4)),
                       train_groups=groups, rounds=1)

  def run(groups, rewards):
    params = jax.tree.map(jnp.copy, tiny_params)
    new, metrics = update_policy(updater, Grpo(), params, samples(groups, rewards), 0, 64,
                                 config)
    return jax.device_get(new), metrics

  kept, metrics = run([1], [1, 1, 1, 0])
  assert metrics["nonfinite"] == 0.0 and metrics["grad_norm"] > 0
  # ... is the update of group 1's rows alone (its own token-mean), not of both groups'
  alone, _, _ = updater(jax.tree.map(jnp.copy, tiny_params), [[3], [3]], tokens[2:],
                        {"advantages": group_advantages(np.array([1, 0], np.float32), 2)}, 0,
                        max_width=64)
  both, _ = run([0, 1], [1, 1, 1, 0])
  for a, b in zip(jax.tree.leaves(jax.device_get(alone)), jax.tree.leaves(kept)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  assert not np.allclose(both["lm_head"]["kernel"], kept["lm_head"]["kernel"])
  assert len(updater.pool) == 1  # one update program: the same batch shape each time
  none, metrics = run([], [1, 1, 0, 0])
  assert metrics == {"loss": 0.0, "grad_norm": 0.0, "clip_frac": 0.0, "nonfinite": 0.0,
                     "params_finite": 1.0}
  for a, b in zip(jax.tree.leaves(none), jax.tree.leaves(jax.device_get(tiny_params))):
    np.testing.assert_array_equal(a, b)


def test_the_group_size_is_the_algorithm_s_check_and_names_the_key():
  """rl.num_samples below the algorithm's min_group_size stops the run in one line, from the
  algorithm's own check (the schema does not know what an algorithm compares)."""
  config = base_config()
  config.rl.num_samples = 1
  with pytest.raises(ConfigError, match=r"rl.num_samples=1: rl.algorithm='grpo' compares "
                                        r"samples within a group, so it needs at least 2"):
    validate_config(config)

  class Single(Grpo):  # an algorithm that would take one sample per prompt
    min_group_size = 1
  Single.check_group_size(1, "single")
  with pytest.raises(ValueError, match="needs at least 2"):
    Grpo.check_group_size(1, "grpo")


SCALE = BatchInput("scale", np.float32, "row")


@dataclasses.dataclass(frozen=True)
class ScaledGrpo(Grpo):
  """GRPO whose advantages are multiplied by a per-row input of its own, "scale"."""
  inputs = (ADVANTAGES, SCALE)

  def response_inputs(self, rewards, lengths, group_size):
    return {**super().response_inputs(rewards, lengths, group_size),
            "scale": np.full(len(rewards), 2.0, np.float32)}

  def policy_loss(self, logp, batch, entropy=None):
    return super().policy_loss(logp, dict(batch, advantages=batch["advantages"]
                                          * batch["scale"]), entropy)


def _compiled_updater(cfg, params, algorithm, rows: int, widths=()):
  """A PolicyUpdater of `algorithm` on one device, one micro-batch of `rows` rows; with
  `widths`, its update for `rows` sequences of up to 64 tokens compiled ahead."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.policy_update import PolicyUpdater
  from tlt_jax.rollout.pool import wait_for_compiles_ahead
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  updater = PolicyUpdater(cfg, algorithm, optax.sgd(0.5), jax.tree.map(jnp.copy, params), mesh,
                          DEFAULT_RULES, ppo_epochs=1, mini_batches=1, micro_batch_rows=rows,
                          widths=widths)
  if widths:
    updater.compile_ahead(params, rows, 64)
    wait_for_compiles_ahead()
  return updater


def test_an_algorithm_s_own_row_input_reaches_its_loss_through_the_update(tiny_cfg,
                                                                         tiny_params):
  """A declared per-row input ("scale" = 2) is laid out, compiled ahead and fed to the loss by
  the update as it stands: the update equals GRPO's on doubled advantages, from the program
  compiled ahead; undeclared inputs are refused by name."""
  prompts, completions = [[3, 4], [5]], [[6, 7, 8], [9, 10]]
  rewards, lengths = np.array([1.0, 0.0], np.float32), np.array([3, 2])

  def update(algorithm, inputs, widths=()):
    updater = _compiled_updater(tiny_cfg, tiny_params, algorithm, 2, widths)
    params, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), prompts, completions,
                                 inputs, 0, max_width=64)
    return jax.device_get(params), metrics, updater.pool.report()

  scaled = ScaledGrpo()
  inputs = scaled.response_inputs(rewards, lengths, 2)
  got, metrics, report = update(scaled, inputs, widths=(32,))
  assert report["compiles"] == 0 and report["ahead_compiles"] == 1
  want, want_metrics, _ = update(Grpo(), {"advantages": 2 * inputs["advantages"]})
  assert metrics["loss"] == pytest.approx(want_metrics["loss"], rel=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
  with pytest.raises(ValueError, match=r"the algorithm's inputs are \['advantages'\]"):
    update(Grpo(), inputs)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_updates_the_policy_from_the_program_compiled_ahead(tiny_cfg,
                                                                            tiny_params, name):
  """Every registered algorithm at its defaults (a plug-in's too: tests/conftest.py registers
  TLT_PLUGINS first): the inputs it declares, made by its response_inputs from two groups of
  mixed rewards, are laid out by the update and its program compiled ahead, and one step moves
  the policy with finite numbers."""
  config = base_config()
  config.rl.algorithm = name
  algorithm = algorithm_from_config(config)
  prompts, completions = [[3, 4], [3, 4], [5], [5]], [[6, 7, 8], [9, 10], [11], [12, 13]]
  rewards, lengths = np.array([1.0, 0.0, 0.0, 1.0], np.float32), np.array([3, 2, 1, 2])
  inputs = algorithm.response_inputs(rewards, lengths, 2)
  updater = _compiled_updater(tiny_cfg, tiny_params, algorithm, 4, widths=(32,))
  new, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), prompts, completions, inputs,
                            0, max_width=64)
  report = updater.pool.report()
  assert report["compiles"] == 0 and report["ahead_compiles"] == 1
  assert metrics["nonfinite"] == 0.0 and metrics["grad_norm"] > 0
  assert not np.allclose(jax.device_get(new)["lm_head"]["kernel"],
                         jax.device_get(tiny_params)["lm_head"]["kernel"])


TOKEN_WEIGHT = BatchInput("token_weight", np.float32, "token")


@dataclasses.dataclass(frozen=True)
class TokenWeighted(Grpo):
  """GRPO with a token-level input of its own: each response token's value is its 1-based
  index in the response, reported as its token mean."""
  inputs = (ADVANTAGES, TOKEN_WEIGHT)

  def response_inputs(self, rewards, lengths, group_size):
    return {**super().response_inputs(rewards, lengths, group_size),
            "token_weight": [np.arange(1, n + 1, dtype=np.float32) for n in lengths]}

  def loss_fn(self, params, batch, cfg):
    loss, metrics = super().loss_fn(params, batch, cfg)
    mask = batch["loss_mask"]
    metrics["token_weight_mean"] = (jnp.sum(jnp.where(mask, batch["token_weight"], 0.0))
                                    / jnp.maximum(jnp.sum(mask), 1))
    metrics["token_weight_off_mask_max"] = jnp.max(jnp.where(mask, 0.0, batch["token_weight"]))
    return loss, metrics


@pytest.mark.parametrize("widths", [(), (32,)])
def test_an_algorithm_s_own_token_input_is_placed_at_its_response_tokens(tiny_cfg, tiny_params,
                                                                         widths):
  """A declared token-level input is laid out at the positions that predict each response's
  tokens (0 elsewhere), widened with the batch and compiled ahead like the rest."""
  from tlt_jax.rl.phases import take_rows
  prompts, completions = [[3, 4], [5], [6, 7, 1]], [[6, 7, 8], [9, 10], [2]]
  lengths = np.array([len(c) for c in completions])
  algorithm = TokenWeighted()
  inputs = algorithm.response_inputs(np.array([1.0, 0.0, 0.0], np.float32), lengths, 3)
  updater = _compiled_updater(tiny_cfg, tiny_params, algorithm, 4, widths)
  rows = [0, 2]  # the update trains on a subset of the step's responses
  _, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), [prompts[r] for r in rows],
                          [completions[r] for r in rows],
                          {k: take_rows(v, rows) for k, v in inputs.items()}, 0, max_width=64,
                          min_rows=4)
  assert metrics["token_weight_mean"] == pytest.approx((1 + 2 + 3 + 1) / 4)
  assert metrics["token_weight_off_mask_max"] == 0.0
  assert updater.pool.report()["compiles"] == (0 if widths else 1)


def test_the_updater_holds_a_reference_exactly_when_the_algorithm_reads_one(tiny_cfg,
                                                                          tiny_params):
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.policy_update import PolicyUpdater
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  with_kl = Grpo(LossConfig(kl_coef=0.1))
  assert with_kl.uses_reference and not Grpo().uses_reference
  assert [i.key for i in with_kl.batch_inputs] == ["advantages", "weight", "ref_logp"]
  for algorithm, ref in ((with_kl, None), (Grpo(), tiny_params)):
    with pytest.raises(ValueError, match="give ref_params exactly when it does"):
      PolicyUpdater(tiny_cfg, algorithm, optax.sgd(0.5), tiny_params, mesh, DEFAULT_RULES,
                    ppo_epochs=1, mini_batches=1, micro_batch_rows=2, ref_params=ref)


def test_the_memory_budget_lays_out_the_batch_the_algorithm_declares(monkeypatch):
  """tlt_jax.budget's policy update takes the algorithm's declared inputs (with their level:
  a row input is [micro-batches, rows]), and the reference's log-probs only with kl_coef."""
  from tlt_jax.budget import job_programs
  monkeypatch.setitem(ALGORITHMS, "scaled", ScaledGrpo)
  config = base_config()
  config.rl.algorithm = "scaled"
  update = {p.name: p for p in job_programs(config, "train")[1]}["rl_update"]
  batch = update.args[2]
  assert set(batch) == {"tokens", "targets", "loss_mask", "advantages", "weight", "scale"}
  assert batch["scale"].shape == batch["advantages"].shape == batch["tokens"].shape[:2]
  config.rl.kl_coef = 0.1
  update = {p.name: p for p in job_programs(config, "train")[1]}["rl_update"]
  assert "ref_logp" in update.args[2] and update.args[2]["ref_logp"].dtype == np.float32
