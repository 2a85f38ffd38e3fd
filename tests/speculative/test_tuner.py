"""SD strategy tuners: bucket mapping, BEG-MAB exploration and convergence, state, errors."""

import json
import math

import numpy as np
import pytest

from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import (
    DEFAULT_ARMS, DEFAULT_TABLE, PLAIN, BegMabTuner, CheapestTuner, FixedTuner, TableTuner,
    goodput, make_tuner)

BUDGETS = (48, 32, 16, 8)
BUCKET_BATCH = (1, 3, 12, 40)  # one batch size inside each default bucket
THREE_ARMS = [[(4, 2, 8), (3, 2, 8), (2, 4, 8)]]  # a single bucket, for the single-bucket tests


def fake_iteration(t, bucket, arm, best, noise_seed=0):
  """(mean tokens per sequence, seconds) of one iteration; `best[bucket]` accepts 1.5x more.

  Noise comes from (noise_seed, t) alone, so two tuners fed the same choices see the same
  timings whatever happened before: what a replayed rollout would measure.
  """
  noise = np.random.default_rng([noise_seed, t]).standard_normal(2)
  accept = 3.0 * (1.5 if arm == best[bucket] else 1.0 - 0.1 * arm)
  return accept * (1 + 0.1 * noise[0]), 0.05 * (1 + 0.1 * abs(noise[1]))


def run(tuner, batch_sizes, env, start=0):
  """Choose, run `env`, update, for each batch size; returns the arm indices chosen."""
  chosen = []
  for t, bs in enumerate(batch_sizes, start):
    strategy = tuner.choose(bs)
    arm = tuner.strategies_for(bs).index(strategy)
    tuner.update(bs, strategy, *env(t, tuner.bucket_of(bs), arm))
    chosen.append(arm)
  return chosen


def mixed_batches(n, seed=0):
  """Batch sizes that visit the four default buckets in random order."""
  return [BUCKET_BATCH[b] for b in np.random.default_rng(seed).integers(4, size=n)]


# ---------------------------------------------------------------------------------------------
# Buckets and arms.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size,bucket", [(1, 0), (2, 1), (4, 1), (5, 2), (20, 2), (21, 3),
                                               (1000, 3)])
def test_bucket_mapping_at_the_boundaries(batch_size, bucket):
  tuner = BegMabTuner()
  assert tuner.bucket_of(batch_size) == bucket
  assert tuner.choose(batch_size).verify_tokens == BUDGETS[bucket]
  assert tuner.strategies_for(batch_size) == [Strategy(*a) for a in DEFAULT_ARMS[bucket]]
  assert TableTuner().choose(batch_size) == Strategy(*DEFAULT_TABLE[bucket])


def test_bucket_ranges():
  tuner = BegMabTuner()
  assert [tuner.bucket_range(b) for b in range(4)] == [(1, 1), (2, 4), (5, 20), (21, None)]
  assert [r["batch_sizes"] for r in tuner.summary()[::3]] == ["1", "2-4", "5-20", ">=21"]


def test_default_arms_differ_in_shape_within_each_budget():
  for budget, arms in zip(BUDGETS, BegMabTuner().arms):
    assert len(arms) == 3 and {a.verify_tokens for a in arms} == {budget}
    assert len({(a.depth, a.topk) for a in arms}) == 3


def test_strategies_list_exactly_the_arms():
  tuner = BegMabTuner()
  assert tuner.strategies() == [Strategy(*a) for arms in DEFAULT_ARMS for a in arms]
  table = TableTuner([1, 8], ["4,2,8", (4, 2, 8)])
  assert table.strategies() == [Strategy(4, 2, 8)]  # shared by both buckets, compiled once
  assert table.strategies_for(7) == table.strategies_for(8) == [Strategy(4, 2, 8)]
  assert FixedTuner("3,2,6").strategies() == FixedTuner((3, 2, 6)).strategies_for(999)
  assert FixedTuner("3,2,6").strategies() == [Strategy(3, 2, 6)]


# ---------------------------------------------------------------------------------------------
# BEG-MAB behaviour.
# ---------------------------------------------------------------------------------------------

def test_untried_arms_come_first_in_order_in_every_bucket():
  tuner = BegMabTuner(arms=DEFAULT_ARMS, epsilon=1.0)  # exploration must wait for them too
  for bucket, bs in enumerate(BUCKET_BATCH):
    assert tuner.choose(bs) == tuner.choose(bs)  # choosing alone does not count as trying
    for arm in DEFAULT_ARMS[bucket]:
      strategy = tuner.choose(bs)
      assert strategy.as_tuple() == arm
      tuner.update(bs, strategy, 1.0, 0.1)


def test_converges_to_a_different_best_arm_per_bucket():
  best = (2, 0, 1, 2)
  tuner = BegMabTuner(seed=1)
  batches = mixed_batches(2400)
  chosen = run(tuner, batches, lambda t, b, a: fake_iteration(t, b, a, best))
  for bucket, bs in enumerate(BUCKET_BATCH):
    last = [a for a, s in zip(chosen, batches) if s == bs][-200:]
    share = last.count(best[bucket]) / len(last)
    assert share >= 0.8, (bucket, share)
  rows = tuner.summary()
  assert sum(r["pulls"] for r in rows) == 2400
  for bucket in range(4):  # the summary agrees on the winner
    bucket_rows = [r for r in rows if r["bucket"] == bucket]
    top = max(bucket_rows, key=lambda r: r["median_reward"])
    assert top["strategy"] == DEFAULT_ARMS[bucket][best[bucket]]


def test_epsilon_zero_never_explores_after_the_first_pulls():
  best = (1,)
  tuner = BegMabTuner([1], THREE_ARMS, epsilon=0.0, seed=0)
  chosen = run(tuner, [1] * 500, lambda t, b, a: fake_iteration(t, b, a, best))
  assert chosen[:3] == [0, 1, 2]
  assert set(chosen[3:]) == {1}


def test_epsilon_one_picks_roughly_uniformly():
  best = (1,)
  tuner = BegMabTuner([1], THREE_ARMS, epsilon=1.0, seed=0)
  chosen = run(tuner, [1] * 3000, lambda t, b, a: fake_iteration(t, b, a, best))
  shares = np.bincount(chosen, minlength=3) / len(chosen)
  np.testing.assert_allclose(shares, 1 / 3, atol=0.05)


def _switch_env(change_at):
  """Arm 0 is best until `change_at`, then it collapses and arm 1 becomes best."""
  def env(t, bucket, arm):
    before, after = (10.0, 5.0, 4.0), (2.0, 8.0, 4.0)
    return (before if t < change_at else after)[arm], 1.0
  return env


def test_sliding_window_forgets_when_the_best_arm_changes():
  change_at, window = 400, 50

  def chosen_with(memory):
    tuner = BegMabTuner([1], THREE_ARMS, epsilon=0.1, window=memory, seed=0)
    return run(tuner, [1] * (change_at + 4 * window), _switch_env(change_at))

  chosen = chosen_with(window)
  assert chosen[change_at - 100:change_at].count(0) >= 80
  switch = next(t for t in range(change_at, len(chosen)) if chosen[t:t + 20].count(1) >= 16)
  assert switch - change_at <= window + 10, switch
  # Control: the same run with a long memory still clings to the old arm at that point.
  chosen = chosen_with(10_000)
  assert chosen[change_at + window:change_at + window + 20].count(0) >= 15


def test_same_seed_same_choices_other_seed_other_choices():
  best = (2, 0, 1, 2)
  env = lambda t, b, a: fake_iteration(t, b, a, best)  # noqa: E731
  batches = mixed_batches(1500)
  first = run(BegMabTuner(seed=5), batches, env)
  assert run(BegMabTuner(seed=5), batches, env) == first
  assert run(BegMabTuner(seed=6), batches, env) != first


@pytest.mark.parametrize("steps_before", [2, 700])
def test_state_dict_round_trip_continues_identically(steps_before):
  best = (0, 2, 2, 1)
  env = lambda t, b, a: fake_iteration(t, b, a, best, noise_seed=3)  # noqa: E731
  batches = mixed_batches(steps_before + 700, seed=4)
  before, after = batches[:steps_before], batches[steps_before:]
  original = BegMabTuner(seed=3)
  run(original, before, env)
  state = json.loads(json.dumps(original.state_dict()))
  restored = BegMabTuner(seed=123)  # the saved random stream replaces this seed's
  restored.load_state_dict(state)
  assert restored.state_dict() == original.state_dict()
  assert restored.summary() == original.summary()
  assert (run(restored, after, env, start=steps_before)
          == run(original, after, env, start=steps_before))
  assert restored.state_dict() == original.state_dict()


def test_state_dict_is_plain_data_with_windows_and_counts():
  tuner = BegMabTuner([1, 2], [[(2, 2, 4)], [(2, 2, 4), (1, 2, 3)]], window=2)
  for seconds in (1.0, 0.5, 0.25):
    tuner.update(3, (1, 2, 3), 1.5, seconds)
  state = tuner.state_dict()
  assert state["rewards"] == [[[]], [[], [9.0, 18.0]]]  # 1.5 x 3 / seconds; window 2: 4.5 left
  assert state["pulls"] == [[0], [0, 3]]
  assert json.loads(json.dumps(state)) == state
  assert tuner.summary()[2] == dict(bucket=1, batch_sizes=">=2", strategy=(1, 2, 3), pulls=3,
                                    median_reward=13.5)


def test_update_returns_goodput():
  tuner = BegMabTuner()
  assert tuner.update(12, (6, 2, 16), 2.5, 0.5) == pytest.approx(60.0)
  assert goodput(1, 4.0, 0.25) == 16.0


# ---------------------------------------------------------------------------------------------
# Table and fixed tuners, factory.
# ---------------------------------------------------------------------------------------------

def test_table_tuner_is_a_fixed_map_that_learns_nothing():
  table = TableTuner()
  state = table.state_dict()
  for bucket, bs in enumerate(BUCKET_BATCH):
    strategy = table.choose(bs)
    assert strategy == Strategy(*DEFAULT_TABLE[bucket])
    assert table.update(bs, strategy, 100.0, 1e-3) == pytest.approx(bs * 1e5)
    assert table.choose(bs) == strategy
  assert table.state_dict() == state
  restored = TableTuner()
  restored.load_state_dict(json.loads(json.dumps(state)))
  assert restored.state_dict() == state
  assert [r["strategy"] for r in table.summary()] == list(DEFAULT_TABLE)


def test_fixed_tuner_returns_one_strategy_everywhere():
  fixed = FixedTuner((6, 4, 48))
  assert {fixed.choose(bs) for bs in (1, 2, 5, 21, 1000)} == {Strategy(6, 4, 48)}
  fixed.update(7, (6, 4, 48), 3.0, 0.1)
  restored = FixedTuner("6,4,48")
  restored.load_state_dict(json.loads(json.dumps(fixed.state_dict())))
  assert restored.state_dict() == fixed.state_dict() == dict(kind="fixed", strategy=[6, 4, 48])


def test_make_tuner_builds_each_kind():
  mab = make_tuner("beg_mab", thresholds=[1, 4], arms=[["8,4,48"], ["4,2,8", "2,4,8"]],
                   epsilon=0.2, window=10, seed=1)
  assert isinstance(mab, BegMabTuner) and (mab.epsilon, mab.window) == (0.2, 10)
  assert mab.strategies_for(4) == [Strategy(4, 2, 8), Strategy(2, 4, 8)]
  table = make_tuner("table", thresholds=[1, 4], strategies=["8,4,48", "4,2,8"])
  assert isinstance(table, TableTuner) and table.choose(3) == Strategy(8, 4, 48)
  fixed = make_tuner("fixed", strategy=(4, 2, 8))
  assert isinstance(fixed, FixedTuner) and fixed.choose(1) == Strategy(4, 2, 8)
  default = make_tuner("beg_mab").state_dict()
  assert default == BegMabTuner().state_dict()


# ---------------------------------------------------------------------------------------------
# Errors name the bad input.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    (dict(thresholds=[1, 5, 5, 21]), "strictly increasing"),
    (dict(thresholds=[1, 5, 2, 21]), "strictly increasing"),
    (dict(thresholds=[2, 5, 10, 21]), "must start at 1"),
    (dict(thresholds=[]), "thresholds are empty"),
    (dict(thresholds=[1, 2.5, 5, 21]), "must be integers"),
    (dict(thresholds=[1, 2]), "got 4 arm lists for 2 buckets"),
    (dict(thresholds=[1, 2], arms=[[(8, 4, 48)], []]), r"bucket 1 \(batch sizes >=2\) has no arms"),
    (dict(thresholds=[1], arms=[[(1, 2, 10)]]), r"bucket 0 .*entry 0 .*exceeds the 2 draft"),
    (dict(thresholds=[1], arms=[["4,2"]]),
     r"entry 0 \('4,2'\).*\(depth, topk, verify_tokens\[, drafts\]\)"),
    (dict(thresholds=[1], arms=[[(4, 2, 8), "4,2,8"]]), "lists a strategy twice"),
    (dict(epsilon=-0.1), r"epsilon .* in \[0, 1\], got -0.1"),
    (dict(epsilon=1.5), r"epsilon .* in \[0, 1\], got 1.5"),
    (dict(epsilon=math.nan), r"epsilon .* in \[0, 1\], got nan"),
    (dict(window=0), "window .* integer >= 1, got 0"),
    (dict(window=2.5), "window .* integer >= 1, got 2.5"),
])
def test_beg_mab_constructor_errors(kwargs, message):
  with pytest.raises(ValueError, match=message):
    BegMabTuner(**kwargs)


@pytest.mark.parametrize("call,message", [
    (lambda t: t.choose(0), "batch_size must be an integer >= 1.*got 0"),
    (lambda t: t.choose(-3), "batch_size must be an integer >= 1.*got -3"),
    (lambda t: t.choose(2.5), "batch_size must be an integer >= 1.*got 2.5"),
    (lambda t: t.update(0, (8, 4, 48), 1.0, 1.0), "batch_size must be an integer >= 1"),
    (lambda t: t.update(3, (8, 4, 48), 1.0, 1.0),
     r"\(8, 4, 48\) is not an arm of bucket 1 \(batch sizes 2-4\); its arms are "
     r"\[\(8, 4, 32\), \(6, 3, 32\), \(4, 4, 32\)\]"),
    (lambda t: t.update(1, (8, 4, 48), 1.0, 0.0), "iteration_seconds must be .* > 0.*got 0.0"),
    (lambda t: t.update(1, (8, 4, 48), -1.0, 1.0), "accepted_tokens must be .* >= 0.*got -1.0"),
    (lambda t: t.update(1, (8, 4, 48), math.inf, 1.0), "accepted_tokens must be a finite"),
    (lambda t: t.bucket_range(4), "bucket 4 does not exist; there are 4 buckets"),
])
def test_beg_mab_call_errors(call, message):
  with pytest.raises(ValueError, match=message):
    call(BegMabTuner())


def test_load_state_dict_rejects_another_configuration():
  state = BegMabTuner().state_dict()
  other = BegMabTuner(arms=[a[:2] for a in DEFAULT_ARMS])
  with pytest.raises(ValueError, match="arms is .* in the state but .* here"):
    other.load_state_dict(state)
  with pytest.raises(ValueError, match="window is 300 in the state but 10 here"):
    BegMabTuner(window=10).load_state_dict(state)
  with pytest.raises(ValueError, match="kind is 'table' in the state but 'beg_mab' here"):
    BegMabTuner().load_state_dict(TableTuner().state_dict())
  with pytest.raises(ValueError, match=r"lacks \['rewards'\]"):
    BegMabTuner().load_state_dict({k: v for k, v in state.items() if k != "rewards"})
  with pytest.raises(ValueError, match="strategy is .*8, 4, 48.* in the state but .*4, 2, 8"):
    FixedTuner((4, 2, 8)).load_state_dict(FixedTuner().state_dict())


def test_table_and_fixed_errors():
  with pytest.raises(ValueError, match="got 2 strategies for 4 buckets"):
    TableTuner(strategies=[(8, 4, 48), (4, 2, 8)])
  with pytest.raises(ValueError, match="must start at 1"):
    TableTuner([0, 4], [(8, 4, 48), (4, 2, 8)])
  with pytest.raises(ValueError, match=r"table strategies, entry 1 .*exceeds"):
    TableTuner([1, 4], [(8, 4, 48), (1, 1, 3)])
  with pytest.raises(ValueError, match=r"\(8, 4, 48\) is not an arm of bucket 3 .*\(8, 4, 8\)"):
    TableTuner().update(50, (8, 4, 48), 1.0, 1.0)
  with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
    FixedTuner().choose(0)
  with pytest.raises(ValueError, match=r"not an arm of bucket 0 .*\[\(8, 4, 48\)\]"):
    FixedTuner().update(3, (4, 2, 8), 1.0, 1.0)


def test_make_tuner_unknown_kind_lists_the_kinds():
  allowed = r"\('beg_mab', 'cheapest', 'table', 'fixed'\)"
  with pytest.raises(ValueError, match=rf"tuner='bandit' is not allowed.*{allowed}"):
    make_tuner("bandit")


def test_plain_arm_wins_where_no_strategy_pays():
  """Every SD arm accepts 2 tokens but costs 3x a plain step at batch 4, and 1.2x at batch 1:
  BEG-MAB settles on plain decoding in the first bucket and on SD in the other."""
  tuner = BegMabTuner(thresholds=(1, 2), arms=[[(3, 2, 6), (2, 2, 4)], [(3, 2, 6)]],
                      epsilon=0.0, seed=0, plain_arm=True)
  assert tuner.arms[0][-1] is PLAIN and tuner.arms[1][-1] is PLAIN
  assert tuner.strategies() == [Strategy(3, 2, 6), Strategy(2, 2, 4)]  # nothing to compile
  assert tuner.strategies_for(1) == [Strategy(3, 2, 6), Strategy(2, 2, 4)]
  plain_s = 0.01
  for _ in range(20):
    for bs, sd_cost in ((1, 1.2), (4, 3.0)):
      arm = tuner.choose(bs)
      if arm is PLAIN:
        tuner.update(bs, arm, 1.0, plain_s)
      else:
        tuner.update(bs, arm, 2.0, plain_s * sd_cost)
  assert tuner.choose(1) != PLAIN and tuner.choose(4) is PLAIN
  state = json.loads(json.dumps(tuner.state_dict()))
  assert state["arms"][1] == [[3, 2, 6], "plain"]
  again = BegMabTuner(thresholds=(1, 2), arms=[[(3, 2, 6), (2, 2, 4)], [(3, 2, 6)]],
                      epsilon=0.0, plain_arm=True)
  again.load_state_dict(state)
  assert again.choose(4) is PLAIN
  with pytest.raises(ValueError, match="'plain' is an arm of BEG-MAB only"):
    TableTuner(thresholds=(1,), strategies=["plain"])


def test_only_ready_arms_are_chosen_and_plain_when_none_is():
  """Compiling ahead, the engine passes which strategies' programs are ready: the others are
  not chosen (not even untried), PLAIN stands in when none is, and with every arm ready the
  choices and the random stream are those of a tuner asked without the predicate."""
  arms = [tuple(Strategy(*a) for a in THREE_ARMS[0])]
  ready = {arms[0][2]}
  tuner = BegMabTuner([1], THREE_ARMS, epsilon=1.0, seed=0)
  assert tuner.choose(1, lambda s: False) is PLAIN
  for _ in range(50):
    assert tuner.choose(1, lambda s: s in ready) == arms[0][2]
  tuner.update(1, arms[0][2], 2.0, 0.1)
  ready.add(arms[0][0])
  assert tuner.choose(1, lambda s: s in ready) == arms[0][0]  # untried and ready: first
  assert not tuner.knows(1, PLAIN) and tuner.knows(1, arms[0][1])
  assert BegMabTuner([1], THREE_ARMS, plain_arm=True).knows(1, PLAIN)
  best = (1,)
  a, b = (BegMabTuner([1], THREE_ARMS, epsilon=0.3, seed=4) for _ in range(2))
  env = lambda t, bucket, arm: fake_iteration(t, bucket, arm, best)  # noqa: E731
  b_choose = b.choose
  b.choose = lambda bs: b_choose(bs, lambda s: True)
  assert run(a, [1] * 200, env) == run(b, [1] * 200, env)
  for tuner in (TableTuner(), FixedTuner()):
    assert tuner.choose(3, lambda s: False) is PLAIN
    assert tuner.choose(3, lambda s: True) == tuner.choose(3)


def _cheapest_env(tuner, batch, calls, costs, accepts, call_s=0.0):
  """Runs `calls` choices at `batch`: an arm's call of n iterations (the tuner's cap, else
  32) takes call_s + n * costs[arm] seconds and gains accepts[arm] tokens per iteration.
  Returns the iterations each arm ran."""
  ran = {}
  for _ in range(calls):
    arm = tuner.choose(batch)
    n = tuner.iterations_for(batch, arm) or 32
    name = "plain" if arm is PLAIN else arm.as_tuple()
    ran[name] = ran.get(name, 0) + n
    tuner.update(batch, arm, accepts[name], (call_s + n * costs[name]) / n, n)
  return ran


def test_cheapest_tuner_takes_the_arm_whose_token_costs_least():
  """At 1 row SD costs 2.2 plain steps and gains 1.9 tokens: plain wins. At 100 rows the same
  arm costs 1.2 steps for 3 tokens: SD wins. A losing arm runs a few short calls, no more."""
  arms = [[(8, 2, 16)], [(8, 2, 16)]]
  tuner = CheapestTuner(thresholds=(1, 2), arms=arms, epsilon=0.0, explore_iterations=4)
  assert tuner.arms[0][-1] is PLAIN  # plain decoding is always an arm
  sd = (8, 2, 16)
  tail = _cheapest_env(tuner, 1, 40, {sd: 4.2e-3, "plain": 1.9e-3}, {sd: 1.9, "plain": 1.0})
  assert tuner.choose(1) is PLAIN
  assert tail[sd] <= 8 and tail["plain"] > 1000
  bulk = _cheapest_env(tuner, 100, 40, {sd: 13e-3, "plain": 11e-3}, {sd: 3.0, "plain": 1.0})
  assert tuner.choose(100) == Strategy(*sd)
  assert bulk["plain"] <= 8
  rows = {(r["batch_sizes"], r["strategy"] if r["strategy"] == "plain" else tuple(
      r["strategy"])): r for r in tuner.summary()}
  assert rows[(">=2", sd)]["median_reward"] == pytest.approx(3.0 / 13e-3, rel=1e-6)
  state = json.loads(json.dumps(tuner.state_dict()))
  again = CheapestTuner(thresholds=(1, 2), arms=arms, epsilon=0.0)
  again.load_state_dict(state)
  assert again.choose(1) is PLAIN and again.choose(100) == Strategy(*sd)


def test_cheapest_tuner_shares_out_each_calls_fixed_seconds():
  """Calls cost 9 ms each besides their iterations. Explored in calls of 4 iterations, an SD
  arm would look 2.25 ms an iteration dearer than plain decoding measured in calls of 32;
  the fitted fixed part puts both at what a call of 32 costs: SD (1.4 ms a token) beats
  plain (1.9 + 9 / 32 ms)."""
  sd = (4, 2, 8)
  tuner = CheapestTuner(thresholds=(1,), arms=[[sd]], epsilon=0.2, seed=1,
                        explore_iterations=4)
  costs, accepts = {sd: 2.8e-3, "plain": 1.9e-3}, {sd: 2.0, "plain": 1.0}
  # Plain decoding first, in full calls (as it runs before the tail), then the tuner's turn.
  for _ in range(20):
    tuner.update(1, PLAIN, 1.0, (9e-3 + 32 * 1.9e-3) / 32, 32)
  _cheapest_env(tuner, 1, 60, costs, accepts, call_s=9e-3)
  assert tuner._call_s == pytest.approx(9e-3, rel=1e-6)
  assert tuner.choose(1) == Strategy(*sd) or tuner._exploring
  assert tuner.cost_per_token(0, 0) < tuner.cost_per_token(0, 1)
