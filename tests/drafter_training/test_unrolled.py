"""Training-time test: the unrolled loss computes exactly what drafting computes, and trains."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.drafter_training.test_loss import _samples
from tests.speculative.drafters import random_drafter
from tlt_jax.drafters.eagle.loss import drafter_loss, unrolled_forward
from tlt_jax.drafter_training.train_step import (DrafterOptConfig, init_train_state,
                                                 jit_train_step)
from tlt_jax.drafter_training.windows import Sample, pack_windows
from tlt_jax.models.attention_inputs import (decode_inputs, expansion_inputs, packed_inputs,
                                             unrolled_inputs)
from tlt_jax.drafters.eagle.network import drafter_forward, init_drafter_cache
from tlt_jax.models.kv_cache import append_kv


def _chain(dparams, policy, tokens, feats, root, depth, cfg, dcfg):
  """Drafting as `EagleDrafter.propose` does it with one beam whose drafts are the true tokens:
  the true pairs before `root` in the drafter's cache, the root pair, then `depth` draft
  nodes, each fed the previous node's predicted feature. Returns [depth + 1, E] predictions."""
  n = tokens.shape[0]
  cache = init_drafter_cache(cfg, dcfg, 1, n)
  prev = jnp.concatenate([jnp.zeros_like(feats[:1]), feats[:-1]])
  _, _, k, v = drafter_forward(dparams, policy, tokens[None, :root], prev[None, :root],
                               packed_inputs(jnp.ones((1, root), jnp.int32),
                                             jnp.arange(root)[None]), cfg, dcfg)
  cache = append_kv(cache, k, v, jnp.array([root], jnp.int32))
  pred, _, k, v = drafter_forward(dparams, policy, tokens[None, root:root + 1],
                                  prev[None, root:root + 1], decode_inputs(cache.lengths),
                                  cfg, dcfg, cache=cache)
  cache = append_kv(cache, k, v, jnp.array([1], jnp.int32))
  preds, buf_k, buf_v = [pred[0, 0]], None, None
  for d in range(1, depth + 1):
    earlier = jnp.ones((1, 1, d - 1), bool)
    p, _, k, v = drafter_forward(
        dparams, policy, tokens[None, root + d:root + d + 1], pred,
        expansion_inputs(jnp.array([root + d]), earlier), cfg, dcfg, cache=cache,
        earlier_kv=None if buf_k is None else (buf_k, buf_v))
    buf_k = k if buf_k is None else jnp.concatenate([buf_k, k], axis=2)
    buf_v = v if buf_v is None else jnp.concatenate([buf_v, v], axis=2)
    pred = p
    preds.append(p[0, 0])
  return jnp.stack(preds)


@pytest.mark.parametrize("fused", [0, 1])
def test_unrolled_steps_are_what_drafting_computes(tiny_cfg, tiny_params, fused):
  dcfg, dparams = random_drafter(tiny_cfg, seed=3, feature_layers=(0,) * fused)
  rng = np.random.default_rng(3)
  width = (1 + fused) * tiny_cfg.hidden_size  # the policy's (fused) feature width
  samples = [Sample(tokens=rng.integers(0, tiny_cfg.vocab_size, n).astype(np.int32),
                    features=rng.normal(size=(n, width)).astype(np.float32), train_from=1)
             for n in (5, 11)]
  w = jax.tree.map(jnp.asarray, pack_windows(samples, window=16))
  seg = np.asarray(w.segment_ids[0])
  # Jitted, both: op by op, each operation of these shapes would compile on its own.
  steps = jax.jit(unrolled_forward, static_argnums=(3, 4, 5))(dparams, tiny_params, w,
                                                              tiny_cfg, dcfg, 3)
  chain = jax.jit(_chain, static_argnums=(4, 5, 6, 7))
  start = int(np.argmax(seg == np.bincount(seg).argmax()))  # the 11-token sample
  tokens, feats = jnp.asarray(samples[1].tokens), jnp.asarray(samples[1].features)
  for root in (1, 4, 7):
    want = chain(dparams, tiny_params, tokens, feats, root, 2, tiny_cfg, dcfg)
    for k in range(3):  # step k at slot root + k is the depth-k node of the chain
      np.testing.assert_allclose(np.asarray(steps[k][0][0, start + root + k]),
                                 np.asarray(want[k]), atol=2e-5, rtol=2e-5)


def test_step_zero_is_the_packed_pass_and_chains_stay_in_their_sample():
  seg = jnp.array([[1, 1, 1, 2, 2, 0]])
  pos = jnp.array([[0, 1, 2, 0, 1, 0]])
  np.testing.assert_array_equal(unrolled_inputs(seg, pos, 0).mask, packed_inputs(seg, pos).mask)
  m = np.asarray(unrolled_inputs(seg, pos, 1).mask[0])
  assert m.shape == (6, 12)
  # Slot 2 (depth 1, rooted at slot 1): step-0 keys 0..1, then itself.
  np.testing.assert_array_equal(np.nonzero(m[2])[0], [0, 1, 8])
  # Slot 3 starts sample 2: its root would be slot 2 of sample 1, so no step-0 key.
  np.testing.assert_array_equal(np.nonzero(m[3])[0], [9])
  assert not m[5].any()  # padding attends to nothing


def test_unrolled_training_lowers_the_later_steps_loss(tiny_cfg, tiny_params):
  dcfg, dparams = random_drafter(tiny_cfg, seed=2)
  batch = jax.tree.map(jnp.asarray, pack_windows(
      _samples(tiny_cfg, tiny_params, [12, 9, 15, 7, 10], seed=2), window=16))
  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=5, train_depth=3)
  loss = jax.jit(drafter_loss, static_argnums=(3, 4), static_argnames=("train_depth",))
  one = loss(dparams, tiny_params, batch, tiny_cfg, dcfg)[0]
  first, first_aux = loss(dparams, tiny_params, batch, tiny_cfg, dcfg, train_depth=1)
  assert float(one) == float(first)  # K = 1 is the single-step loss
  first, first_aux = loss(dparams, tiny_params, batch, tiny_cfg, dcfg, train_depth=3)
  # Fewer slots have a 3-step chain inside their sample than a 1-step one.
  assert 0 < float(first_aux["tokens"])
  step = jit_train_step(tiny_cfg, {"eagle": dcfg}, oc)
  state = init_train_state({"eagle": dparams}, oc)
  for _ in range(60):
    state, metrics = step(state, tiny_params, batch)
  last, aux = loss(state.params["eagle"], tiny_params, batch, tiny_cfg, dcfg, train_depth=3)
  assert np.isfinite(float(metrics["loss"]))
  assert float(last) < 0.8 * float(first)
  assert float(aux["top1_ahead"]) > float(first_aux["top1_ahead"]) + 0.2
