"""Shape-invariant numerics (model.numerics="invariant", tlt_jax/kernels/numerics.py): in
bfloat16, a token's logits are the same bits in a decode step of any batch, a tree verify of
any width, a prefill and the training forward, so speculative decoding emits exactly plain
decoding's tokens, greedy and sampled, with every drafter family."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import example_drafters, family_strategy
from tlt_jax.drafters import DRAFTERS, candidate_count
from tlt_jax.models import Policy, decoder, init_cache
from tlt_jax.models.attention_inputs import ancestor_mask, rows_inputs, tree_depths
from tlt_jax.kernels.numerics import invariant_matmul, tiled_matmul, tree_sum
from tlt_jax.speculative.decoding import plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams

SEQ = 72  # tokens per test sequence: verifies reach past the first 64-position block


def test_tree_sum_ignores_appended_zeros_and_sums():
  x = jax.random.normal(jax.random.key(0), (3, 37), jnp.float32) * 1e3
  want = np.asarray(tree_sum(x))
  for width in (38, 64, 65, 200):
    padded = jnp.pad(x, ((0, 0), (0, width - 37)))
    np.testing.assert_array_equal(np.asarray(tree_sum(padded)), want)
  np.testing.assert_allclose(want, np.asarray(x).sum(-1), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(tree_sum(x.T, axis=0)), want)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("tile", [8, 64])
def test_a_rows_product_does_not_depend_on_the_other_rows(dtype, tile):
  """Every row's product is the same bits whatever the rows beside it and its place among
  them (one XLA:CPU dot fails this: at 300 rows its last row differs)."""
  k1, k2 = jax.random.split(jax.random.key(1))
  x = jax.random.normal(k1, (300, 96), jnp.float32).astype(dtype)
  w = jax.random.normal(k2, (96, 160), jnp.float32).astype(dtype)
  fn = jax.jit(lambda x, w: tiled_matmul(x, w, tile))
  alone = np.concatenate([np.asarray(fn(x[i:i + 1], w)) for i in range(0, 300, 7)])
  for rows in (2, 9, 65, 300):
    got = np.asarray(fn(x[:rows], w))[::7]
    np.testing.assert_array_equal(got, alone[:len(got)], err_msg=f"{rows} rows")
  shifted = np.asarray(fn(jnp.concatenate([x[:3], x]), w))[3:]
  np.testing.assert_array_equal(shifted[::7], alone, err_msg="rows moved by 3")
  np.testing.assert_allclose(np.asarray(invariant_matmul(x, w, dtype)),
                             np.asarray(x.astype(jnp.float32) @ w.astype(jnp.float32)),
                             rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def bf16(tiny_cfg, tiny_params):
  """The tiny policy in bfloat16 with the invariant numerics, its head sharpened (near ties
  between tokens are then rarer than rounding differences, so a wrong order shows), and
  SEQ-token sequences of 8 rows."""
  cfg = tiny_cfg.replace(dtype="bfloat16", param_dtype="bfloat16", numerics="invariant")
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_params)
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8
  seqs = np.random.default_rng(0).integers(0, cfg.vocab_size, (8, SEQ)).astype(np.int32)
  return cfg, params, seqs


def _train_logits(cfg, params, seqs, scan=False):
  b, t = seqs.shape
  logits, *_ = jax.jit(lambda p, s: decoder.forward(
      p, s, rows_inputs(b, t), cfg.replace(scan_layers=scan)))(params, jnp.asarray(seqs))
  return np.asarray(logits)


def _prefill_then_decode(cfg, params, seqs, prefix, capacity):
  """Logits of every position from `prefix` tokens prefilled, then one decode step at a
  time: [B, SEQ, V] (the prefill's positions first)."""
  b = seqs.shape[0]
  cache = init_cache(cfg, b, capacity)
  logits, _, cache = jax.jit(lambda p, s, c: decoder.prefill(
      p, s, jnp.full((b,), prefix, jnp.int32), c, cfg))(params, jnp.asarray(seqs[:, :prefix]),
                                                         cache)
  out = [np.asarray(logits)]
  step = jax.jit(lambda p, t, c: decoder.decode(p, t, c, cfg))
  for i in range(prefix, seqs.shape[1]):
    logits, _, cache = step(params, jnp.asarray(seqs[:, i]), cache)
    out.append(np.asarray(logits)[:, None])
  return np.concatenate(out, 1)


def check_logits_in_every_program_shape(cfg, params, seqs, rows=(1, 3),
                                        decode=((1, SEQ), (4, SEQ), (8, 130)), prefix=20,
                                        trees=(1, 8, 16, 48), scan=True):
  """The training forward (loop and scan; all rows, `rows` rows, a shorter row), prefill +
  decode at (rows, cache capacity) in `decode`, and tree verifies after `prefix` tokens of
  `trees` nodes (chains) and a branching tree give every token the same logits, bit for bit.
  seqs: [B, L] int32, L >= prefix + max(trees)."""
  b = seqs.shape[0]
  want = _train_logits(cfg, params, seqs)
  if scan:
    np.testing.assert_array_equal(_train_logits(cfg, params, seqs, scan=True), want,
                                  err_msg="training forward: scan against loop")
  for r in rows:
    np.testing.assert_array_equal(_train_logits(cfg, params, seqs[:r]), want[:r],
                                  err_msg=f"training forward of {r} rows")
  np.testing.assert_array_equal(_train_logits(cfg, params, seqs[:, :40]), want[:, :40],
                                err_msg="training forward of shorter rows")
  for r, capacity in decode:
    np.testing.assert_array_equal(
        _prefill_then_decode(cfg, params, seqs[:r], 10, capacity), want[:r],
        err_msg=f"decode, {r} rows, capacity {capacity}")
  cache = init_cache(cfg, b, prefix + max(trees) + 8)
  _, _, cache = jax.jit(lambda p, s, c: decoder.prefill(
      p, s, jnp.full((b,), prefix, jnp.int32), c, cfg))(params, jnp.asarray(seqs[:, :prefix]),
                                                         cache)
  verify = jax.jit(lambda p, t, d, m, c: decoder.verify(p, t, d, m, c, cfg))
  for nodes in trees:
    parents = np.tile(np.arange(-1, nodes - 1), (b, 1)).astype(np.int32)  # a chain
    mask = ancestor_mask(jnp.asarray(parents))
    logits, _, _ = verify(params, jnp.asarray(seqs[:, prefix:prefix + nodes]),
                          tree_depths(mask), mask, cache)
    np.testing.assert_array_equal(np.asarray(logits), want[:, prefix:prefix + nodes],
                                  err_msg=f"verify of {nodes} nodes")
  # A branching tree: the true path 0 -> 2 -> 4 beside decoy siblings 1 and 3.
  tokens = seqs[:, prefix:prefix + 3]
  decoy = (tokens + 1) % cfg.vocab_size
  tree = np.stack([tokens[:, 0], decoy[:, 1], tokens[:, 1], decoy[:, 2], tokens[:, 2]], 1)
  mask = ancestor_mask(jnp.asarray(np.tile([-1, 0, 0, 2, 2], (b, 1)).astype(np.int32)))
  logits, _, _ = verify(params, jnp.asarray(tree), tree_depths(mask), mask, cache)
  np.testing.assert_array_equal(np.asarray(logits)[:, [0, 2, 4]], want[:, prefix:prefix + 3],
                                err_msg="verify of a branching tree")


def test_logits_are_the_same_bits_in_every_program_shape(bf16):
  """The tiny policy: see `check_logits_in_every_program_shape`."""
  check_logits_in_every_program_shape(*bf16)


@pytest.mark.slow
def test_smollm2s_logits_are_the_same_bits_in_every_program_shape(optimised_compiles):
  """SmolLM2-135M-Instruct in bfloat16: decode at 1 and 2 rows, verifies of 1, 8, 16 and 48
  nodes, prefill and the training forward, over 2 rows of 72 tokens."""
  from tlt_jax.import_model import DownloadError, smollm2_folder
  from tlt_jax.models.hf import load_hf_config, load_hf_params
  try:
    folder = smollm2_folder()
  except DownloadError as e:
    pytest.skip(f"SmolLM2 is not cached and cannot be downloaded: {e}")
  cfg = load_hf_config(folder, dtype="bfloat16", param_dtype="bfloat16", numerics="invariant",
                       attention_impl="reference")
  params = load_hf_params(folder, cfg)
  seqs = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, SEQ)).astype(np.int32)
  check_logits_in_every_program_shape(cfg, params, seqs, rows=(1,),
                                      decode=((1, SEQ), (2, 130)), scan=False)


def _generate(cfg, params, sp, strategy=None, drafters=None, corpus=None, rows=3, new=100):
  """`new` tokens for `rows` prompts, plainly or with SD; returns the [rows, new] tokens."""
  prompts = np.random.default_rng(1).integers(1, cfg.vocab_size, (rows, 6)).astype(np.int32)
  cap = 6 + new + (strategy.depth + 1 if strategy else 1)
  policy = Policy(params, cfg)
  drafters = drafters or {}
  states = {name: d.init_state(cfg, rows, cap) for name, d in drafters.items()}
  state = jax.jit(functools.partial(start, sp=sp, max_new_tokens=new, eos_id=-1))(
      policy, jnp.asarray(prompts), jnp.full((rows,), 6, jnp.int32), init_cache(cfg, rows, cap),
      jax.random.key(0), drafters=drafters,
      draft_states={k: v for k, v in states.items() if v is not None})
  if strategy is None:
    step = jax.jit(functools.partial(plain_step, sp=sp, eos_id=-1))
    while not bool(state.done.all()):
      state, _ = step(policy, state, jax.random.key(1), drafters=drafters)
  else:
    step = jax.jit(functools.partial(sd_step, sp=sp, eos_id=-1, strategy=strategy))
    while not bool(state.done.all()):
      state, _ = step(policy, drafters, state, jax.random.key(1), corpus=corpus)
  return np.asarray(state.out)


@pytest.fixture(scope="module")
def plain_tokens(bf16):
  cfg, params, _ = bf16
  return {t: _generate(cfg, params, SamplingParams(t)) for t in (0.0, 1.0)}


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("drafts", [*sorted(DRAFTERS), "+".join(sorted(DRAFTERS))])
def test_sd_emits_plain_decodings_tokens_in_bfloat16(bf16, plain_tokens, drafts, temperature):
  """Every registered family, and a hybrid tree of all of them, over 3 x 100 tokens (a chain
  for the families that draft one candidate per depth)."""
  cfg, params, _ = bf16
  plain = plain_tokens[temperature]
  drafters = example_drafters(cfg, seed=3)
  corpus = jnp.asarray(plain[[[1, 2], [0, 2], [0, 1]]], jnp.int32)  # each row's siblings
  chain = "+" not in drafts and candidate_count(drafts, 3, 2) < 5
  strategy = family_strategy(drafts, *((4, 1, 5) if chain else (3, 2, 6)))
  got = _generate(cfg, params, SamplingParams(temperature), strategy, drafters, corpus)
  np.testing.assert_array_equal(got, plain)


def test_the_trainers_log_probs_are_the_rollouts_bit_for_bit(bf16, plain_tokens):
  """The log-probs plain decoding recorded for its sampled tokens equal those the trainer's
  forward computes for the same rows (tlt_jax.rl.loss.token_log_probs): importance ratio 1."""
  from tlt_jax.rl.loss import token_log_probs
  cfg, params, _ = bf16
  sp = SamplingParams(1.0)
  prompts = np.random.default_rng(1).integers(1, cfg.vocab_size, (3, 6)).astype(np.int32)
  policy = Policy(params, cfg)
  cap = 6 + 100 + 1
  state = jax.jit(functools.partial(start, sp=sp, max_new_tokens=100, eos_id=-1))(
      policy, jnp.asarray(prompts), jnp.full((3,), 6, jnp.int32), init_cache(cfg, 3, cap),
      jax.random.key(0))
  step = jax.jit(functools.partial(plain_step, sp=sp, eos_id=-1))
  while not bool(state.done.all()):
    state, _ = step(policy, state, jax.random.key(1))
  out = np.asarray(state.out)
  np.testing.assert_array_equal(out, plain_tokens[1.0])
  rows = np.concatenate([prompts, out], 1)
  tokens, targets = rows[:, :-1], rows[:, 1:]
  mask = np.arange(tokens.shape[1])[None] >= 5  # the targets that are response tokens
  logp, _ = jax.jit(lambda p: token_log_probs(p, jnp.asarray(tokens), jnp.asarray(targets),
                                              jnp.asarray(mask), cfg, sp))(params)
  np.testing.assert_array_equal(np.asarray(logp)[:, 5:], np.asarray(state.out_logp))
  ratio = np.exp(np.asarray(logp)[:, 5:] - np.asarray(state.out_logp))
  assert (ratio == 1.0).all()


@pytest.mark.slow
def test_an_rl_run_in_bfloat16_reports_no_log_prob_mismatch(tmp_path):
  """The main job on the smoke config in bfloat16 with the invariant numerics: every update's
  log-probs of the rollout's tokens are the rollout's own (rollout_logp_diff_max exactly 0)."""
  from tests.test_train import _metrics, _train
  _train(tmp_path / "run", "--config.rl.steps=2", "--config.model.dtype=bfloat16",
         "--config.model.param_dtype=bfloat16", "--config.model.numerics=invariant")
  rows = _metrics(tmp_path / "run")
  assert [r["step"] for r in rows] == [1, 2]
  assert all(r["rollout_logp_diff_max"] == 0.0 and r["rollout_logp_diff_mean"] == 0.0
             for r in rows)
