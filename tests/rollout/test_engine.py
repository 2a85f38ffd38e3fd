"""The rollout engine: lossless SD switch, continuous batching, compaction, slices, compiles."""

import dataclasses
import time

import jax
import numpy as np
import pytest
from scipy import stats

from tests.engines import engine_config
from tests.speculative.drafters import drafter_set, example_drafters, random_drafter
from tlt_jax.drafters import DRAFTERS
from tlt_jax.mesh import make_mesh
from tlt_jax.models import ModelConfig, init_params, prefill, init_cache
from tlt_jax.drafters.eagle.network import drafter_from_policy
from tlt_jax.rollout import pool as pool_module
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams, target_probs
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import BegMabTuner, FixedTuner

GREEDY = SamplingParams(0.0)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [3, 3], [20, 1]]


def _mesh(replicas, fsdp=1):
  return make_mesh({"replica": replicas, "fsdp": fsdp, "tensor": 1},
                   jax.devices()[:replicas * fsdp])


def _eos(tiny_cfg, tiny_params):
  """A token that ends some but not all greedy generations early."""
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1),
                         engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12))
  res = engine.generate(PROMPTS, 1, GREEDY, jax.random.key(0))
  counts = {}
  for toks in res.tokens:
    for t in set(toks[2:]):
      counts[t] = counts.get(t, 0) + 1
  return min(counts, key=lambda t: abs(counts[t] - len(PROMPTS) / 2))


@pytest.fixture(scope="module")
def plain_reference(tiny_cfg, tiny_params):
  eos = _eos(tiny_cfg, tiny_params)
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12, eos_id=eos)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec)
  return ec, engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))


@pytest.mark.parametrize("replicas,fsdp,max_batch,threshold,drafter", [
    (1, 1, 8, 3, "oracle"), (2, 1, 4, 3, "random"), (2, 2, 2, 1, "oracle")])
def test_greedy_engine_with_sd_equals_plain_engine(tiny_cfg, tiny_params, plain_reference,
                                                   replicas, fsdp, max_batch, threshold,
                                                   drafter):
  ec, ref = plain_reference
  reasons = set(ref.finish_reasons)
  assert reasons == {"eos", "length"}  # sequences finish at different times
  ec = engine_config(max_batch=max_batch, max_prompt_len=8, max_new_tokens=12,
                    sd_threshold=threshold, eos_id=ec.eos_id, prompt_widths=(8,))
  d = drafter_from_policy(tiny_cfg, tiny_params) if drafter == "oracle" else random_drafter(
      tiny_cfg, seed=2)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(replicas, fsdp), ec, drafters=drafter_set(d),
                         tuner=FixedTuner((3, 2, 6)))
  res = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert res.tokens == ref.tokens
  assert res.finish_reasons == ref.finish_reasons
  modes = {r.mode for r in res.timeline}
  assert {"prefill", "plain", "sd"} <= modes
  # The switch happens exactly at the threshold.
  for r in res.timeline:
    if r.mode == "sd":
      assert r.active <= threshold
    elif r.mode == "plain":
      assert r.active > threshold
  # Rows were compacted into smaller buckets as sequences finished.
  assert min(r.bucket for r in res.timeline if r.mode != "prefill") < max_batch
  assert {r.slice for r in res.timeline} == set(range(replicas))
  if max_batch < 8:  # 14 requests on fewer rows: refills happened
    assert sum(r.mode == "prefill" for r in res.timeline) > replicas


def test_a_prompts_samples_share_one_prefill_row(tiny_cfg, tiny_params, plain_reference):
  """The samples of one prompt that start a batch together are prefilled once: the first
  batch of 7 prompts x 2 samples (8 rows: 4 prompts) prefills 4 rows; the tokens are those
  of prefilling every request on its own (a batch of one row). A refill prefills a row per
  request, so its program depends on the group size alone, not on how many prompts it
  holds."""
  ec, ref = plain_reference
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec)
  assert engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0)).tokens == ref.tokens
  # (slice, kind, rows, prompts, width, sampling support)
  assert (0, "prefill", 8, 4, 8, GREEDY.program_key) in engine.pool
  assert (0, "prefill", 8, 8, 8, GREEDY.program_key) not in engine.pool
  refills = [k for k in engine.pool if k[1] == "prefill" and k[2] < 8]
  assert refills and all(k[2] == k[3] for k in refills), refills
  alone = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(ec, max_batch=1))
  assert alone.generate(PROMPTS, 2, GREEDY, jax.random.key(0)).tokens == ref.tokens


def test_no_recompiles_and_bounded_pool(tiny_cfg, tiny_params, plain_reference):
  ec, ref = plain_reference
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=12, sd_threshold=2,
                    eos_id=ec.eos_id)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  idle = []
  first = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0),
                          on_slice_idle=lambda s, mesh, block: idle.append(
                              (s, mesh.devices.size, block)))
  assert idle == [(0, 1, None)]  # told once, when the slice ran out of work
  assert first.pool["compiles"] == first.pool["executables"]  # every program compiled once
  # The bill: every compile under its program kind, the SD program among them.
  bill = first.pool["bill"]
  assert sum(line["programs"] for line in bill.values()) == first.pool["compiles"]
  assert {"rollout_prefill", "rollout_decode", "rollout_decode_sd"} <= set(bill)
  assert bill["rollout_decode_sd"]["programs"] >= 1 and bill["rollout_decode_sd"]["seconds"] > 0
  second = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert second.pool["compiles"] == first.pool["compiles"]
  assert second.pool["bill"] == bill
  assert second.tokens == first.tokens == ref.tokens


def test_greedy_and_sampled_rollouts_share_programs_and_keep_their_tokens(tiny_cfg,
                                                                         tiny_params):
  """The temperature is an argument of the engine's programs, not part of their key: after
  rollouts at two temperatures, a greedy one compiles nothing (its schedule, SD's accept
  lengths included, needs a subset of their programs), and each gives what an engine that
  ran them in the reverse order gives."""
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=6, sd_threshold=2)

  def engine():
    return RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  shared, runs = engine(), {}
  for sp in (SamplingParams(0.7), SamplingParams(1.3), GREEDY):
    runs[sp] = shared.generate(PROMPTS, 2, sp, jax.random.key(0))
  assert runs[GREEDY].pool["bill"]["rollout_decode_sd"]["programs"] >= 1
  assert {r.pool["compiles"] for r in runs.values()} == {runs[GREEDY].pool["compiles"]}
  assert len({str(r.tokens) for r in runs.values()}) == 3  # the temperature took effect
  reverse = engine()
  for sp in reversed(runs):
    assert reverse.generate(PROMPTS, 2, sp, jax.random.key(0)).tokens == runs[sp].tokens


def test_a_slice_without_requests_is_idle_from_the_start(tiny_cfg, tiny_params):
  """Fewer requests than slices: the idle slice is reported at once (spot training starts
  there, and its trainer stops when every slice has been reported), not never."""
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(2),
                         engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=4))
  idle = []
  res = engine.generate([PROMPTS[1]], 1, GREEDY, jax.random.key(0),
                        on_slice_idle=lambda s, mesh, block: idle.append((s, block)))
  assert idle == [(1, None), (0, None)] and len(res.tokens[0]) == 4
  assert res.slice_done_s[1] <= res.slice_done_s[0]


@pytest.mark.parametrize("shared", [0, 2], ids=["own-programs", "shared-programs"])
def test_compiling_ahead_keeps_tokens_and_takes_compiles_off_the_critical_path(
    tiny_cfg, tiny_params, plain_reference, shared):
  """With compile_ahead, the tail's SD programs compile in the background from the first
  prefill; the tail decodes plainly until one is ready, and no call compiles an SD program.
  With shared programs the two arms of batch 2 run in one program shaped for (3, 2, 6)."""
  ec, ref = plain_reference
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12, sd_threshold=2,
                    eos_id=ec.eos_id, compile_ahead=True, shared_sd_max_batch=shared)
  tuner = BegMabTuner(thresholds=(1, 2), arms=[[(3, 2, 6)], [(2, 2, 4), (3, 2, 6)]],
                      plain_arm=True)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)), tuner=tuner)
  # Most running rows first, each bucket's plain program and then its arms in order, one
  # entry per program.
  narrow, wide = tuner.arms[1][:2]
  plan = engine.tail_plan()
  assert plan == [(2, None), (2, narrow), (2, wide), (1, None), (1, wide)]
  assert engine.shared_shape(2, narrow) == (wide if shared else None)
  assert engine.shared_shape(1, wide) is None  # the only arm of its batch
  first = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert first.tokens == ref.tokens and first.finish_reasons == ref.finish_reasons
  while engine.pool.pending():  # the rest of the plan finishes in the background
    time.sleep(0.05)
  bill = engine.pool.report()["bill"]
  sd = bill["rollout_decode_sd"]
  assert sd["programs"] == 0 and sd["seconds"] == 0  # no SD call waited for a compile
  assert sd["ahead_programs"] == (2 if shared else 3) and sd["ahead_seconds"] > 0
  # The tail's plain programs (batches 2 and 1) too, unless the tail needed one first.
  plain = bill["rollout_decode"]
  assert plain["ahead_programs"] >= 1 and plain["ahead_programs"] + plain["programs"] == 4
  second = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert second.tokens == ref.tokens
  assert any(r.mode == "sd" for r in second.timeline)  # every program ready: SD in the tail
  assert engine.pool.report()["bill"] == bill  # nothing compiled twice
  # The tuner heard only from calls of its arms, never from a program's first run.
  sd_calls = [r for res in (first, second) for r in res.timeline
              if r.mode == "sd" or (r.mode == "plain" and r.active <= 2)]
  assert sum(row["pulls"] for row in tuner.summary()) <= sum(not r.compiled for r in sd_calls)
  # A call that queues nothing ahead decodes its tail with what is ready: at another
  # temperature, the same programs (the temperature is their argument), none compiled.
  engine.generate(PROMPTS, 2, SamplingParams(0.5), jax.random.key(1), compile_priority=None)
  assert not engine.pool.pending()
  after = engine.pool.report()["bill"]
  assert (after["rollout_decode"], after["rollout_decode_sd"]) == (plain, sd)


def test_every_slice_compiles_its_tail_ahead(tiny_cfg, tiny_params):
  """The rollout key is placed on each slice, so the programs compiled ahead for a slice
  other than the key's device lower too (they failed, and the failure stopped the rollout
  that asked for the program)."""
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=12, sd_threshold=2,
                    compile_ahead=True)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(2), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  pool_module.wait_for_compiles_ahead()
  for s in (0, 1):
    for batch, strategy in engine.tail_plan():
      assert engine.programs[s].decode_ready(batch, strategy, GREEDY)  # raises if it failed
  # Both slices' programs came from one trace each (tlt_jax.rollout.traces): every key of
  # slice 1 has slice 0's twin, and each pair was traced once.
  keys = {s: {key[1:] for key in engine.pool if key[0] == s} for s in (0, 1)}
  assert keys[0] == keys[1]
  assert engine.pool.traces.traced == len(keys[0]) == engine.pool.traces.reused


def _beg_mab_engine(tiny_cfg, tiny_params, eos_id, slices, max_batch):
  """(engine, tuner): SD with a BEG-MAB tuner over two buckets of two arms each."""
  ec = engine_config(max_batch=max_batch, max_prompt_len=8, max_new_tokens=12, sd_threshold=4,
                    eos_id=eos_id)
  tuner = BegMabTuner(thresholds=(1, 3), arms=[[(3, 2, 6), (2, 2, 4)], [(2, 2, 4), (2, 1, 3)]])
  return RolloutEngine(tiny_cfg, tiny_params, _mesh(slices), ec,
                       drafters=drafter_set(drafter_from_policy(tiny_cfg, tiny_params)),
                       tuner=tuner), tuner


def test_beg_mab_tuner_drives_strategies(tiny_cfg, tiny_params, plain_reference):
  ec, ref = plain_reference
  engine, tuner = _beg_mab_engine(tiny_cfg, tiny_params, ec.eos_id, slices=1, max_batch=8)
  runs = [engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0)) for _ in range(2)]
  assert runs[0].tokens == runs[1].tokens == ref.tokens
  records = [r for res in runs for r in res.timeline if r.mode == "sd"]
  assert len({r.strategy for r in records}) >= 2  # untried arms are explored
  # The tuner learns from every SD call but those that compiled their program (a first run's
  # time would mislead it).
  assert sum(row["pulls"] for row in tuner.summary()) == sum(
      not r.compiled for r in records) > 0


def test_the_tuner_is_not_billed_for_another_slices_compiles(tiny_cfg, tiny_params,
                                                             plain_reference, monkeypatch):
  """One host loop serves every slice: while slice 0's call runs, slice 1's dispatch may
  compile. Those seconds are not slice 0's, and must not reach the tuner's reward."""
  ec, ref = plain_reference
  engine, tuner = _beg_mab_engine(tiny_cfg, tiny_params, ec.eos_id, slices=2, max_batch=4)
  assert engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0)).tokens == ref.tokens
  # Slice 1 forgets its programs, and compiling one now takes 0.4 s longer.
  for key in [k for k in engine.pool if k[0] == 1]:
    del engine.pool._exes[key]
  compile_once = pool_module._compile

  def slow_compile(*args):
    time.sleep(0.4)
    exe, seconds = compile_once(*args)
    return exe, seconds + 0.4
  monkeypatch.setattr(pool_module, "_compile", slow_compile)
  seen = []
  update = tuner.update
  monkeypatch.setattr(tuner, "update", lambda *a: seen.append(a[3]) or update(*a))
  res = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert res.tokens == ref.tokens
  slow = [r for r in res.timeline if r.compiled]
  assert any(r.slice == 1 for r in slow)
  assert seen and max(seen) < 0.2, seen  # a tiny model's iteration takes milliseconds


def test_sampled_sd_engine_emits_what_the_plain_engine_emits(tiny_cfg, tiny_params,
                                                             plain_reference):
  """Under sampling too: another schedule (2 slices, batches of 2, several steps per call),
  SD with a random drafter and BEG-MAB (plain arm included): token for token the same, with
  temperature and top-p (tests/test_experiments.py's campaign run checks temperature 1 on
  the whole job)."""
  ec, _ = plain_reference
  sp = SamplingParams(0.8, top_p=0.9)
  plain = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(
      ec, iterations_per_call=1)).generate(PROMPTS, 3, sp, jax.random.key(4))
  tuner = BegMabTuner(thresholds=(1, 2), arms=[[(3, 2, 6), (2, 2, 4)], [(2, 2, 4)]],
                      plain_arm=True)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(2), dataclasses.replace(
      ec, max_batch=2, sd_threshold=2, iterations_per_call=8),
      drafters=drafter_set(random_drafter(tiny_cfg, 2)), tuner=tuner)
  sd = engine.generate(PROMPTS, 3, sp, jax.random.key(4))
  assert sd.tokens == plain.tokens and sd.finish_reasons == plain.finish_reasons
  assert any(r.mode == "sd" for r in sd.timeline)
  other_key = engine.generate(PROMPTS, 3, sp, jax.random.key(5))
  assert other_key.tokens != sd.tokens
  # Each token's log-prob as drawn: what the trainer computes for it (float32 rounding of
  # other program shapes apart), from a prefill, a plain step or a tree verify alike.
  from tlt_jax.rl.loss import ROLLOUT_LOGP, token_log_probs
  from tlt_jax.rl.policy_update import build_rows
  prompts = [PROMPTS[i // 3] for i in range(len(plain.tokens))]
  rows = build_rows(prompts, plain.tokens, {"rollout_logp": plain.logprobs}, len(prompts), 0,
                    declared=(ROLLOUT_LOGP,))
  trainer, _ = jax.jit(lambda r: token_log_probs(tiny_params, r["tokens"], r["targets"],
                                                 r["loss_mask"], tiny_cfg, sp))(rows)
  assert [len(lp) for lp in plain.logprobs] == [len(t) for t in plain.tokens]
  np.testing.assert_allclose(np.asarray(trainer)[rows["loss_mask"]],
                             rows["rollout_logp"][rows["loss_mask"]], atol=2e-5)
  np.testing.assert_allclose(np.concatenate(sd.logprobs), np.concatenate(plain.logprobs),
                             atol=2e-5)


def test_several_iterations_per_call_change_the_calls_not_the_tokens(tiny_cfg, tiny_params,
                                                                 plain_reference):
  ec, ref = plain_reference
  one = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(
      ec, max_batch=4, iterations_per_call=1)).generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  many = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(
      ec, max_batch=4, iterations_per_call=64)).generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert one.tokens == many.tokens == ref.tokens
  calls = [[r for r in res.timeline if r.mode == "plain"] for res in (one, many)]
  assert all(r.iterations == 1 for r in calls[0])
  assert len(calls[1]) < len(calls[0]) / 2  # the host hears from the device far less often
  assert sum(r.iterations for r in calls[1]) <= sum(r.iterations for r in calls[0])
  assert one.call_s > 0 and many.host_s > 0


@pytest.mark.parametrize("bad,match", [
    (dict(prompts=[]), "no prompts"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[list(range(1, 10))]), "more than rollout.max_prompt_len=8"),
    (dict(num_samples=0), "num_samples must be >= 1"),
    (dict(prompts=[[1, 999]]), r"outside \[0, 61\)"),
])
def test_bad_inputs(tiny_cfg, tiny_params, bad, match):
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1),
                         engine_config(max_batch=2, max_prompt_len=8, max_new_tokens=4))
  kw = dict(prompts=[[1, 2]], num_samples=1) | bad
  with pytest.raises(ValueError, match=match):
    engine.generate(kw["prompts"], kw["num_samples"], GREEDY, jax.random.key(0))


def test_generate_stops_between_calls_when_asked(tiny_cfg, tiny_params, plain_reference):
  """A job's stop signal reaches a long generation between two compiled calls: it ends there
  (GenerationStopped, saying how far it got) instead of running to the last token."""
  from tlt_jax.rollout.engine import GenerationStopped
  ec, _ = plain_reference
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(
      ec, iterations_per_call=1))
  asked = []

  def should_stop():
    asked.append(1)
    return len(asked) > 3
  with pytest.raises(GenerationStopped, match="of 21 responses done"):
    engine.generate(PROMPTS, 3, GREEDY, jax.random.key(0), should_stop=should_stop)
  assert len(asked) == 4


def test_bad_engine_config(tiny_cfg, tiny_params):
  with pytest.raises(ValueError, match="max_batch=6 must be a power of two"):
    engine_config(max_batch=6)
  with pytest.raises(ValueError, match="exceeds the 6 draft candidates"):
    FixedTuner((2, 2, 8))
  with pytest.raises(ValueError, match="needs a tuner"):
    RolloutEngine(tiny_cfg, tiny_params, _mesh(1), engine_config(),
                  drafters=drafter_set(random_drafter(tiny_cfg)))


def test_sampled_engine_is_exact():
  """Through the engine (continuous batching, SD from the first step): the first two tokens
  follow q(t1) q(t2 | t1) exactly (chi-square, significance 1e-3, 2048 samples)."""
  cfg = ModelConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=8, attention_impl="reference")
  params = init_params(cfg, jax.random.key(3))
  params["lm_head"]["kernel"] = params["lm_head"]["kernel"] * 8.0
  prompt = [1, 4, 2]
  sp = SamplingParams(0.8)
  n = 2048
  ec = engine_config(max_batch=1024, max_prompt_len=4, max_new_tokens=2, sd_threshold=1024)
  engine = RolloutEngine(cfg, params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(cfg, seed=9)),
                         tuner=FixedTuner((2, 2, 4)))
  res = engine.generate([prompt], n, sp, jax.random.key(5))
  assert any(r.mode == "sd" and r.accept_mean > 1.05 for r in res.timeline)
  pairs = np.asarray([t[:2] for t in res.tokens])
  # Exact joint from the policy.
  seqs = np.asarray([prompt + [a] for a in range(6)], np.int32)
  logits, _, _ = prefill(params, seqs, np.full((6,), 4, np.int32), init_cache(cfg, 6, 4), cfg)
  q1 = np.asarray(target_probs(logits[0, 2], sp), np.float64)
  q2 = np.asarray(target_probs(logits[:, 3], sp), np.float64)
  joint = (q1[:, None] * q2).reshape(-1)
  expected = joint / joint.sum() * n
  observed = np.bincount(pairs[:, 0] * 6 + pairs[:, 1], minlength=36)
  keep = expected >= 5
  obs = np.append(observed[keep], observed[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  p = stats.chisquare(obs, exp).pvalue
  assert p > 1e-3, f"chi-square p = {p:.2e}"


def _tail_engine(tiny_cfg, tiny_params, strategy, drafter=None, max_new=16, drafters=None):
  """Two rows, SD from two running rows with `strategy`; drafters: name -> drafter (None: the
  weightless ones and EAGLE from `drafter`)."""
  ec = engine_config(max_batch=2, max_prompt_len=8, max_new_tokens=max_new, sd_threshold=2,
                     prompt_widths=(8,))
  return RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                       drafters=drafter_set(drafter) if drafters is None else drafters,
                       tuner=FixedTuner(strategy))


# Each family alone and each pair of them are decoded exactly by the decode loop
# (tests/speculative/test_sd_greedy.py, test_sd_sampling.py); through the engine, which feeds
# each family its own inputs (the group's finished responses, the prompt, draft states kept
# across calls), one tree of every family and one without a trained drafter.
EVERY_FAMILY = "3,2,6," + "+".join(sorted(DRAFTERS))


@pytest.mark.parametrize("strategy", ["4,2,8,mtp+prompt_lookup", EVERY_FAMILY])
def test_every_family_and_hybrid_rollouts_return_plain_tokens(tiny_cfg, tiny_params, strategy):
  """Sampled GRPO-shaped groups (4 samples per prompt) decoded by SD from the first token:
  a hybrid tree of every registered family (their examples), and one of MTP heads and prompt
  lookup (no EAGLE drafter), return plain decoding's tokens."""
  sp = SamplingParams(1.0)
  ec = engine_config(max_batch=2, max_prompt_len=8, max_new_tokens=16, prompt_widths=(8,))
  plain = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec).generate(
      PROMPTS[:2], 4, sp, jax.random.key(3))
  drafts = Strategy.parse(strategy).drafts
  examples = example_drafters(tiny_cfg, seed=2)
  engine = _tail_engine(tiny_cfg, tiny_params, strategy,
                        drafters={n: examples[n] for n in drafts})
  assert set(engine.drafters) == set(drafts)
  res = engine.generate(PROMPTS[:2], 4, sp, jax.random.key(3))
  assert res.tokens == plain.tokens
  assert sum(r.mode == "sd" for r in res.timeline) > 3


def test_suffix_drafts_copy_the_groups_finished_responses(tiny_cfg, tiny_params):
  """Greedy samples of one prompt are identical: the pair decoded after the first pair has
  finished copies its responses (accepting whole chains), the first pair has nothing to copy
  from but its own text. Without a trained drafter, EAGLE arms are refused by name."""
  engine = _tail_engine(tiny_cfg, tiny_params, "4,1,5,suffix")
  res = engine.generate(PROMPTS[:1], 4, GREEDY, jax.random.key(0))
  assert len(set(map(tuple, res.tokens))) == 1
  starts = [i for i, r in enumerate(res.timeline) if r.mode == "prefill"]
  assert len(starts) == 2  # the first pair, then the second into the freed rows
  first = [r for r in res.timeline[:starts[1]] if r.mode == "sd"]
  second = [r for r in res.timeline[starts[1]:] if r.mode == "sd"]
  mean = lambda calls: sum(r.emitted for r in calls) / sum(r.row_iterations for r in calls)  # noqa
  assert mean(second) > 2 * mean(first)
  # 15 tokens after the first in 4 iterations: one with too short a suffix to match, then
  # three whole chains of 4 drafts + the bonus token.
  assert sum(r.iterations for r in second) == 4
  with pytest.raises(ValueError, match=r"draft with \['eagle'\], which were not given"):
    _tail_engine(tiny_cfg, tiny_params, "4,2,8,eagle+suffix")


@pytest.mark.parametrize("ladder", [(1,), (2, 1), (4,)])
def test_any_batch_ladder_gives_the_same_tokens(tiny_cfg, tiny_params, plain_reference, ladder):
  """Program batch sizes change where batches compact, not the tokens: greedy and sampled,
  plain and SD; only the ladder's sizes (and max_batch) get decode programs."""
  ec, ref = plain_reference
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12, sd_threshold=3,
                    eos_id=ec.eos_id, batch_sizes=ladder, prompt_widths=(8,))
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  res = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert res.tokens == ref.tokens and res.finish_reasons == ref.finish_reasons
  assert {r.bucket for r in res.timeline} <= {*ladder, 8}
  assert {k[4] for k in engine.pool if k[1] == "prefill"} == {8}  # one prompt width
  sampled = SamplingParams(0.9)
  plain = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), dataclasses.replace(
      ec, batch_sizes=(), prompt_widths=(), sd_threshold=0))
  assert (engine.generate(PROMPTS, 2, sampled, jax.random.key(3)).tokens
          == plain.generate(PROMPTS, 2, sampled, jax.random.key(3)).tokens)


def test_sizes_past_the_cap_count_as_the_cap():
  """A config that names its batch sizes and prompt widths keeps working when max_batch or
  max_prompt_len is lowered: a size past the cap is the cap, which is always one."""
  ec = engine_config(max_batch=4, max_prompt_len=64, batch_sizes=[8, 2],
                    prompt_widths=(128, 32))
  assert (ec.batch_sizes, ec.ladder, ec.prompt_widths) == ((2, 4), (2, 4), (32, 64))
  assert (ec.batch_for(3), ec.width_for(20), ec.width_for(40)) == (4, 32, 64)
  assert engine_config(max_prompt_len=64, prompt_widths=(128,)).width_for(5) == 64
  for bad in ({"batch_sizes": (0,)}, {"prompt_widths": (2.5,)}):
    with pytest.raises(ValueError, match="must be whole numbers of at least 1"):
      engine_config(**bad)


def test_the_compile_plan_compiles_every_program_before_the_rollout(tiny_cfg, tiny_params,
                                                                    plain_reference):
  """compile_plan queues every program a rollout of 7 prompts x 2 samples on one slice of 16
  rows runs, on two threads: the caches and the prefill, a plain program per ladder size
  (16, 8, 1), the compactions between them (3), and the tail's SD programs (batches 8 and 1);
  the rollout then compiles nothing and runs SD in its tail."""
  ec, ref = plain_reference
  ec = engine_config(max_batch=16, max_prompt_len=8, max_new_tokens=12, sd_threshold=8,
                    eos_id=ec.eos_id, batch_sizes=(8, 1), prompt_widths=(8,),
                    compile_ahead=True)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  pool_module.set_compile_threads(2)
  try:
    engine.compile_plan(GREEDY, len(PROMPTS), 2)
    pool_module.wait_for_compiles_ahead()
  finally:
    pool_module.set_compile_threads(1)
  ahead = {kind: line["ahead_programs"] for kind, line in engine.pool.report()["bill"].items()}
  assert ahead == {"rollout_caches": 1, "rollout_prefill": 1, "rollout_decode": 3,
                   "rollout_take": 3, "rollout_decode_sd": 2}
  res = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert res.tokens == ref.tokens
  assert res.pool["compiles"] == 0  # nothing on the critical path
  assert any(r.mode == "sd" for r in res.timeline)


def test_a_rollout_whose_tail_never_reached_sd_says_why(tiny_cfg, tiny_params, monkeypatch,
                                                        tmp_path, capsys):
  """Compiling ahead, a tail whose SD programs are never ready decodes plainly: no accept
  length, and the step's metrics, progress line and summary say SD was not reached, and why."""
  from tlt_jax.config import base_config
  from tlt_jax.rollout.engine import accept_length, sd_not_reached
  from tlt_jax.rollout.programs import SlicePrograms
  from tlt_jax.train_report import accept_shown, write_summary
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=12, sd_threshold=2,
                    compile_ahead=True)
  engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(1), ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, seed=2)),
                         tuner=FixedTuner((3, 2, 6)))
  monkeypatch.setattr(SlicePrograms, "decode_ready", lambda self, *args: False)
  res = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0), compile_priority=None)
  waited = [r for r in res.timeline if r.waited]
  assert waited and all(r.mode == "plain" and r.active <= 2 for r in waited)
  assert accept_length(res) is None
  reason = sd_not_reached(res)
  assert reason == (f"its SD programs were still compiling ahead (rollout.compile_ahead) in "
                    f"all {len(waited)} tail calls")
  metrics = {"sd_accept_len_mean": None, "sd_not_reached": reason}
  assert accept_shown(metrics) == "not reached"
  assert accept_shown({"sd_accept_len_mean": None}) == "off"
  row = {"step": 1, "reward_mean": 0.0, "accuracy": 0.0, "step_s": 1.0, "rollout_s": 1.0,
         "update_s": 0.0, "compile_s": 0.0, "drafter_steps": 0, "reclaimed_slice_s": 0.0,
         "idle_slice_s": 0.0, **metrics}
  summary = write_summary(str(tmp_path), [row], base_config(), wall_s=1.0)
  assert (summary["sd_not_reached_steps"], summary["sd_not_reached"]) == (1, reason)
  assert f"- (no SD call); SD not reached in 1 of 1 steps: {reason}" in capsys.readouterr().out
  # Once programs are ready, the same engine's tail runs SD.
  monkeypatch.undo()
  ready = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0), compile_priority=0)
  pool_module.wait_for_compiles_ahead()
  ready = engine.generate(PROMPTS, 2, GREEDY, jax.random.key(0))
  assert accept_length(ready) is not None and sd_not_reached(ready) is None
  assert ready.tokens == res.tokens
