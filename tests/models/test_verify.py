"""Tree verification equals sequential decoding: logits per node and the committed cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import commit, decode, init_cache, prefill, verify
from tlt_jax.models.attention_inputs import ancestor_mask, tree_depths

PROMPT_LENS = np.array([4, 7, 1], np.int32)
CAPACITY = 24


@pytest.fixture(scope="module")
def fns(tiny_cfg):
  return dict(prefill=jax.jit(functools.partial(prefill, cfg=tiny_cfg)),
              decode=jax.jit(functools.partial(decode, cfg=tiny_cfg)),
              verify=jax.jit(functools.partial(verify, cfg=tiny_cfg)),
              commit=jax.jit(commit))


@pytest.fixture(scope="module")
def prefilled(tiny_cfg, tiny_params, fns):
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, tiny_cfg.vocab_size, (len(PROMPT_LENS), PROMPT_LENS.max()))
  cache = init_cache(tiny_cfg, len(PROMPT_LENS), CAPACITY)
  _, _, cache = fns["prefill"](tiny_params, jnp.asarray(tokens, jnp.int32),
                               jnp.asarray(PROMPT_LENS), cache)
  return cache


def _decode_path(fns, params, cache, path_tokens):
  """Decodes [B, P] tokens one by one; returns logits [B, P, V] and the cache."""
  out = []
  for j in range(path_tokens.shape[1]):
    logits, _, cache = fns["decode"](params, jnp.asarray(path_tokens[:, j]), cache)
    out.append(np.asarray(logits))
  return np.stack(out, 1), cache


def test_chain_tree_equals_sequential_decode(tiny_cfg, tiny_params, fns, prefilled):
  t = 6
  rng = np.random.default_rng(2)
  chain = rng.integers(0, tiny_cfg.vocab_size, (len(PROMPT_LENS), t)).astype(np.int32)
  parents = np.tile(np.arange(-1, t - 1, dtype=np.int32), (len(PROMPT_LENS), 1))
  mask = ancestor_mask(jnp.asarray(parents))
  logits, _, tree_kv = fns["verify"](tiny_params, jnp.asarray(chain), tree_depths(mask), mask,
                                     prefilled)
  ref_logits, ref_cache = _decode_path(fns, tiny_params, prefilled, chain)
  np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-5)

  path = jnp.tile(jnp.arange(t, dtype=jnp.int32), (len(PROMPT_LENS), 1))
  cache = fns["commit"](prefilled, tree_kv, path, jnp.full((len(PROMPT_LENS),), t, jnp.int32))
  np.testing.assert_array_equal(np.asarray(cache.lengths), np.asarray(ref_cache.lengths))
  for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
    # Compare only the valid slots of each row.
    for b, n in enumerate(np.asarray(cache.lengths)):
      np.testing.assert_allclose(np.asarray(got[:, b, :, :n]), np.asarray(want[:, b, :, :n]),
                                 atol=1e-5)


def test_branching_tree_nodes_equal_their_paths(tiny_cfg, tiny_params, fns, prefilled):
  # Per row a different tree shape; row 2 has two padding nodes.
  parents = np.array([[-1, 0, 0, 1, 1, 2, 3, 0],
                      [-1, 0, 1, 2, 0, 4, 0, 6],
                      [-1, 0, 0, 0, 3, 4, 0, 0]], np.int32)
  valid = np.ones_like(parents, bool)
  valid[2, 6:] = False
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, tiny_cfg.vocab_size, parents.shape).astype(np.int32)
  mask = ancestor_mask(jnp.asarray(parents), jnp.asarray(valid))
  depths = tree_depths(mask)
  logits, _, tree_kv = fns["verify"](tiny_params, jnp.asarray(tokens), jnp.maximum(depths, 0),
                                     mask, prefilled)
  logits = np.asarray(logits)
  assert np.isfinite(logits).all()
  mask_np = np.asarray(mask)
  for b in range(parents.shape[0]):
    for i in range(parents.shape[1]):
      if not valid[b, i]:
        continue
      path = np.nonzero(mask_np[b, i])[0]  # ancestors in topological order, then i itself
      row_cache = jax.tree.map(lambda x: x, prefilled)
      seq = np.tile(tokens[b, path], (len(PROMPT_LENS), 1))
      ref, _ = _decode_path(fns, tiny_params, row_cache, seq)
      np.testing.assert_allclose(logits[b, i], ref[b, -1], atol=1e-5,
                                 err_msg=f"row {b} node {i} path {path}")

  # Committing a branch (not the first children) writes exactly that path.
  path = jnp.asarray([[0, 2, 5], [0, 4, 5], [0, 3, 4]], jnp.int32)
  num = jnp.asarray([3, 2, 3], jnp.int32)
  cache = fns["commit"](prefilled, tree_kv, path, num)
  for b in range(3):
    seq = np.tile(tokens[b, np.asarray(path[b, :int(num[b])])], (3, 1))
    _, ref_cache = _decode_path(fns, tiny_params, prefilled, seq)
    n = int(cache.lengths[b])
    assert n == PROMPT_LENS[b] + int(num[b])
    np.testing.assert_allclose(np.asarray(cache.k[:, b, :, :n]),
                               np.asarray(ref_cache.k[:, b, :, :n]), atol=1e-5)


def test_ancestor_mask_and_depths():
  parents = jnp.asarray([[-1, 0, 0, 1, 3]], jnp.int32)
  mask = np.asarray(ancestor_mask(parents))
  np.testing.assert_array_equal(mask[0, 4], [True, True, False, True, True])
  np.testing.assert_array_equal(mask[0, 2], [True, False, True, False, False])
  np.testing.assert_array_equal(np.asarray(tree_depths(jnp.asarray(mask))), [[0, 1, 1, 2, 3]])


def test_verify_with_pallas_kernel_matches_reference(tiny_cfg, tiny_params, fns, prefilled):
  """The config switch `attention_impl` changes the kernel, not the results."""
  parents = np.array([[-1, 0, 0, 1, 1, 2, 3, 0]] * len(PROMPT_LENS), np.int32)
  tokens = np.random.default_rng(4).integers(0, tiny_cfg.vocab_size, parents.shape)
  mask = ancestor_mask(jnp.asarray(parents))
  args = (tiny_params, jnp.asarray(tokens, jnp.int32), tree_depths(mask), mask, prefilled)
  ref_logits, ref_hidden, ref_kv = fns["verify"](*args)
  kernel_cfg = tiny_cfg.replace(attention_impl="pallas_interpret")
  logits, hidden, kv = jax.jit(functools.partial(verify, cfg=kernel_cfg))(*args)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=1e-5)
  np.testing.assert_allclose(np.asarray(hidden), np.asarray(ref_hidden), atol=1e-5)
  np.testing.assert_allclose(np.asarray(kv.k), np.asarray(ref_kv.k), atol=1e-6)
