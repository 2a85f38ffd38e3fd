"""Training memory knobs (per-layer remat, query-chunked attention): the same losses and
gradients as the plain path, and less memory at a training shape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.drafter_training.test_loss import _samples
from tests.rl.test_grpo import grpo_rows
from tests.speculative.drafters import random_drafter
from tlt_jax.drafters.eagle.loss import drafter_loss
from tlt_jax.drafter_training.windows import pack_windows
from tlt_jax.kernels import prefix_tree_attention
from tlt_jax.models import ModelConfig, init_params
from tlt_jax.rl.algorithms import Grpo
from tlt_jax.rl.loss import LossConfig
from tlt_jax.speculative.sampling import SamplingParams

KNOBS = [dict(remat="full"), dict(remat="dots"), dict(attention_query_chunk=4),
         dict(remat="full", attention_query_chunk=5, scan_layers=True)]


def _close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module")
def grpo_batch():
  rows = grpo_rows(completion_lengths=(9, 2, 13, 6), seed=1)
  rows["tokens"], rows["targets"], rows["loss_mask"] = (
      rows[k][:, :19] for k in ("tokens", "targets", "loss_mask"))  # T = 19: ragged chunks
  return {k: jnp.asarray(v) for k, v in rows.items()}


@pytest.mark.parametrize("knobs", KNOBS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_grpo_loss_and_gradients_unchanged(tiny_cfg, tiny_params, grpo_batch, knobs):
  gc = LossConfig(kl_coef=0.1, entropy_coef=0.01, sampling=SamplingParams(0.7, top_p=0.9))
  batch = dict(grpo_batch, ref_logp=jnp.zeros_like(grpo_batch["tokens"], jnp.float32) - 3.0)
  grad = jax.jit(jax.value_and_grad(Grpo(gc).loss_fn, has_aux=True), static_argnums=(2,))
  (want, _), want_g = grad(tiny_params, batch, tiny_cfg)
  (got, _), got_g = grad(tiny_params, batch, tiny_cfg.replace(**knobs))
  _close(got, want)
  _close(got_g, want_g)


def test_drafter_loss_and_gradients_unchanged(tiny_cfg, tiny_params):
  """Packed windows with segments and the unrolled training-time test (3 steps ahead)."""
  dcfg, dparams = random_drafter(tiny_cfg, seed=2)
  batch = jax.tree.map(jnp.asarray, pack_windows(
      _samples(tiny_cfg, tiny_params, [12, 9, 15, 7], seed=3), window=16))
  grad = jax.jit(jax.value_and_grad(drafter_loss, has_aux=True), static_argnums=(3, 4, 6))
  (want, _), want_g = grad(dparams, tiny_params, batch, tiny_cfg, dcfg, 0.1, 3)
  cfg = tiny_cfg.replace(remat="full", attention_query_chunk=4)
  (got, _), got_g = grad(dparams, tiny_params, batch, cfg, dcfg, 0.1, 3)
  _close(got, want)
  _close(got_g, want_g)


def test_chunked_attention_with_a_prefix_matches_the_whole_block():
  rng = np.random.default_rng(0)
  b, t, h, kvh, d, s = 2, 11, 4, 2, 8, 6
  q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  kc, vc = (jnp.asarray(rng.normal(size=(b, kvh, s, d)), jnp.float32) for _ in range(2))
  kn, vn = (jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.float32) for _ in range(2))
  mask = jnp.asarray(rng.random((b, t, t)) < 0.6)
  lengths = jnp.asarray([4, 0], jnp.int32)
  args = (q, kc, vc, lengths, kn, vn, mask)
  want = prefix_tree_attention(*args, impl="reference")
  for chunk in (1, 3, 4, 11, 16):
    got = prefix_tree_attention(*args, impl="reference", query_chunk=chunk)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_remat_and_chunking_cut_the_memory_of_a_training_step():
  """XLA's own memory analysis of a GRPO gradient at a long-row shape: remat plus chunked
  attention needs a fraction of the temporaries of the plain path."""
  cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=16, attention_impl="reference")
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  rows, width = 4, 1024
  batch = {"tokens": jax.ShapeDtypeStruct((rows, width), jnp.int32),
           "targets": jax.ShapeDtypeStruct((rows, width), jnp.int32),
           "loss_mask": jax.ShapeDtypeStruct((rows, width), jnp.bool_),
           "advantages": jax.ShapeDtypeStruct((rows,), jnp.float32),
           "weight": jax.ShapeDtypeStruct((rows,), jnp.float32)}

  def temp_bytes(c):
    fn = jax.jit(jax.grad(lambda p, x: Grpo().loss_fn(p, x, c)[0]))
    return fn.lower(params, batch).compile().memory_analysis().temp_size_in_bytes
  plain = temp_bytes(cfg)
  lean = temp_bytes(cfg.replace(remat="full", attention_query_chunk=128))
  assert lean < plain / 4, (lean, plain)


def test_bad_knobs_are_named(tiny_cfg):
  with pytest.raises(ValueError, match="model.remat='layer'"):
    tiny_cfg.replace(remat="layer")
  with pytest.raises(ValueError, match="attention_query_chunk"):
    tiny_cfg.replace(attention_query_chunk=-1)
