"""Drafter loss on packed windows: segments never mix, and training lowers the loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import oracle_drafter, random_drafter
from tlt_jax.drafters.base import previous_features
from tlt_jax.drafters.eagle.loss import drafter_loss, unrolled_forward
from tlt_jax.drafter_training.train_step import (DrafterOptConfig, init_train_state,
                                                 jit_train_step)
from tlt_jax.drafter_training.windows import Sample, pack_windows
from tlt_jax.models import init_cache, prefill
from tlt_jax.models.attention_inputs import packed_inputs
from tlt_jax.models.decoder import lm_logits
from tlt_jax.drafters.eagle.network import (DRAFT_TO_POLICY, drafter_forward, policy_token_ids,
                                   with_draft_vocab)


def _samples(cfg, params, lengths, seed=0):
  """Sequences of random tokens with their true policy features."""
  rng = np.random.default_rng(seed)
  # Jitted: op by op, each operation would compile on its own for every length.
  features = jax.jit(lambda params, toks: prefill(
      params, toks, jnp.full((1,), toks.shape[1], jnp.int32),
      init_cache(cfg, 1, toks.shape[1]), cfg)[1])
  out = []
  for n in lengths:
    toks = rng.integers(0, cfg.vocab_size, n).astype(np.int32)
    feats = features(params, jnp.asarray(toks[None]))
    out.append(Sample(tokens=toks, features=np.asarray(feats[0]), train_from=1))
  return out


def test_packing_layout(tiny_cfg, tiny_params):
  samples = _samples(tiny_cfg, tiny_params, [5, 3, 9, 2])
  w = pack_windows(samples, window=8)
  seg, pos = np.asarray(w.segment_ids), np.asarray(w.positions)
  assert w.tokens.shape[1] == 8
  # The 9-token sample is cut into 8 + 1; all 19 tokens are placed exactly once.
  assert (seg > 0).sum() == 19
  for r in range(seg.shape[0]):
    for s in set(seg[r][seg[r] > 0].tolist()):
      np.testing.assert_array_equal(pos[r][seg[r] == s], np.arange((seg[r] == s).sum()))
  prev = np.asarray(previous_features(jnp.asarray(w.features), jnp.asarray(w.segment_ids)))
  starts = pos == 0
  assert not prev[starts].any()  # no feature leaks across a segment start


def test_packed_predictions_equal_separate_ones(tiny_cfg, tiny_params):
  dcfg, dparams = random_drafter(tiny_cfg, seed=1)
  samples = _samples(tiny_cfg, tiny_params, [6, 4, 5], seed=1)
  packed = pack_windows(samples, window=16)
  assert packed.tokens.shape[0] == 1  # all three share one row

  def predict(w):
    pred, _, _, _ = drafter_forward(
        dparams, tiny_params, jnp.asarray(w.tokens),
        previous_features(jnp.asarray(w.features), jnp.asarray(w.segment_ids)),
        packed_inputs(jnp.asarray(w.segment_ids), jnp.asarray(w.positions)), tiny_cfg, dcfg)
    return np.asarray(pred)

  together = predict(packed)
  seg = np.asarray(packed.segment_ids[0])
  for s in range(1, 4):
    toks = packed.tokens[0][seg == s]
    alone = pack_windows([next(x for x in samples if len(x.tokens) == len(toks)
                               and (x.tokens == toks).all())], window=16)
    np.testing.assert_allclose(together[0][seg == s],
                               predict(alone)[0][:len(toks)], atol=1e-5)


def test_training_lowers_loss_on_a_fixed_buffer(tiny_cfg, tiny_params):
  dcfg, dparams = random_drafter(tiny_cfg, seed=2)
  batch = jax.tree.map(jnp.asarray, pack_windows(
      _samples(tiny_cfg, tiny_params, [12, 9, 15, 7, 10], seed=2), window=16))
  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=5)
  step = jit_train_step(tiny_cfg, {"eagle": dcfg}, oc)
  state = init_train_state({"eagle": dparams}, oc)
  first, first_aux = drafter_loss(dparams, tiny_params, batch, tiny_cfg, dcfg)
  for _ in range(60):
    state, metrics = step(state, tiny_params, batch)
  last, aux = drafter_loss(state.params["eagle"], tiny_params, batch, tiny_cfg, dcfg)
  assert int(state.step) == 60
  assert float(last) < 0.7 * float(first)
  assert float(aux["top1"]) > float(first_aux["top1"]) + 0.2
  # The policy was only read.
  assert set(state.params["eagle"]) == set(dparams)


def test_a_non_finite_batch_leaves_the_drafter_and_its_optimizer_as_they_were(tiny_cfg,
                                                                             tiny_params):
  dcfg, dparams = random_drafter(tiny_cfg, seed=2)
  batch = jax.tree.map(jnp.asarray, pack_windows(
      _samples(tiny_cfg, tiny_params, [12, 9], seed=2), window=16))
  poisoned = dataclasses.replace(batch, features=batch.features.at[0, 3, 0].set(jnp.nan))
  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=0)
  step = jit_train_step(tiny_cfg, {"eagle": dcfg}, oc)
  state, metrics = step(init_train_state({"eagle": dparams}, oc), tiny_params, batch)
  assert float(metrics["nonfinite"]) == 0.0
  before = jax.tree.map(np.asarray, (state.params["eagle"], state.opt_state))
  state, metrics = step(state, tiny_params, poisoned)
  assert float(metrics["nonfinite"]) == 1.0 and not np.isfinite(float(metrics["loss"]))
  after = jax.tree.map(np.asarray, (state.params["eagle"], state.opt_state))
  jax.tree.map(np.testing.assert_array_equal, after, before)
  state, metrics = step(state, tiny_params, batch)  # and it trains on
  assert float(metrics["nonfinite"]) == 0.0 and int(state.step) == 3
  assert np.all(np.isfinite(np.asarray(state.params["eagle"]["fc"]["kernel"])))
  assert not np.array_equal(np.asarray(state.params["eagle"]["fc"]["kernel"]),
                            before[0]["fc"]["kernel"])


def test_reduced_vocab_loss_restricts_the_target_and_trains_only_weights(tiny_cfg, tiny_params):
  """A draft vocabulary of every id with the policy's head is the full-vocabulary loss; one
  without the policy's argmax at some trained slots leaves those slots out; training moves
  the head and the layers, never the vocabulary map."""
  v = tiny_cfg.vocab_size
  batch = jax.tree.map(jnp.asarray, pack_windows(
      _samples(tiny_cfg, tiny_params, [12, 9, 15, 7, 10], seed=2), window=16))
  dcfg, dparams = random_drafter(tiny_cfg, seed=2)

  def reduced(d2t):
    return (dataclasses.replace(dcfg, draft_vocab_size=len(d2t)),
            with_draft_vocab(dparams, tiny_params, d2t, tiny_cfg))

  full, full_aux = drafter_loss(dparams, tiny_params, batch, tiny_cfg, dcfg, train_depth=2)
  rcfg, rparams = reduced(np.arange(v))
  same, same_aux = drafter_loss(rparams, tiny_params, batch, tiny_cfg, rcfg, train_depth=2)
  np.testing.assert_allclose(float(same), float(full), rtol=1e-5)
  assert float(same_aux["top1"]) == float(full_aux["top1"])

  top = np.asarray(jnp.argmax(lm_logits(tiny_params, batch.features, tiny_cfg), -1))
  mask = np.asarray(batch.loss_mask)
  common = np.bincount(top[mask], minlength=v).argmax()
  rcfg, rparams = reduced(np.delete(np.arange(v), common))
  _, aux = drafter_loss(rparams, tiny_params, batch, tiny_cfg, rcfg)
  assert int(aux["tokens"]) == mask.sum() - (mask & (top == common)).sum() < mask.sum()
  # top1 still counts those slots, as misses (no draft can be accepted there): the policy's
  # own copy as the drafter agrees everywhere else.
  ocfg, oparams = oracle_drafter(tiny_cfg, tiny_params)
  ocfg = dataclasses.replace(ocfg, draft_vocab_size=v - 1)
  oparams = with_draft_vocab(oparams, tiny_params, np.delete(np.arange(v), common), tiny_cfg)
  _, oracle_aux = drafter_loss(oparams, tiny_params, batch, tiny_cfg, ocfg)
  (_, logits), = unrolled_forward(oparams, tiny_params, batch, tiny_cfg, ocfg, 1)
  drafted = np.asarray(policy_token_ids(oparams, jnp.argmax(logits, -1)))
  agreement = (drafted == top)[mask].mean()
  np.testing.assert_allclose(float(oracle_aux["top1"]), agreement, rtol=1e-6)
  assert agreement < 1.0

  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=5)
  first, _ = drafter_loss(rparams, tiny_params, batch, tiny_cfg, rcfg)
  rparams = jax.device_get(rparams)  # a host copy: the updates donate the train state
  state = init_train_state({"eagle": jax.tree.map(jnp.asarray, rparams)}, oc)
  step = jit_train_step(tiny_cfg, {"eagle": rcfg}, oc)
  for _ in range(30):
    state, _ = step(state, tiny_params, batch)
  last, _ = drafter_loss(state.params["eagle"], tiny_params, batch, tiny_cfg, rcfg)
  assert float(last) < 0.8 * float(first)
  trained = state.params["eagle"]
  np.testing.assert_array_equal(trained[DRAFT_TO_POLICY], rparams[DRAFT_TO_POLICY])
  assert trained[DRAFT_TO_POLICY].dtype == jnp.int32
  assert not np.allclose(trained["lm_head"]["kernel"], rparams["lm_head"]["kernel"])


def test_pack_errors():
  with pytest.raises(ValueError, match="no samples"):
    pack_windows([], 8)
  with pytest.raises(ValueError, match="do not match 3 tokens"):
    pack_windows([Sample(np.zeros(3, np.int32), np.zeros((2, 4), np.float32))], 8)
