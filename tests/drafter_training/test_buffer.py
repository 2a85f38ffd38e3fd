"""The feature log and the hidden-state buffer: the policy's own features, kept on device,
packed into windows whose samples never mix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.engines import engine_config
from tests.speculative.drafters import drafter_set, oracle_drafter, random_drafter
from tlt_jax.drafter_training.buffer import FeatureBuffer
from tlt_jax.mesh import make_mesh, replica_slices
from tlt_jax.models import init_cache, prefill
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.rollout.feature_log import FeatureBlock
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14, 15], [3, 3], [20, 1]]


@functools.partial(jax.jit, static_argnames="cfg")
def _prefill_features(params, tokens, lengths, cfg):
  return prefill(params, tokens, lengths, init_cache(cfg, 1, tokens.shape[1]), cfg)[1]


def _policy_features(cfg, params, seq, width=32):
  """The policy's features of `seq`, prefilled padded to one width (one compile for all)."""
  n = len(seq)
  tokens = np.zeros((1, width), np.int32)
  tokens[0, :n] = seq
  feats = _prefill_features(params, jnp.asarray(tokens), jnp.asarray([n]), cfg)
  return np.asarray(feats[0, :n])


@pytest.mark.parametrize("threshold", [0, 2])  # plain decoding only; plain then SD
def test_logged_features_are_the_policys_own(tiny_cfg, tiny_params, threshold):
  mesh = make_mesh({"replica": 2, "fsdp": 2, "tensor": 1}, jax.devices()[:4])
  # max_batch 2 < requests per slice: rows are refilled and compacted while logging. One
  # prefill width: a slice of two devices holds collectives, so its programs compile anew on
  # CPU (tlt_jax.compile_cache.guard_cpu_collectives), and the width changes no token.
  ec = engine_config(max_batch=2, max_prompt_len=8, max_new_tokens=10, sd_threshold=threshold,
                    eos_id=7, prompt_widths=(8,))
  engine = RolloutEngine(tiny_cfg, tiny_params, mesh, ec,
                         drafters=drafter_set(random_drafter(tiny_cfg, 3)),
                         tuner=FixedTuner((3, 2, 6)), log_features=True)
  logged = {0, 3, 4, 8, 9, 13}
  res = engine.generate(PROMPTS, 2, SamplingParams(0.0), jax.random.key(0), log_requests=logged)
  plain = RolloutEngine(tiny_cfg, tiny_params, mesh, ec).generate(
      PROMPTS, 2, SamplingParams(0.0), jax.random.key(0))
  assert res.tokens == plain.tokens  # logging changes nothing
  if threshold:
    assert any(r.mode == "sd" for r in res.timeline)
  seen = set()
  for s, block in enumerate(res.feature_blocks):
    assert {d.id for d in block.features.devices()} == {d.id for d in engine.slices[s].devices.flat}
    feats = np.asarray(block.features)
    assert feats.shape[1:] == (ec.capacity, tiny_cfg.feature_size)
    for i, rid in enumerate(block.request_ids):
      seq = block.sequences[i]
      assert seq.tolist() == PROMPTS[rid // 2] + res.tokens[rid]
      n = len(seq) - 1  # every token but the last was fed to the policy
      np.testing.assert_allclose(feats[i, :n], _policy_features(tiny_cfg, tiny_params, seq[:n]),
                                 atol=2e-5)
      assert not feats[i, n:].any()
    seen |= set(block.request_ids)
  assert seen == logged


def test_an_accepted_path_cut_by_eos_or_the_budget_logs_only_what_the_response_holds(
    tiny_cfg, tiny_params):
  """An oracle drafter's paths of 5 nodes overshoot EOS and the 12-token budget: the
  committed nodes past the cut are in no response, and their features are not logged."""
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12)
  plain = RolloutEngine(tiny_cfg, tiny_params, mesh, ec).generate(
      PROMPTS, 1, SamplingParams(0.0), jax.random.key(0))
  tokens, counts = np.unique(np.concatenate([t[3:] for t in plain.tokens]), return_counts=True)
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=12, sd_threshold=8,
                    eos_id=int(tokens[counts.argmax()]))  # a token that ends some responses
  engine = RolloutEngine(tiny_cfg, tiny_params, mesh, ec,
                         drafters=drafter_set(oracle_drafter(tiny_cfg, tiny_params)),
                         tuner=FixedTuner((4, 1, 5)), log_features=True)
  res = engine.generate(PROMPTS, 1, SamplingParams(0.0), jax.random.key(0))
  assert {"eos", "length"} == set(res.finish_reasons)
  block, = res.feature_blocks
  feats = np.asarray(block.features)
  for i in range(len(block)):
    n = len(block.sequences[i]) - 1
    assert feats[i, :n].any(axis=-1).all() and not feats[i, n:].any()


def _synthetic_blocks(rng, mesh, count, width=6):
  blocks = []
  for b in range(count):
    lengths = rng.integers(3, 30, 3)
    feats = rng.normal(size=(4, 32, width)).astype(np.float32)
    blocks.append(FeatureBlock(
        features=jax.device_put(feats, jax.sharding.NamedSharding(mesh,
                                                                  jax.sharding.PartitionSpec())),
        request_ids=list(range(3)),
        sequences=[rng.integers(0, 50, n).astype(np.int32) for n in lengths],
        prompt_lens=[int(rng.integers(1, 3)) for _ in lengths]))
  return blocks


def test_buffer_windows_never_mix_samples_and_keep_recent_steps():
  rollout_slices = replica_slices(make_mesh({"replica": 4, "fsdp": 2, "tensor": 1}))
  rng = np.random.default_rng(0)
  buffer = FeatureBuffer(keep_steps=2)
  for step in range(3):
    for s in range(2):
      for block in _synthetic_blocks(rng, rollout_slices[s], 1):
        buffer.add(step, block)
  assert buffer.steps == [1, 2]  # step 0 dropped
  blocks = buffer.blocks()
  target = rollout_slices[3]  # a different slice than the blocks live on
  windows, real = buffer.windows_on(target, window=16, rows=24, rng=rng)
  assert {d.id for d in windows.features.devices()} <= {d.id for d in target.devices.flat}
  w = jax.device_get(windows)
  used = 0
  for r in range(w.tokens.shape[0]):
    for seg in set(w.segment_ids[r][w.segment_ids[r] > 0].tolist()):
      at = w.segment_ids[r] == seg
      toks, feats, pos = w.tokens[r][at], w.features[r][at], w.positions[r][at]
      np.testing.assert_array_equal(pos, np.arange(at.sum()))
      # The segment is one contiguous chunk of exactly one sequence, features included.
      matches = []
      for block in blocks:
        f = np.asarray(block.features)
        for i, seq in enumerate(block.sequences):
          n = len(seq) - 1
          for start in range(0, n, 16):
            if (n - start >= len(toks) and np.array_equal(seq[start:start + len(toks)], toks)
                and np.allclose(f[i, start:start + len(toks)], feats)):
              matches.append((i, start))
              mask = w.loss_mask[r][at]
              np.testing.assert_array_equal(
                  mask, np.arange(start, start + len(toks)) >= block.prompt_lens[i] - 1)
      assert len(matches) >= 1
      used += len(toks)
    assert not w.features[r][w.segment_ids[r] == 0].any()  # padding stays zero
  total = sum(len(seq) - 1 for b in blocks for seq in b.sequences)
  assert used == total and real < 24  # 24 rows hold every sample here, with rows to spare
