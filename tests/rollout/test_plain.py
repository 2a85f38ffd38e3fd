"""generate_plain: greedy equals step-by-step argmax decoding, stops at EOS, ragged prompts;
sampled, it draws what the rollout engine draws for the same requests and key."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import decode, init_cache, prefill
from tlt_jax.rollout import plain
from tlt_jax.rollout.plain import generate_plain
from tlt_jax.speculative.sampling import SamplingParams

PROMPTS = [[5, 9, 3, 7], [11], [2, 4, 6, 8, 10, 12, 14], [30, 31]]
MAX_NEW = 10
GREEDY = SamplingParams(0.0)


def _argmax_decode(params, cfg, prompt, steps):
  """One sequence alone, no padding, a Python loop of decode calls."""
  cache = init_cache(cfg, 1, len(prompt) + steps)
  logits, _, cache = jax.jit(functools.partial(prefill, cfg=cfg))(
      params, jnp.asarray([prompt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32), cache)
  tok = jnp.argmax(logits[:, len(prompt) - 1], axis=-1).astype(jnp.int32)
  out = [int(tok[0])]
  step = jax.jit(functools.partial(decode, cfg=cfg))
  for _ in range(steps - 1):
    logits, _, cache = step(params, tok, cache)
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    out.append(int(tok[0]))
  return out


@pytest.fixture(scope="module")
def reference(tiny_cfg, tiny_params):
  return [_argmax_decode(tiny_params, tiny_cfg, p, MAX_NEW) for p in PROMPTS]


def test_greedy_matches_stepwise_argmax(tiny_cfg, tiny_params, reference):
  eos = tiny_cfg.vocab_size + 5  # never produced: every row runs to max_new_tokens
  out = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, GREEDY, jax.random.key(0))
  assert out == reference


def test_stops_at_eos(tiny_cfg, tiny_params, reference):
  eos = reference[0][3]
  out = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, GREEDY, jax.random.key(0))
  with_eos = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, GREEDY,
                            jax.random.key(0), include_eos=True)
  for ref, got, got_eos in zip(reference, out, with_eos):
    if eos in ref:
      cut = ref.index(eos)
      assert got == ref[:cut] and got_eos == ref[:cut + 1]
    else:
      assert got == got_eos == ref
  assert len(out[0]) <= 3


def test_one_compilation_per_padded_shape(tiny_cfg, tiny_params):
  before = plain._generate._cache_size()
  generate_plain(tiny_params, tiny_cfg, [[1, 2], [3]], 4, 0, GREEDY, jax.random.key(0))
  generate_plain(tiny_params, tiny_cfg, [[4], [5, 6, 7]], 4, 0, GREEDY, jax.random.key(1))
  assert plain._generate._cache_size() == before + 1  # same padded shape: compiled once


def test_sampling_is_reproducible_and_valid(tiny_cfg, tiny_params):
  run = lambda seed: generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW,  # noqa: E731
                                    tiny_cfg.vocab_size + 1, SamplingParams(1.0),
                                    jax.random.key(seed))
  a, b, c = run(0), run(0), run(1)
  assert a == b and a != c
  assert all(len(r) == MAX_NEW and all(0 <= t < tiny_cfg.vocab_size for t in r) for r in a)


def test_sampled_completions_are_the_engines(tiny_cfg, tiny_params):
  """One sampler: prompt i is request i, so the engine with the same key, whatever its
  batching, samples the same tokens."""
  from tlt_jax.mesh import make_mesh
  from tlt_jax.rollout.engine import EngineConfig, RolloutEngine
  sp = SamplingParams(1.0, top_k=20)
  eos = tiny_cfg.vocab_size + 1
  out = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, sp, jax.random.key(3))
  engine = RolloutEngine(tiny_cfg, tiny_params, make_mesh({"replica": 1}, jax.devices()[:1]),
                         EngineConfig(max_batch=2, max_prompt_len=8, max_new_tokens=MAX_NEW,
                                      sd_threshold=0, eos_id=eos))
  assert engine.generate(PROMPTS, 1, sp, jax.random.key(3)).tokens == out


def test_bad_inputs_are_named(tiny_cfg, tiny_params):
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate_plain(tiny_params, tiny_cfg, [[1], []], 4, 0, GREEDY, jax.random.key(0))
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    generate_plain(tiny_params, tiny_cfg, [[1]], 0, 0, GREEDY, jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    generate_plain(tiny_params, tiny_cfg, [[1]], 1000, 0, GREEDY, jax.random.key(0))
