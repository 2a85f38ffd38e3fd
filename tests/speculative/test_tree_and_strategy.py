"""Draft-tree construction, acceptance on hand-made trees, strategies, and sampling filters."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import drafter_set, random_drafter
from tlt_jax.drafters import (Candidates, DraftContext, SuffixDrafter, check_strategy,
                              num_candidates)
from tlt_jax.drafters.suffix import SuffixSettings
from tlt_jax.models import ModelConfig, Policy
from tlt_jax.drafters.eagle.network import init_drafter_cache
from tlt_jax.speculative.sampling import SamplingParams, target_probs, token_noise
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import parse_arm
from tlt_jax.speculative.tree import (build_draft_tree, merge_candidates, select_tree,
                                      tree_from_parents)
from tlt_jax.speculative.verify import accept_tree


def _builder(cfg, params, drafter):
  """build_draft_tree jitted for an EAGLE drafter (dcfg, params): (cache, roots, feats,
  active, strategy, limits) -> (tree, the drafter's cache)."""
  drafters = drafter_set(drafter)

  @functools.partial(jax.jit, static_argnums=4)
  def build(cache, roots, feats, active, strategy, limits=None):
    b = roots.shape[0]
    ctx = DraftContext(root=roots, features=feats, active=active,
                       out=jnp.zeros((b, 4), jnp.int32), num_out=jnp.ones((b,), jnp.int32))
    tree, states = build_draft_tree(Policy(params, cfg), drafters, {"eagle": cache}, ctx,
                                    strategy, limits)
    return tree, states["eagle"]
  return build


@pytest.mark.parametrize("strategy", [(4, 2, 8), (3, 3, 16), (1, 4, 5)])
def test_draft_tree_structure(tiny_cfg, tiny_params, strategy):
  strategy = Strategy(*strategy)
  dcfg, dparams = random_drafter(tiny_cfg, seed=5)
  b = 3
  cache = init_drafter_cache(tiny_cfg, dcfg, b, 16)
  cache = cache.replace(lengths=jnp.asarray([0, 4, 9], jnp.int32))
  roots = jnp.asarray([1, 2, 3], jnp.int32)
  feats = jax.random.normal(jax.random.key(0), (b, tiny_cfg.hidden_size))
  tree, new_cache = _builder(tiny_cfg, tiny_params, (dcfg, dparams))(
      cache, roots, feats, jnp.asarray([True, True, False]), strategy)
  tokens, parents = np.asarray(tree.tokens), np.asarray(tree.parents)
  depths, mask = np.asarray(tree.depths), np.asarray(tree.mask)
  assert tokens.shape == (b, strategy.verify_tokens)
  np.testing.assert_array_equal(tokens[:, 0], roots)
  np.testing.assert_array_equal(np.asarray(new_cache.lengths), [1, 5, 9])  # root pair joined
  for r in range(b):
    assert parents[r, 0] == -1 and depths[r, 0] == 0
    for i in range(1, strategy.verify_tokens):
      assert 0 <= parents[r, i] < i  # topological
      assert depths[r, i] == depths[r, parents[r, i]] + 1 <= strategy.depth
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
  build = _builder(tiny_cfg, tiny_params, (dcfg, dparams))
  own, own_cache = build(cache, roots, feats, active, small)
  limits = jnp.asarray([small.depth, small.verify_tokens], jnp.int32)
  padded, padded_cache = build(cache, roots, feats, active, shape, limits)
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


def _suffix_propose(out, num_out, corpus, steps=4, vocab=16, **kw):
  ctx = DraftContext(root=jnp.asarray([o[n - 1] for o, n in zip(out, num_out)], jnp.int32),
                     features=jnp.zeros((len(out), 4)), active=jnp.ones((len(out),), bool),
                     out=jnp.asarray(out, jnp.int32), num_out=jnp.asarray(num_out, jnp.int32),
                     corpus=None if corpus is None else jnp.asarray(corpus, jnp.int32))
  policy = Policy({}, ModelConfig(vocab_size=vocab, hidden_size=4, intermediate_size=4,
                                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4))
  cands, _ = SuffixDrafter(SuffixSettings(**kw)).propose(
      policy, None, ctx, Strategy(steps, 1, steps + 1, ("suffix",)))
  return (np.asarray(cands.tokens), np.asarray(cands.parents), np.asarray(cands.scores))


def test_suffix_drafter_copies_what_followed_the_longest_match():
  """Row 0 ends in (5, 6, 7): a sibling has 5 6 7 -> 8 9 1, another 6 7 -> 2 (a shorter
  match), so the chain is 8 9 1 then the sibling's end (-inf). Row 1's own response repeats
  (3 4 3 4 3): it copies itself, up to what it has. Row 2 matches nothing of min_match tokens."""
  pad = [-1] * 8
  out = [[1, 5, 6, 7, 0, 0, 0, 0], [3, 4, 3, 4, 3, 0, 0, 0], [9, 9, 2, 0, 0, 0, 0, 0]]
  corpus = [[[2, 5, 6, 7, 8, 9, 1, -1], [6, 7, 2, 2, 2, -1, -1, -1]], [pad, pad],
            [[1, 2, 3, -1, -1, -1, -1, -1], pad]]
  tokens, parents, scores = _suffix_propose(out, [4, 5, 3], corpus)
  np.testing.assert_array_equal(parents, [[-1, 0, 1, 2]] * 3)
  np.testing.assert_array_equal(tokens[0, :3], [8, 9, 1])
  assert np.isfinite(scores[0, :3]).all() and scores[0, 3] == -np.inf
  assert (np.diff(scores[0, :3]) <= 0).all()  # deeper scores no higher
  np.testing.assert_array_equal(tokens[1, :2], [4, 3])  # copies itself up to its own end
  assert np.isfinite(scores[1, :2]).all() and (scores[1, 2:] == -np.inf).all()
  assert (scores[2] == -np.inf).all()
  # Frequency: two matches of 5 6 7 continue with 8, one with 4: 8 wins, with share 2/3.
  corpus2 = [[[5, 6, 7, 8, -1, -1, -1, -1], [5, 6, 7, 4, -1, -1, -1, -1],
              [5, 6, 7, 8, -1, -1, -1, -1]]]
  tokens, _, scores = _suffix_propose(out[:1], [4], corpus2, steps=1)
  assert tokens[0, 0] == 8
  np.testing.assert_allclose(scores[0, 0], np.log(2 / 3 * 3 / 4), rtol=1e-5)


def test_merge_grafts_shared_paths_and_keeps_parents_first():
  """EAGLE-like first: root -> a(5) -> b(6), root -> c(7); a chain 5 6 8: 5 and 6 are a and
  b (b takes the chain's higher score), 8 joins under b, scoring at most b."""
  first = Candidates(tokens=jnp.asarray([[5, 7, 6]]), parents=jnp.asarray([[-1, -1, 0]]),
                     scores=jnp.asarray([[-0.5, -1.0, -3.0]]))
  chain = Candidates(tokens=jnp.asarray([[5, 6, 8]]), parents=jnp.asarray([[-1, 0, 1]]),
                     scores=jnp.asarray([[-0.1, -0.2, -0.3]]))
  merged = merge_candidates(first, chain)
  np.testing.assert_array_equal(merged.parents, [[-1, -1, 0, -1, 0, 2]])
  np.testing.assert_allclose(merged.scores[0, :3], [-0.1, -1.0, -0.2])
  assert merged.scores[0, 3] == merged.scores[0, 4] == -np.inf  # drafted twice: once
  np.testing.assert_allclose(merged.scores[0, 5], -0.3)
  tree = select_tree(jnp.asarray([1]), merged, 4, 4)  # the best 3: 5, 6, 8 (a chain)
  np.testing.assert_array_equal(tree.tokens, [[1, 5, 6, 8]])
  np.testing.assert_array_equal(tree.parents, [[-1, 0, 1, 2]])
  # Too few finite candidates: the rest of the tree is padding.
  tree = select_tree(jnp.asarray([1]), chain.replace(
      scores=jnp.asarray([[-0.1, -jnp.inf, -jnp.inf]])), 4, 4)
  np.testing.assert_array_equal(tree.parents, [[-1, 0, -1, -1]])
  np.testing.assert_array_equal(tree.depths, [[0, 1, -1, -1]])


def test_strategy_validation_and_parsing():
  assert Strategy.parse("8,4,48") == Strategy(8, 4, 48) == Strategy.parse((8, 4, 48))
  assert num_candidates(Strategy(8, 4, 48)) == 4 + 7 * 16
  with pytest.raises(ValueError, match="exceeds the 6 draft candidates"):
    check_strategy(Strategy(2, 2, 8))
  with pytest.raises(ValueError, match="exceeds the 6 draft candidates"):
    parse_arm("2,2,8")  # where strategies come from input, the check runs
  with pytest.raises(ValueError, match="need depth >= 1"):
    Strategy(0, 2, 4)
  with pytest.raises(ValueError, match=r"\(depth, topk, verify_tokens\[, drafts\]\)"):
    Strategy.parse("4,2")
  hybrid = Strategy.parse("6,2,12,eagle+suffix")
  assert hybrid.drafts == ("eagle", "suffix") and num_candidates(hybrid) == 2 + 5 * 4 + 6
  assert hybrid.as_tuple() == (6, 2, 12, "eagle+suffix") and Strategy.parse(
      hybrid.as_tuple()) == hybrid
  assert Strategy.parse("4,2,8").as_tuple() == (4, 2, 8)
  assert num_candidates(Strategy.parse("4,1,5,suffix")) == 4
  with pytest.raises(ValueError, match="exceeds the 4 draft candidates that suffix drafts"):
    parse_arm("4,1,6,suffix")
  with pytest.raises(ValueError, match="unknown drafter 'medusa'.*registered drafters"):
    parse_arm("4,2,8,medusa")


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
