"""The decoder as functions: a loop and a scan over the stacked layers give the same results,
the weights' spec table matches the weights, and every entry point builds its attention
inputs from one module."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import append_kv, decode, init_cache, prefill, verify
from tlt_jax.models.attention_inputs import (ancestor_mask, decode_inputs, expansion_inputs,
                                             packed_inputs, prefill_inputs, tree_depths)
from tlt_jax.models.decoder import forward, param_logical_axes, param_specs
from tlt_jax.models.params import ParamSpec

LENGTHS = np.array([5, 2, 7], np.int32)


def _entry_points(cfg, params):
  """Prefill, then one decode step, then a 4-node tree verify, under cfg; all outputs."""
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 7)), jnp.int32)
  pre_logits, pre_feats, cache = jax.jit(functools.partial(prefill, cfg=cfg))(
      params, tokens, jnp.asarray(LENGTHS), init_cache(cfg, 3, 16))
  dec_logits, dec_feats, cache = jax.jit(functools.partial(decode, cfg=cfg))(
      params, tokens[:, 0], cache)
  parents = jnp.asarray(np.tile([-1, 0, 0, 1], (3, 1)), jnp.int32)
  mask = ancestor_mask(parents)
  ver_logits, ver_feats, tree_kv = jax.jit(functools.partial(verify, cfg=cfg))(
      params, tokens[:, :4], tree_depths(mask), mask, cache)
  return dict(pre_logits=pre_logits, pre_feats=pre_feats, dec_logits=dec_logits,
              dec_feats=dec_feats, ver_logits=ver_logits, ver_feats=ver_feats,
              tree_k=tree_kv.k, cache_k=cache.k, cache_v=cache.v, lengths=cache.lengths)


@pytest.mark.parametrize("feature_layers", [(), (1, 0)])
def test_scan_and_loop_over_layers_give_the_same_outputs(tiny_cfg, tiny_params, feature_layers):
  loop_cfg = tiny_cfg.replace(feature_layers=feature_layers, scan_layers=False)
  scan_cfg = loop_cfg.replace(scan_layers=True)
  loop = _entry_points(loop_cfg, tiny_params)
  scan = _entry_points(scan_cfg, tiny_params)
  for name in loop:
    assert loop[name].shape == scan[name].shape, name
    np.testing.assert_allclose(np.asarray(loop[name]), np.asarray(scan[name]), rtol=1e-6,
                               atol=1e-6, err_msg=name)
  e = tiny_cfg.hidden_size
  assert loop["pre_feats"].shape[-1] == e * (1 + len(feature_layers))


def test_decode_writes_then_attends_like_a_one_token_forward(tiny_cfg, tiny_params):
  """Decode (the token's key/value written into the cache before attending) gives the
  logits, features and cache of a one-token `forward` over the prefix plus the token followed
  by `append_kv`; an inactive row's cache is left as it was."""
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (3, 7)), jnp.int32)
  for cfg in (tiny_cfg.replace(feature_layers=(1,)),
              tiny_cfg.replace(feature_layers=(1,), scan_layers=True)):
    _, _, cache = prefill(tiny_params, tokens, jnp.asarray(LENGTHS), init_cache(cfg, 3, 16),
                          cfg)
    active = jnp.asarray([True, False, True])
    logits, feats, new_cache = jax.jit(functools.partial(decode, cfg=cfg))(
        tiny_params, tokens[:, 1], cache, active=active)
    want_logits, want_feats, k, v = forward(tiny_params, tokens[:, 1:2],
                                            decode_inputs(cache.lengths), cfg, cache)
    want_cache = append_kv(cache, k, v, active.astype(jnp.int32))
    rows = np.asarray(active)
    np.testing.assert_allclose(np.asarray(logits)[rows], np.asarray(want_logits[:, 0])[rows],
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(feats)[rows], np.asarray(want_feats[:, 0])[rows],
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_cache.lengths), [6, 2, 8])
    for got, want in ((new_cache.k, want_cache.k), (new_cache.v, want_cache.v)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


def test_training_forward_without_a_cache_matches_prefill(tiny_cfg, tiny_params):
  """Packed rows with no cache (training) score a sequence exactly as prefill does."""
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, tiny_cfg.vocab_size, (1, 6)), jnp.int32)
  logits, _, _ = prefill(tiny_params, tokens, jnp.asarray([6], jnp.int32),
                         init_cache(tiny_cfg, 1, 8), tiny_cfg)
  # The same sequence packed twice into one row: segments 1 and 2, positions restarting.
  packed = jnp.concatenate([tokens, tokens], axis=1)
  segments = jnp.asarray([[1] * 6 + [2] * 6], jnp.int32)
  positions = jnp.asarray([list(range(6)) * 2], jnp.int32)
  for cfg in (tiny_cfg, tiny_cfg.replace(scan_layers=True)):
    got, _, _, _ = forward(tiny_params, packed, packed_inputs(segments, positions), cfg)
    np.testing.assert_allclose(np.asarray(got[:, :6]), np.asarray(logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(got[:, 6:]), np.asarray(logits), atol=1e-5)


def test_shared_prompt_prefill_gives_each_row_its_prompts_prefill(tiny_cfg, tiny_params):
  """Rows that share a prompt (a GRPO group) prefilled once and copied (`rows`) get the cache
  and features of prefilling each row on its own, and `last_logits` the logits of each
  row's last prompt token."""
  cfg = tiny_cfg.replace(feature_layers=(1,))
  rng = np.random.default_rng(4)
  distinct = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 7)), jnp.int32)
  rows = jnp.asarray([2, 0, 0, 1, 2], jnp.int32)
  full = jax.jit(functools.partial(prefill, cfg=cfg, fresh=True))
  want_logits, want_feats, want = full(tiny_params, distinct[rows], jnp.asarray(LENGTHS)[rows],
                                       init_cache(cfg, 5, 16))
  shared = jax.jit(functools.partial(prefill, cfg=cfg, fresh=True, last_logits=True))
  logits, feats, cache = shared(tiny_params, distinct, jnp.asarray(LENGTHS),
                                init_cache(cfg, 5, 16), rows=rows)
  last = np.asarray(LENGTHS)[np.asarray(rows)] - 1
  assert logits.shape == (5, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits)[np.arange(5), last],
                             atol=1e-5)
  np.testing.assert_allclose(np.asarray(feats), np.asarray(want_feats), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(cache.lengths), [7, 5, 5, 2, 7])
  for got, ref in ((cache.k, want.k), (cache.v, want.v)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)
  with pytest.raises(ValueError, match="fresh"):
    prefill(tiny_params, distinct, jnp.asarray(LENGTHS), init_cache(cfg, 5, 16), cfg, rows=rows)


def test_param_specs_describe_the_weights(tiny_cfg, tiny_params):
  specs = param_specs(tiny_cfg)
  is_spec = lambda x: isinstance(x, ParamSpec)  # noqa: E731
  shapes = jax.tree.map(lambda s: s.shape, specs, is_leaf=is_spec)
  assert shapes == jax.tree.map(lambda x: x.shape, tiny_params)
  axes = param_logical_axes(tiny_cfg)
  assert tuple(axes["layers"]["self_attn"]["q_proj"]["kernel"]) == (
      "layers", "embed", "heads", "head_dim")
  assert tuple(axes["embed"]["embedding"]) == ("vocab", "embed")
  # Unit norms, zero biases, random kernels.
  assert np.all(np.asarray(tiny_params["norm"]["weight"]) == 1.0)
  assert np.all(np.asarray(tiny_params["layers"]["self_attn"]["q_proj"]["bias"]) == 0.0)
  assert 0.01 < float(jnp.std(tiny_params["lm_head"]["kernel"])) < 0.03


def test_attention_input_builders():
  a = prefill_inputs(jnp.asarray([0, 3]), 3, jnp.asarray([2, 3]))
  np.testing.assert_array_equal(np.asarray(a.positions), [[0, 1, 2], [3, 4, 5]])
  # Row 0's third key is padding: nobody attends to it; the block is causal.
  np.testing.assert_array_equal(np.asarray(a.mask[0]), [[1, 0, 0], [1, 1, 0], [1, 1, 0]])
  np.testing.assert_array_equal(np.asarray(a.mask[1]), np.tril(np.ones((3, 3))))
  e = expansion_inputs(jnp.asarray([4]), jnp.asarray([[[True, False], [False, True]]]))
  np.testing.assert_array_equal(np.asarray(e.positions), [[4, 4]])
  np.testing.assert_array_equal(np.asarray(e.mask[0]), [[1, 0, 1, 0], [0, 1, 0, 1]])
  p = packed_inputs(jnp.asarray([[1, 1, 2, 0]]), jnp.asarray([[0, 1, 0, 0]]))
  np.testing.assert_array_equal(np.asarray(p.mask[0]),
                                [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]])
