"""Greedy speculative decoding emits exactly what plain greedy decoding emits, and leaves the
same policy cache, for any drafter and strategy; an oracle drafter accepts the maximum."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import (drafter_set, every_family_and_hybrid, example_drafters,
                                       family_strategy, oracle_drafter, random_drafter)
from tlt_jax.drafters import DRAFTERS
from tlt_jax.models import Policy, init_cache
from tlt_jax.drafters.eagle.network import init_drafter_cache
from tlt_jax.speculative.decoding import plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = np.array([[5, 9, 2, 7, 1, 3, 8], [4, 4, 6, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0, 0]],
                   np.int32)
LENGTHS = np.array([7, 3, 5], np.int32)


def _run(cfg, params, max_new, eos_id, strategy=None, drafter=None, corpus=None,
         prompts=(PROMPTS, LENGTHS), drafters=None):
  """Generates to completion; returns (final state, accepted counts per SD iteration).
  drafter: (dcfg, params) of the EAGLE drafter or None (the weightless drafters are always
  there), or drafters: name -> drafter, all of them;
  corpus: [3, S, L] responses the suffix drafter may copy from; prompts: ([3, P] tokens,
  [3] lengths)."""
  tokens, lengths = prompts
  b = len(lengths)
  margin = strategy.depth + 1 if strategy else 1
  cap = tokens.shape[1] + max_new + margin
  policy = Policy(params, cfg)
  drafters = drafter_set(drafter) if drafters is None else drafters
  states = {name: d.init_state(cfg, b, cap) for name, d in drafters.items()}
  state = jax.jit(functools.partial(start, sp=GREEDY, max_new_tokens=max_new, eos_id=eos_id))(
      policy, jnp.asarray(tokens), jnp.asarray(lengths), init_cache(cfg, b, cap),
      jax.random.key(0), drafters=drafters,
      draft_states={k: v for k, v in states.items() if v is not None})
  accepted = []
  if strategy is None:
    step = jax.jit(functools.partial(plain_step, sp=GREEDY, eos_id=eos_id))
    while not bool(state.done.all()):
      state, _ = step(policy, state, jax.random.key(1), drafters=drafters)
  else:
    step = jax.jit(functools.partial(sd_step, sp=GREEDY, eos_id=eos_id, strategy=strategy))
    while not bool(state.done.all()):
      state, stats = step(policy, drafters, state, jax.random.key(1), corpus=corpus)
      accepted.append(np.asarray(stats.accepted))
  return state, np.stack(accepted) if accepted else None


@pytest.fixture(scope="module")
def plain_outputs(tiny_cfg, tiny_params):
  """Plain greedy decoding of 14 tokens without EOS (the reference for every case)."""
  state, _ = _run(tiny_cfg, tiny_params, 14, -1)
  return np.asarray(state.out)


def _drafter(kind, cfg, params):
  if kind == "oracle":
    return oracle_drafter(cfg, params)
  if kind == "random":
    return random_drafter(cfg, seed=3)
  return random_drafter(cfg, seed=4, num_layers=2, use_features=False)


@pytest.mark.parametrize("kind,strategy", [
    ("oracle", (4, 2, 8)), ("random", (4, 2, 8)), ("random2", (3, 3, 10)), ("oracle", (8, 4, 48)),
    ("oracle", (2, 1, 3))])
def test_greedy_sd_equals_plain(tiny_cfg, tiny_params, plain_outputs, kind, strategy):
  state, accepted = _run(tiny_cfg, tiny_params, 14, -1, Strategy(*strategy),
                         _drafter(kind, tiny_cfg, tiny_params))
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
  np.testing.assert_array_equal(np.asarray(state.num_out), [14] * 3)
  if kind == "oracle":
    assert accepted.max() > 2  # the oracle's drafts are accepted past the first level


def _siblings(outputs):
  """Each row's corpus: the other rows' outputs (as a group's finished siblings would be)."""
  b = len(outputs)
  return jnp.asarray(np.stack([outputs[[j for j in range(b) if j != i]] for i in range(b)]),
                     jnp.int32)


@pytest.mark.parametrize("strategy,corpus", [
    ("4,1,5,suffix", "none"), ("4,1,5,suffix", "siblings"), ("4,1,5,suffix", "own"),
    ("4,2,8,eagle+suffix", "siblings"), ("3,3,10,eagle+suffix", "own")])
def test_greedy_suffix_and_hybrid_equal_plain(tiny_cfg, tiny_params, plain_outputs, strategy,
                                              corpus):
  """Suffix drafts and hybrid trees emit plain decoding's tokens whatever the corpus, and
  a corpus holding the answer itself makes the suffix drafter accept more than none."""
  corpora = {"none": None, "siblings": _siblings(plain_outputs),
             "own": jnp.asarray(plain_outputs[:, None], jnp.int32)}
  strategy = Strategy.parse(strategy)
  state, accepted = _run(tiny_cfg, tiny_params, 14, -1, strategy,
                         random_drafter(tiny_cfg, seed=3), corpora[corpus])
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
  np.testing.assert_array_equal(np.asarray(state.num_out), [14] * 3)
  if corpus == "own":
    # Copying from the answer: after the first min_match tokens every draft is right.
    _, alone = _run(tiny_cfg, tiny_params, 14, -1, strategy, random_drafter(tiny_cfg, seed=3))
    assert accepted.mean() > alone.mean() and accepted.max() == strategy.depth + 1


# Every registered family alone as a chain and as a tree, and every hybrid as a tree.
FAMILY_STRATEGIES = [*((name, 4, 1, 5) for name in sorted(DRAFTERS)),
                     *((drafts, 3, 2, 6) for drafts in every_family_and_hybrid())]


@pytest.mark.parametrize("drafts,depth,topk,verify", FAMILY_STRATEGIES,
                         ids=[f"{d}-{s}-{k}-{v}" for d, s, k, v in FAMILY_STRATEGIES])
def test_greedy_every_family_and_hybrid_equals_plain(tiny_cfg, tiny_params, plain_outputs,
                                                     drafts, depth, topk, verify):
  """Every registered family (its `example`: random weights for a trained one) and hybrid
  trees of any two or more of them emit plain decoding's tokens (a corpus of the siblings)."""
  strategy = family_strategy(drafts, depth, topk, verify)
  state, accepted = _run(tiny_cfg, tiny_params, 14, -1, strategy, corpus=_siblings(plain_outputs),
                         drafters=example_drafters(tiny_cfg, seed=3))
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
  np.testing.assert_array_equal(np.asarray(state.num_out), [14] * 3)
  assert accepted.max() >= 1


def test_prompt_lookup_drafts_from_the_prompt(tiny_cfg, tiny_params):
  """Prompts that quote a greedy answer: prompt lookup reads the prompt, so its drafts are
  accepted more often than the suffix drafter's, which sees the response alone."""
  answers, _ = _run(tiny_cfg, tiny_params, 14, -1)
  wide = np.zeros((3, PROMPTS.shape[1] + 14), np.int32)
  for i, n in enumerate(LENGTHS):  # each row: its prompt, then its answer right after it
    wide[i, :n + 14] = np.concatenate([PROMPTS[i, :n], np.asarray(answers.out)[i]])
  prompts = (wide, LENGTHS + 14)
  plain, _ = _run(tiny_cfg, tiny_params, 10, -1, prompts=prompts)
  runs = {name: _run(tiny_cfg, tiny_params, 10, -1, Strategy.parse(f"4,1,5,{name}"),
                     prompts=prompts) for name in ("prompt_lookup", "suffix")}
  for state, _ in runs.values():
    np.testing.assert_array_equal(np.asarray(state.out), np.asarray(plain.out))
  lookup, suffix = (runs[name][1] for name in ("prompt_lookup", "suffix"))
  assert lookup.sum() / (lookup > 0).sum() > suffix.sum() / (suffix > 0).sum(), (lookup, suffix)


def test_suffix_drafts_need_no_trained_drafter(tiny_cfg, tiny_params, plain_outputs):
  """Without an EAGLE drafter the suffix drafter alone runs SD (no drafter state at all);
  asking for EAGLE then names what is missing."""
  state, _ = _run(tiny_cfg, tiny_params, 14, -1, Strategy.parse("4,1,5,suffix"),
                  corpus=jnp.asarray(plain_outputs[:, None], jnp.int32))
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
  assert state.drafts == {}
  with pytest.raises(ValueError, match="drafts with \\['eagle'\\], which this decoder"):
    _run(tiny_cfg, tiny_params, 14, -1, Strategy.parse("4,2,8,eagle+suffix"))


@pytest.mark.parametrize("kind", ["oracle", "random"])
def test_eos_and_length_cut_inside_accepted_paths(tiny_cfg, tiny_params, plain_outputs, kind):
  # EOS: the token of row 0 whose first occurrence is latest, so the cut is mid-output.
  row = list(plain_outputs[0])
  first = {tok: row.index(tok) for tok in row}
  eos = max(first, key=first.get)
  cut = first[eos] + 1
  assert cut > 1
  max_new = 11  # not a multiple of the oracle's accepted lengths: cuts inside a path
  plain, _ = _run(tiny_cfg, tiny_params, max_new, eos)
  sd, accepted = _run(tiny_cfg, tiny_params, max_new, eos, Strategy(4, 1, 5),
                      _drafter(kind, tiny_cfg, tiny_params))
  np.testing.assert_array_equal(np.asarray(sd.num_out), np.asarray(plain.num_out))
  np.testing.assert_array_equal(np.asarray(sd.out), np.asarray(plain.out))
  out, num = np.asarray(sd.out), np.asarray(sd.num_out)
  assert num[0] == min(cut, max_new) and (cut > max_new or out[0, cut - 1] == eos)
  for b in range(3):
    assert not out[b, num[b]:].any()  # nothing emitted after EOS or the budget
    if num[b] < max_new:
      assert out[b, num[b] - 1] == eos
  if kind == "oracle":
    assert (accepted[0] == 5).all()  # a chain of 4 fully accepted + bonus on the first pass


def test_oracle_chain_accepts_maximum(tiny_cfg, tiny_params):
  strategy = Strategy(4, 1, 5)
  state, accepted = _run(tiny_cfg, tiny_params, 21, -1, strategy,
                         oracle_drafter(tiny_cfg, tiny_params))
  # 1 token from prefill, then 4 iterations of steps + 1 = 5 tokens each.
  assert accepted.shape[0] == 4
  assert (accepted == strategy.depth + 1).all()


def test_policy_cache_after_sd_equals_plain(tiny_cfg, tiny_params):
  plain, _ = _run(tiny_cfg, tiny_params, 12, -1)
  sd, _ = _run(tiny_cfg, tiny_params, 12, -1, Strategy(3, 2, 6),
               _drafter("oracle", tiny_cfg, tiny_params))
  plain_len, sd_len = np.asarray(plain.cache.lengths), np.asarray(sd.cache.lengths)
  np.testing.assert_array_equal(plain_len, LENGTHS + 11)  # the last token is not committed
  assert (sd_len >= plain_len).all()
  for b, n in enumerate(plain_len):
    np.testing.assert_allclose(np.asarray(sd.cache.k[:, b, :, :n]),
                               np.asarray(plain.cache.k[:, b, :, :n]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(sd.cache.v[:, b, :, :n]),
                               np.asarray(plain.cache.v[:, b, :, :n]), atol=1e-5)
  # The drafter cache stays as long as the policy cache.
  np.testing.assert_array_equal(np.asarray(sd.drafts["eagle"].lengths), sd_len)


def test_fused_feature_drafter_is_lossless(tiny_cfg, tiny_params, plain_outputs):
  """EAGLE-3 style: the policy returns [final ; layer 1] features, the drafter fuses them
  (layer 1 is deeper than the 1-layer drafter: its index is the policy's, not the drafter's)."""
  fused_cfg = tiny_cfg.replace(feature_layers=(1,))
  drafter = random_drafter(fused_cfg, seed=6, feature_layers=(1,))
  assert "fuse" in drafter[1]
  state, _ = _run(fused_cfg, tiny_params, 14, -1, Strategy(3, 2, 6), drafter)
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
  assert state.features.shape == (3, 2 * tiny_cfg.hidden_size)


def test_feature_layers_layout_and_width_check(tiny_cfg, tiny_params):
  from tlt_jax.models import prefill
  from tlt_jax.models.attention_inputs import decode_inputs
  from tlt_jax.drafters.eagle.network import DrafterConfig, drafter_forward, init_drafter_params
  tokens = jnp.asarray(PROMPTS)
  _, hidden, _ = prefill(tiny_params, tokens, jnp.asarray(LENGTHS), init_cache(tiny_cfg, 3, 8),
                         tiny_cfg)
  fused_cfg = tiny_cfg.replace(feature_layers=(1, 0))
  _, feats, _ = prefill(tiny_params, tokens, jnp.asarray(LENGTHS),
                        init_cache(fused_cfg, 3, 8), fused_cfg)
  e = tiny_cfg.hidden_size
  assert feats.shape == (3, 7, 3 * e)
  np.testing.assert_allclose(np.asarray(feats[..., :e]), np.asarray(hidden), atol=1e-6)
  # Layer 1 is the last layer: its output normed is the final hidden state.
  assert not np.allclose(np.asarray(feats[..., e:2 * e]), np.asarray(hidden), atol=1e-3)
  with pytest.raises(ValueError, match="out of range for 2 layers"):
    tiny_cfg.replace(feature_layers=(2,))
  dcfg = DrafterConfig()  # no feature layers: cannot read 3E-wide features
  dparams = init_drafter_params(tiny_cfg, dcfg, jax.random.key(0))
  with pytest.raises(ValueError, match="the policy's and the drafter's feature_layers must agree"):
    drafter_forward(dparams, tiny_params, tokens[:, :1], feats[:, :1],
                    decode_inputs(jnp.zeros((3,), jnp.int32)), tiny_cfg, dcfg,
                    cache=init_drafter_cache(tiny_cfg, dcfg, 3, 8))


def test_reduced_vocab_drafter_maps_drafts_to_policy_ids(tiny_cfg, tiny_params, plain_outputs):
  """A drafter over a few of the 61 policy tokens: the oracle restricted to a draft vocabulary
  that holds every token plain decoding emits still accepts the maximum (so draft ids map
  back to the right policy ids), and a random one stays lossless."""
  from tlt_jax.drafters.eagle.draft_vocab import frequent_tokens
  from tlt_jax.drafters.eagle.network import with_draft_vocab
  chain, _ = _run(tiny_cfg, tiny_params, 21, -1)
  emitted = np.concatenate([np.asarray(chain.out).ravel(), plain_outputs.ravel()])
  r = len(set(emitted.tolist())) + 4
  d2t = frequent_tokens([emitted, range(tiny_cfg.vocab_size)], tiny_cfg.vocab_size, r)
  assert set(emitted.tolist()) <= set(d2t.tolist()) and r < tiny_cfg.vocab_size
  assert not np.array_equal(d2t, np.arange(r))
  ocfg, oparams = oracle_drafter(tiny_cfg, tiny_params)
  ocfg = dataclasses.replace(ocfg, draft_vocab_size=r)
  oparams = with_draft_vocab(oparams, tiny_params, d2t, tiny_cfg)
  state, accepted = _run(tiny_cfg, tiny_params, 21, -1, Strategy(4, 1, 5), (ocfg, oparams))
  np.testing.assert_array_equal(np.asarray(state.out), np.asarray(chain.out))
  assert accepted.shape[0] == 4 and (accepted == 5).all()  # every draft accepted

  dcfg, dparams = random_drafter(tiny_cfg, seed=3, draft_vocab_size=r)
  dparams = with_draft_vocab(dparams, tiny_params, d2t, tiny_cfg)
  state, _ = _run(tiny_cfg, tiny_params, 14, -1, Strategy(3, 2, 6), (dcfg, dparams))
  np.testing.assert_array_equal(np.asarray(state.out), plain_outputs)
