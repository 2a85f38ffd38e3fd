"""Draft-tree construction, acceptance on hand-made trees, strategies, and sampling filters."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import random_drafter
from tlt_jax.models.drafter import init_drafter_cache
from tlt_jax.speculative.sampling import SamplingParams, target_probs, token_noise
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tree import build_draft_tree, tree_from_parents
from tlt_jax.speculative.verify import accept_tree


@pytest.mark.parametrize("strategy", [(4, 2, 8), (3, 3, 16), (1, 4, 5)])
def test_draft_tree_structure(tiny_cfg, tiny_params, strategy):
  strategy = Strategy(*strategy)
  dcfg, dparams = random_drafter(tiny_cfg, seed=5)
  b = 3
  cache = init_drafter_cache(tiny_cfg, dcfg, b, 16)
  cache = cache.replace(lengths=jnp.asarray([0, 4, 9], jnp.int32))
  roots = jnp.asarray([1, 2, 3], jnp.int32)
  feats = jax.random.normal(jax.random.key(0), (b, tiny_cfg.hidden_size))
  tree, new_cache = jax.jit(build_draft_tree, static_argnums=(6, 7, 8))(
      dparams, tiny_params, roots, feats, cache, jnp.asarray([True, True, False]), strategy,
      tiny_cfg, dcfg)
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  depths, mask = np.asarray(tree.depths), np.asarray(tree.mask)
  assert tokens.shape == (b, strategy.verify_tokens)
  np.testing.assert_array_equal(tokens[:, 0], roots)
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), [1, 5, 9])  # root pair joined
  for r in range(b):
    assert parents[r, 0] == -1 and depths[r, 0] == 0
    for i in range(1, strategy.verify_tokens):
      assert 0 <= parents[r, i] < i  # topological
      assert depths[r, i] == depths[r, parents[r, i]] + 1 <= strategy.steps
      assert mask[r, i, i] and mask[r, i, parents[r, i]]
    for node in range(strategy.verify_tokens):  # siblings carry distinct tokens
      kids = tokens[r, parents[r] == node]
      assert len(set(kids.tolist())) == len(kids) <= strategy.topk


@pytest.mark.parametrize("small", [(3, 2, 6), (4, 2, 8), (1, 2, 2), (6, 2, 12)])
def test_a_smaller_strategy_in_a_larger_programs_shapes_draws_its_own_tree(
    tiny_cfg, tiny_params, small):
  """One program shaped for (6, 2, 12) with limits (steps, verify_tokens): the smaller
  strategy's own tree in its first nodes, padding after them, and the same drafter cache."""
  small, shape = Strategy(*small), Strategy(6, 2, 12)
  dcfg, dparams = random_drafter(tiny_cfg, seed=5)
  b = 3
  cache = init_drafter_cache(tiny_cfg, dcfg, b, 24).replace(
      lengths=jnp.asarray([0, 4, 9], jnp.int32))
  roots = jnp.asarray([1, 2, 3], jnp.int32)
  feats = jax.random.normal(jax.random.key(0), (b, tiny_cfg.hidden_size))
  active = jnp.asarray([True, True, False])
  build = jax.jit(build_draft_tree, static_argnums=(6, 7, 8))
  own, own_cache = build(dparams, tiny_params, roots, feats, cache, active, small, tiny_cfg,
                         dcfg)
  limits = jnp.asarray([small.steps, small.verify_tokens], jnp.int32)
  padded, padded_cache = build(dparams, tiny_params, roots, feats, cache, active, shape,
                               tiny_cfg, dcfg, limits)
  t = small.verify_tokens
  assert padded.tokens.shape == (b, 12)
  for field in ("tokens", "parents", "depths"):
    np.testing.assert_array_equal(getattr(padded, field)[:, :t], getattr(own, field), field)
  np.testing.assert_array_equal(padded.mask[:, :t, :t], own.mask)
  np.testing.assert_array_equal(padded.parents[:, t:], -1)
  np.testing.assert_array_equal(padded.depths[:, t:], -1)
  assert not np.asarray(padded.mask[:, t:]).any() and not np.asarray(padded.mask[:, :, t:]).any()
  for a, c in zip(jax.tree.leaves(padded_cache), jax.tree.leaves(own_cache)):
    np.testing.assert_array_equal(a, c)


def _chain_tree(tokens):
  tokens = jnp.asarray([tokens], jnp.int32)
  t = tokens.shape[1]
  return tree_from_parents(tokens, jnp.asarray([list(range(-1, t - 1))], jnp.int32))


def test_greedy_acceptance_follows_argmax_and_stops_at_mismatch():
  # Chain root -> 3 -> 5 -> 1; the policy's argmax after each node: 3, 5, 2, 0.
  tree = _chain_tree([9, 3, 5, 1])
  probs = jax.nn.one_hot(jnp.asarray([[3, 5, 2, 0]]), 10)
  acc = accept_tree(tree, probs, None, max_depth=3)
  assert int(acc.num_nodes[0]) == 3  # root, 3, 5 accepted; 1 rejected
  assert int(acc.next_token[0]) == 2
  np.testing.assert_array_equal(np.asarray(acc.path[0]), [0, 1, 2, 2])


def test_sampling_acceptance_of_a_star_is_exact():
  """Root with children tokens (0, 1): the next token follows q exactly, accepted or not,
  over many rows with independent noise; a child is accepted with probability q(0) + q(1)."""
  n, vocab = 20000, 4
  q = jnp.asarray([0.5, 0.2, 0.2, 0.1])
  tree = tree_from_parents(jnp.tile(jnp.asarray([[3, 0, 1]], jnp.int32), (n, 1)),
                           jnp.tile(jnp.asarray([[-1, 0, 0]], jnp.int32), (n, 1)))
  probs = jnp.broadcast_to(q, (n, 3, vocab))
  noise = token_noise(jax.random.key(1), jnp.arange(n), jnp.zeros((n, 2), jnp.int32) +
                      jnp.arange(2), vocab)
  acc = accept_tree(tree, probs, noise, max_depth=1)
  accepted = np.asarray(acc.num_nodes) == 2
  first = np.where(accepted, np.asarray(tree.tokens)[np.arange(n), np.asarray(acc.path[:, 1])],
                   np.asarray(acc.next_token))
  freq = np.bincount(first, minlength=vocab) / n
  np.testing.assert_allclose(freq, q, atol=4 * np.sqrt(0.25 / n))
  assert abs(accepted.mean() - 0.7) < 4 * np.sqrt(0.25 / n)
  # The token at a position is the same draw whichever tree is verified: with no children
  # (a plain step), the root's own draw.
  bare = tree_from_parents(jnp.full((n, 1), 3, jnp.int32), jnp.full((n, 1), -1, jnp.int32))
  plain = accept_tree(bare, probs[:, :1], noise[:, :1], max_depth=0)
  np.testing.assert_array_equal(first, np.asarray(plain.next_token))


def test_strategy_validation_and_parsing():
  assert Strategy.parse("8,4,48") == Strategy(8, 4, 48) == Strategy.parse((8, 4, 48))
  assert Strategy(8, 4, 48).num_candidates == 4 + 7 * 16
  with pytest.raises(ValueError, match="exceeds the 6 draft candidates"):
    Strategy(2, 2, 8)
  with pytest.raises(ValueError, match="need steps >= 1"):
    Strategy(0, 2, 4)
  with pytest.raises(ValueError, match=r"\(steps, topk, verify_tokens\)"):
    Strategy.parse("4,2")


def test_target_probs_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  np.testing.assert_allclose(target_probs(logits, SamplingParams(1.0, top_k=2)),
                             [[0.625, 0.375, 0, 0]], atol=1e-6)
  np.testing.assert_allclose(target_probs(logits, SamplingParams(1.0, top_p=0.8)),
                             [[0.625, 0.375, 0, 0]], atol=1e-6)
  np.testing.assert_allclose(target_probs(logits, SamplingParams(1.0, top_p=0.81)),
                             [[0.5, 0.3, 0.15, 0]] / np.float32(0.95), atol=1e-6)
  np.testing.assert_array_equal(target_probs(logits, SamplingParams(0.0)), [[1, 0, 0, 0]])
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingParams(1.0, top_p=0.0)
