"""GRPO: advantages, the clipped loss, KL, aggregation and gradient accumulation, against
hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.engines import engine_config
from tlt_jax.rl.algorithms import Grpo
from tlt_jax.rl.loss import LossConfig, group_advantages, token_log_probs
from tlt_jax.rl.policy_update import (build_rows, make_policy_update, nonfinite_update_message,
                                     split_minibatches)


def test_group_advantages():
  r = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  np.testing.assert_allclose(group_advantages(r, 4), [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
  np.testing.assert_allclose(group_advantages(r, 4, scale_by_std=False),
                             [.5, -.5, -.5, .5, 0, 0, 0, 0])
  with pytest.raises(ValueError, match="groups of 3"):
    group_advantages(r, 3)


def test_loss_weights_token_and_sequence_mean():
  mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_allclose(Grpo().loss_weights(mask), [3 / 4, 1 / 4, 0])
  np.testing.assert_allclose(Grpo(LossConfig(loss_agg="sequence_mean")).loss_weights(mask),
                             [1 / 2, 1 / 2, 0])


def test_build_rows_masks_exactly_the_response_targets():
  rows = build_rows([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], {"advantages": np.array([0.5, -1.0])},
                    rows=4,
                    pad_id=0)
  assert rows["tokens"].shape == (4, 64)
  np.testing.assert_array_equal(rows["tokens"][0, :6], [5, 6, 7, 1, 2, 0])
  # Row 0: positions 2 and 3 predict the response tokens 1 and 2.
  np.testing.assert_array_equal(np.nonzero(rows["loss_mask"][0])[0], [2, 3])
  np.testing.assert_array_equal(rows["targets"][0, 2:4], [1, 2])
  np.testing.assert_array_equal(np.nonzero(rows["loss_mask"][1])[0], [0, 1, 2])
  np.testing.assert_array_equal(rows["targets"][1, :3], [3, 4, 9])
  assert not rows["loss_mask"][2:].any()
  np.testing.assert_allclose(rows["advantages"], [0.5, -1.0, 0, 0])


def grpo_rows(completion_lengths=(4, 2, 6, 3), seed=0) -> dict:
  """Four random prompt + completion rows with advantages and token-mean weights."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, 60, n).tolist() for n in (3, 5, 2, 4)]
  completions = [rng.integers(1, 60, n).tolist() for n in completion_lengths]
  rows = build_rows(prompts, completions,
                    {"advantages": np.array([1.0, -0.5, 2.0, -1.5], np.float32)}, 4, 0)
  rows["weight"] = Grpo().loss_weights(rows["loss_mask"])
  return rows


@pytest.fixture(scope="module")
def batch(tiny_cfg):
  return {k: jnp.asarray(v) for k, v in grpo_rows().items()}


def _logp(tiny_cfg, tiny_params, batch):
  return np.asarray(token_log_probs(tiny_params, batch["tokens"], batch["targets"],
                                    batch["loss_mask"], tiny_cfg)[0])


def test_log_probs_match_a_direct_softmax(tiny_cfg, tiny_params, batch):
  from tlt_jax.models import forward
  from tlt_jax.models.attention_inputs import rows_inputs
  tokens = batch["tokens"][:1, :7]  # row 0 alone, unpadded
  logits = forward(tiny_params, tokens, rows_inputs(1, 7), tiny_cfg)[0]
  lp = jax.nn.log_softmax(logits[0], -1)
  want = [float(lp[t, batch["targets"][0, t]]) for t in range(2, 6)]
  np.testing.assert_allclose(_logp(tiny_cfg, tiny_params, batch)[0, 2:6], want, atol=1e-5)


def test_loss_at_ratio_one_is_minus_the_weighted_advantage(tiny_cfg, tiny_params, batch):
  gc = LossConfig()
  loss, m = Grpo(gc).loss_fn(tiny_params, batch, tiny_cfg)
  n = np.asarray(batch["loss_mask"]).sum(1)
  # token mean: -(sum_b A_b n_b) / sum_b n_b
  want = -np.sum(np.asarray(batch["advantages"]) * n) / n.sum()
  np.testing.assert_allclose(float(loss), want, rtol=1e-5)
  assert float(m["clip_frac"]) == 0.0


@pytest.mark.parametrize("eps_high", [0.2, 0.28])
def test_clipping_with_clip_higher(tiny_cfg, tiny_params, batch, eps_high):
  logp = _logp(tiny_cfg, tiny_params, batch)
  mask = np.asarray(batch["loss_mask"])
  b = dict(batch, old_logp=jnp.asarray(np.where(mask, logp - np.log(1.5), 0.0)))  # ratio 1.5
  loss, m = Grpo(LossConfig(clip_eps=0.2, clip_eps_high=eps_high)).loss_fn(tiny_params, b,
                                                                            tiny_cfg)
  adv, n = np.asarray(batch["advantages"]), mask.sum(1)
  # A > 0: min(1.5 A, (1 + eps_high) A); A < 0: min(1.5 A, 1.2 A) = 1.5 A (not clipped).
  per_row = np.where(adv > 0, -(1 + eps_high) * adv, -1.5 * adv)
  np.testing.assert_allclose(float(loss), np.sum(per_row * n) / n.sum(), rtol=1e-4)
  np.testing.assert_allclose(float(m["clip_frac"]), n[adv > 0].sum() / n.sum(), rtol=1e-5)


def test_kl_low_variance_estimator_and_sequence_mean(tiny_cfg, tiny_params, batch):
  logp = _logp(tiny_cfg, tiny_params, batch)
  mask = np.asarray(batch["loss_mask"])
  d = 0.3
  b = dict(batch, advantages=jnp.zeros(4), ref_logp=jnp.asarray(np.where(mask, logp + d, 0.0)),
           weight=jnp.asarray(Grpo(LossConfig(loss_agg="sequence_mean")).loss_weights(mask)))
  loss, m = Grpo(LossConfig(kl_coef=0.5, loss_agg="sequence_mean")).loss_fn(tiny_params, b,
                                                                            tiny_cfg)
  k3 = np.exp(d) - d - 1  # exp(ref - logp) - (ref - logp) - 1
  np.testing.assert_allclose(float(loss), 0.5 * k3, rtol=1e-4)
  np.testing.assert_allclose(float(m["kl"]), k3, rtol=1e-4)


def test_gradient_accumulation_equals_one_big_batch(tiny_cfg, tiny_params, batch):
  gc = LossConfig()
  tx = optax.sgd(0.1)
  host = {k: np.asarray(v) for k, v in batch.items() if k != "weight"}
  results = []
  for micro_rows in (4, 2, 1):
    mb = split_minibatches(host, 1, micro_rows, Grpo(gc).loss_weights)
    mini = {k: jnp.asarray(v[0]) for k, v in mb.items()}
    params = jax.tree.map(jnp.copy, tiny_params)
    update = make_policy_update(tiny_cfg, Grpo(gc).loss_fn, tx, None, None)
    params, _, metrics = update(params, tx.init(params), mini)
    results.append((params, float(metrics["loss"])))
  for params, loss in results[1:]:
    assert loss == pytest.approx(results[0][1], rel=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params,
                 results[0][0])
  # And the update moved the params.
  assert not np.allclose(results[0][0]["lm_head"]["kernel"], tiny_params["lm_head"]["kernel"])


def test_updates_raise_the_likelihood_of_good_responses_and_lower_bad_ones(tiny_cfg,
                                                                           tiny_params):
  rng = np.random.default_rng(3)
  prompt = rng.integers(1, 60, 4).tolist()
  good, bad = rng.integers(1, 60, 6).tolist(), rng.integers(1, 60, 6).tolist()
  adv = group_advantages(np.array([1.0, 0.0]), 2)  # [+1, -1]
  rows = build_rows([prompt, prompt], [good, bad], {"advantages": adv}, 2, 0)
  mini = {k: jnp.asarray(v[0]) for k, v in split_minibatches(rows, 1, 2, Grpo().loss_weights).items()}
  tx = optax.adam(1e-3)
  update = make_policy_update(tiny_cfg, Grpo().loss_fn, tx, None, None)
  params = jax.tree.map(jnp.copy, tiny_params)
  opt_state = tx.init(params)
  rows_only = {k: v[0] for k, v in mini.items()}  # the one micro-batch
  before = _logp(tiny_cfg, params, rows_only).sum(axis=1)
  for _ in range(5):
    params, opt_state, _ = update(params, opt_state, mini)
  after = _logp(tiny_cfg, params, rows_only).sum(axis=1)
  assert after[0] > before[0] + 0.1 and after[1] < before[1] - 0.1, (before, after)


def test_one_grpo_step_moves_the_weights_as_a_hand_written_reference_says(tiny_cfg,
                                                                         tiny_params):
  """PolicyUpdater's step (padded rows, two micro-batches, SGD) against GRPO written out by
  hand: each response scored alone, unpadded, by a plain softmax of the policy's logits;
  at ratio 1 the loss's gradient is that of -sum_i A_i sum_t log p(y_it) / (all response
  tokens), A_i the group-normalised rewards; SGD moves the weights by -lr x that gradient."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.models import forward
  from tlt_jax.models.attention_inputs import rows_inputs
  from tlt_jax.rl.policy_update import PolicyUpdater
  rng = np.random.default_rng(7)
  prompts = [rng.integers(1, 60, 3).tolist()] * 2 + [rng.integers(1, 60, 5).tolist()] * 2
  completions = [rng.integers(1, 60, n).tolist() for n in (4, 1, 7, 3)]
  rewards = np.array([1.0, 0.0, 0.2, 1.0], np.float32)
  mean = rewards.reshape(2, 2).mean(1).repeat(2)
  std = rewards.reshape(2, 2).std(1).repeat(2)
  adv = (rewards - mean) / (std + 1e-6)  # GRPO's advantages, by hand

  def reference_loss(params):
    total, tokens = 0.0, 0
    for p, c, a in zip(prompts, completions, adv):
      seq = jnp.asarray([p + c], jnp.int32)
      logits = forward(params, seq, rows_inputs(1, seq.shape[1]), tiny_cfg)[0][0]
      logq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
      # position len(p) - 1 + t predicts response token t
      total = total - a * sum(logq[len(p) - 1 + t, tok] for t, tok in enumerate(c))
      tokens += len(c)
    return total / tokens

  lr = 0.5
  # Jitted: run op by op, the hand-written loops took 17 s of this test's 29 on one CPU core.
  grads = jax.jit(jax.grad(reference_loss))(tiny_params)
  want = jax.tree.map(lambda p, g: p - lr * g, tiny_params, grads)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  updater = PolicyUpdater(tiny_cfg, Grpo(), optax.sgd(lr), jax.tree.map(jnp.copy, tiny_params),
                          mesh, DEFAULT_RULES, ppo_epochs=1, mini_batches=1, micro_batch_rows=2)
  advantages = Grpo().advantages(rewards, np.array([len(c) for c in completions]), 2)
  np.testing.assert_allclose(advantages, adv, rtol=1e-6)
  got, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), prompts, completions,
                            {"advantages": advantages}, 0, max_width=64,
                            min_rows=6)  # 2 padding rows
  # The surrogate's value at ratio 1: -sum_i A_i n_i / (all tokens).
  n = np.array([len(c) for c in completions])
  assert metrics["loss"] == pytest.approx(-np.sum(adv * n) / n.sum(), rel=1e-5)
  assert metrics["grad_norm"] == pytest.approx(float(optax.tree.norm(grads)), rel=1e-5)
  moved = 0.0
  for w, g, p in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)),
                     jax.tree.leaves(tiny_params)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    moved = max(moved, float(np.abs(np.asarray(w) - np.asarray(p)).max()))
  assert moved > 1e-3  # the step did move the weights


def test_the_update_reports_how_far_its_log_probs_are_from_the_rollouts(tiny_cfg, tiny_params):
  """Given the rollout's log-probs, the update reports the mean and largest distance of its
  own (before its optimizer step) from them, over the response tokens: 0 up to float32
  rounding when they are the trainer's own numbers, the shift of the one token moved."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.policy_update import PolicyUpdater, build_rows
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, 60, 3).tolist() for _ in range(4)]
  completions = [rng.integers(1, 60, n).tolist() for n in (4, 6, 2, 5)]
  rows = build_rows(prompts, completions, {"advantages": np.zeros(4)}, 4, 0)
  own = np.asarray(_logp(tiny_cfg, tiny_params, rows))
  logps = [own[i, len(p) - 1:len(p) - 1 + len(c)].tolist()
           for i, (p, c) in enumerate(zip(prompts, completions))]
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])

  def report(rollout_logps):
    updater = PolicyUpdater(tiny_cfg, Grpo(), optax.sgd(0.1), jax.tree.map(jnp.copy, tiny_params),
                            mesh, DEFAULT_RULES, ppo_epochs=1, mini_batches=1,
                            micro_batch_rows=2)
    _, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), prompts, completions,
                            {"advantages": np.array([1.0, -1.0, 0.5, -0.5], np.float32)}, 0,
                            max_width=64,
                            rollout_logps=rollout_logps)
    return metrics
  same = report(logps)
  assert same["rollout_logp_diff_max"] < 1e-5 and same["rollout_logp_diff_mean"] < 1e-6
  moved = [list(lp) for lp in logps]
  moved[1][3] += 0.5
  got = report(moved)
  assert got["rollout_logp_diff_max"] == pytest.approx(0.5, abs=1e-5)
  assert got["rollout_logp_diff_mean"] == pytest.approx(0.5 / 17, abs=1e-5)
  assert "rollout_logp_diff_max" not in report(None)  # nothing to compare with


def test_a_nonfinite_update_is_not_applied_and_is_reported(tiny_cfg, tiny_params, batch):
  """NaN advantages make the loss NaN: the update hands back the old params and optimizer
  state, and reports it, so the job can stop before a checkpoint (or skip the update)."""
  host = {k: np.asarray(v) for k, v in batch.items() if k != "weight"}
  host["advantages"] = np.where(np.arange(4) == 1, np.nan, host["advantages"]).astype(np.float32)
  mini = {k: jnp.asarray(v[0]) for k, v in split_minibatches(host, 1, 4, Grpo().loss_weights).items()}
  tx = optax.adam(1e-3)
  update = make_policy_update(tiny_cfg, Grpo().loss_fn, tx, None, None)
  params = jax.tree.map(jnp.copy, tiny_params)
  opt_state = tx.init(params)
  new_params, new_opt, metrics = update(params, opt_state, mini)
  assert float(metrics["nonfinite"]) == 1.0 and np.isnan(float(metrics["loss"]))
  jax.tree.map(np.testing.assert_array_equal, new_params, tiny_params)
  jax.tree.map(np.testing.assert_array_equal, new_opt, tx.init(tiny_params))
  message = nonfinite_update_message(5, {k: float(v) for k, v in metrics.items()}, 4)
  assert message.startswith("step 5: the policy update was not finite (loss nan, grad_norm nan, "
                            "the updated parameters); it was not applied")
  assert "checkpoint of step 4 is intact" in message and "rl.on_nonfinite=skip" in message
  # A finite batch still updates.
  host["advantages"] = np.nan_to_num(host["advantages"])
  mini = {k: jnp.asarray(v[0]) for k, v in split_minibatches(host, 1, 4, Grpo().loss_weights).items()}
  moved, _, metrics = update(jax.tree.map(jnp.copy, tiny_params), tx.init(tiny_params), mini)
  assert float(metrics["nonfinite"]) == 0.0
  assert not np.allclose(moved["lm_head"]["kernel"], tiny_params["lm_head"]["kernel"])


def test_padding_takes_no_optimizer_step_and_does_not_dilute_the_metrics(tiny_cfg, tiny_params):
  """Two responses in 2 mini-batches of 2 rows: the second mini-batch is padding alone. With
  AdamW it must not step (zero gradients would still move the weights), so the result equals
  one mini-batch of the two; within a mini-batch a padding micro-batch does not halve the
  token means (ratio 1 at the first update)."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.policy_update import PolicyUpdater
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  prompts, completions = [[1, 2], [3]], [[5, 6, 7], [8, 9]]
  advantages = np.array([1.0, -1.0], np.float32)

  def update(mini_batches, micro_rows, min_rows=0):
    updater = PolicyUpdater(tiny_cfg, Grpo(), optax.adamw(1e-2, weight_decay=0.1),
                            jax.tree.map(jnp.copy, tiny_params), mesh, DEFAULT_RULES,
                            ppo_epochs=1, mini_batches=mini_batches, micro_batch_rows=micro_rows)
    params, metrics, _ = updater(jax.tree.map(jnp.copy, tiny_params), prompts, completions,
                                 {"advantages": advantages}, 0, max_width=16,
                                 min_rows=min_rows)
    return jax.device_get(params), metrics

  padded, _ = update(mini_batches=2, micro_rows=2)
  alone, _ = update(mini_batches=1, micro_rows=2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), padded, alone)
  _, metrics = update(mini_batches=1, micro_rows=2, min_rows=4)  # a padding micro-batch
  assert metrics["ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("temperature,top_p", [(0.6, 1.0), (0.6, 0.8), (1.0, 1.0), (1.0, 0.8)])
def test_trainer_scores_tokens_under_the_distribution_the_engine_sampled(
    tiny_cfg, tiny_params, temperature, top_p):
  """The engine samples a rollout; the trainer's log-probs of those tokens equal log q, q being
  the sampler's distribution (temperature, top-p), and that q re-derives every sampled token
  from the engine's own noise (so it is the distribution the tokens came from)."""
  from tlt_jax.mesh import make_mesh
  from tlt_jax.models import forward
  from tlt_jax.models.attention_inputs import rows_inputs
  from tlt_jax.rl.policy_update import make_log_probs
  from tlt_jax.rollout.engine import RolloutEngine
  from tlt_jax.speculative.sampling import SamplingParams, gumbel_max, target_probs, token_noise

  sp = SamplingParams(temperature=temperature, top_p=top_p)
  prompts, samples, key = [[1, 2, 3], [4, 5, 6, 7], [9, 8]], 4, jax.random.key(3)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  engine = RolloutEngine(tiny_cfg, tiny_params, mesh,
                         engine_config(max_batch=16, max_prompt_len=8, max_new_tokens=10))
  res = engine.generate(prompts, samples, sp, key)
  rows_prompts = [prompts[i // samples] for i in range(len(res.tokens))]
  rows = build_rows(rows_prompts, res.tokens,
                    {"advantages": np.zeros(len(res.tokens), np.float32)}, len(res.tokens),
                    pad_id=0)
  mb = {k: jnp.asarray(rows[k])[None] for k in ("tokens", "targets", "loss_mask")}
  trainer = np.asarray(make_log_probs(tiny_cfg, LossConfig(sampling=sp).sampling)(
      tiny_params, mb)[0])

  logits = forward(tiny_params, jnp.asarray(rows["tokens"]),
                   rows_inputs(*rows["tokens"].shape), tiny_cfg)[0]
  q = np.asarray(target_probs(logits, sp))
  untempered = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
  worst, worst_untempered, tokens = 0.0, 0.0, 0
  for i, (p, toks) in enumerate(zip(rows_prompts, res.tokens)):
    pos = np.arange(len(p) - 1, len(p) - 1 + len(toks))  # the positions that predict toks
    noise = np.asarray(token_noise(key, jnp.full((1,), i, jnp.int32),
                                   jnp.arange(len(toks))[None], q.shape[-1]))[0]
    redrawn = np.asarray(gumbel_max(jnp.asarray(q[i, pos]), jnp.asarray(noise)))
    np.testing.assert_array_equal(redrawn, toks)
    sampler = np.log(q[i, pos, toks])
    worst = max(worst, float(np.abs(trainer[i, pos] - sampler).max()))
    worst_untempered = max(worst_untempered,
                           float(np.abs(untempered[i, pos, toks] - sampler).max()))
    tokens += len(toks)
  assert tokens > 40
  assert worst < 1e-4
  if temperature != 1.0 or top_p < 1.0:  # the untempered softmax is not the sampler's q
    assert worst_untempered > 0.05


def test_trainer_log_probs_stay_finite_when_the_token_leaves_the_top_p_support(tiny_cfg,
                                                                                tiny_params,
                                                                                batch):
  """After an update the nucleus may exclude a sampled token; it keeps a finite log-prob."""
  from tlt_jax.speculative.sampling import SamplingParams
  sp = SamplingParams(temperature=0.6, top_p=0.05)  # a nucleus of about one token
  logp, entropy = jax.jit(lambda p: token_log_probs(
      p, batch["tokens"], batch["targets"], batch["loss_mask"], tiny_cfg, sp,
      with_entropy=True))(tiny_params)
  assert np.isfinite(np.asarray(logp)).all() and np.isfinite(np.asarray(entropy)).all()
  grads = jax.jit(jax.grad(lambda p: token_log_probs(  # jitted, as the update computes it
      p, batch["tokens"], batch["targets"], batch["loss_mask"], tiny_cfg, sp)[0].sum()))(
          tiny_params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.9)])
def test_the_entropy_bonus_has_a_finite_gradient_under_top_k_and_top_p(tiny_cfg, tiny_params,
                                                                        batch, top_k, top_p):
  """Off the truncated support log q is -inf; the entropy term must not send 0 * -inf back."""
  from tlt_jax.speculative.sampling import SamplingParams
  gc = LossConfig(sampling=SamplingParams(0.7, top_k=top_k, top_p=top_p), entropy_coef=0.01)
  (_, metrics), grads = jax.jit(jax.value_and_grad(  # jitted, as the update computes it
      lambda p, b: Grpo(gc).loss_fn(p, b, tiny_cfg), has_aux=True))(tiny_params, batch)
  assert float(metrics["entropy"]) > 0
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_grpo_refuses_greedy_sampling():
  from tlt_jax.speculative.sampling import SamplingParams
  with pytest.raises(ValueError, match="rollout.temperature=0"):
    LossConfig(sampling=SamplingParams(temperature=0.0))


def test_a_micro_batch_computes_at_the_narrowest_width_that_holds_it():
  from tlt_jax.rl.policy_update import at_narrowest_width
  mask = np.zeros((2, 16), bool)
  mask[0, 2:5] = True  # targets up to column 4: needs 6 columns (the target's column + 1)
  run = at_narrowest_width(lambda mb: jnp.full(mb["loss_mask"].shape, mb["loss_mask"].shape[1],
                                               jnp.float32), (4, 8), pads_output=True)
  out = np.asarray(run({"loss_mask": jnp.asarray(mask), "advantages": jnp.zeros(2)}))
  assert out.shape == (2, 16) and (out[:, :8] == 8).all() and (out[:, 8:] == 0).all()
  mask[1, 10] = True  # past every width: the whole row
  out = np.asarray(run({"loss_mask": jnp.asarray(mask), "advantages": jnp.zeros(2)}))
  assert (out == 16).all()


@pytest.mark.parametrize("epochs", [1, 2])
def test_update_widths_give_the_update_of_the_step_at_its_full_width(tiny_cfg, tiny_params,
                                                                     epochs):
  """rl.update_widths: the step padded to one width (its capacity), its rows sorted longest
  first and each micro-batch computed at the narrowest width that holds it: the same
  parameters and metrics as the plain update (to float32 rounding: the micro-batches sum in
  another order), in one program compiled ahead, which the call then uses."""
  from tlt_jax.mesh import DEFAULT_RULES, make_mesh
  from tlt_jax.rl.policy_update import PolicyUpdater
  from tlt_jax.rollout.pool import wait_for_compiles_ahead
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
  rng = np.random.default_rng(3)
  prompts = [rng.integers(1, 60, 3).tolist() for _ in range(6)]
  completions = [rng.integers(1, 60, n).tolist() for n in (2, 40, 5, 3, 9, 1)]
  advantages = rng.standard_normal(6).astype(np.float32)

  def update(widths):
    updater = PolicyUpdater(tiny_cfg, Grpo(), optax.sgd(0.5), jax.tree.map(jnp.copy, tiny_params),
                            mesh, DEFAULT_RULES, ppo_epochs=epochs, mini_batches=1,
                            micro_batch_rows=2, widths=widths)
    if widths:
      updater.compile_ahead(tiny_params, 8, 128)
      wait_for_compiles_ahead()
    params, metrics, compile_s = updater(jax.tree.map(jnp.copy, tiny_params), prompts,
                                         completions, {"advantages": advantages}, 0,
                                         max_width=128, min_rows=8)
    return jax.device_get(params), metrics, updater.pool.report()

  plain, plain_metrics, _ = update(())
  bucketed, metrics, report = update((16, 32))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), bucketed,
               plain)
  for k in ("loss", "grad_norm", "clip_frac"):
    assert metrics[k] == pytest.approx(plain_metrics[k], rel=1e-4, abs=1e-6), k
  assert report["compiles"] == 0  # the call ran what was compiled ahead
  assert report["ahead_compiles"] == (2 if epochs > 1 else 1)  # log-probs too with 2 epochs
