"""generate_plain: greedy equals step-by-step argmax decoding, stops at EOS, ragged prompts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tlt_jax.models import decode, init_cache, prefill
from tlt_jax.rollout import plain
from tlt_jax.rollout.plain import generate_plain, sample_next

PROMPTS = [[5, 9, 3, 7], [11], [2, 4, 6, 8, 10, 12, 14], [30, 31]]
MAX_NEW = 10


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
  out = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, 0.0, jax.random.key(0))
  assert out == reference


def test_stops_at_eos(tiny_cfg, tiny_params, reference):
  eos = reference[0][3]
  out = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, 0.0, jax.random.key(0))
  with_eos = generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW, eos, 0.0,
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
  generate_plain(tiny_params, tiny_cfg, [[1, 2], [3]], 4, 0, 0.0, jax.random.key(0))
  generate_plain(tiny_params, tiny_cfg, [[4], [5, 6, 7]], 4, 0, 0.0, jax.random.key(1))
  assert plain._generate._cache_size() == before + 1  # same padded shape: compiled once


def test_sampling_is_reproducible_and_valid(tiny_cfg, tiny_params):
  run = lambda seed: generate_plain(tiny_params, tiny_cfg, PROMPTS, MAX_NEW,  # noqa: E731
                                    tiny_cfg.vocab_size + 1, 1.0, jax.random.key(seed))
  a, b, c = run(0), run(0), run(1)
  assert a == b and a != c
  assert all(len(r) == MAX_NEW and all(0 <= t < tiny_cfg.vocab_size for t in r) for r in a)


def test_sample_next():
  logits = jnp.array([[0.0, 5.0, 1.0], [3.0, -1.0, 2.0]])
  assert sample_next(logits, jax.random.key(0), 0.0).tolist() == [1, 0]
  draws = np.stack([np.asarray(sample_next(logits, k, 1.0))
                    for k in jax.random.split(jax.random.key(0), 200)])
  assert set(draws[:, 1].tolist()) > {0}  # sampling visits more than the argmax


def test_bad_inputs_are_named(tiny_cfg, tiny_params):
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate_plain(tiny_params, tiny_cfg, [[1], []], 4, 0, 0.0, jax.random.key(0))
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    generate_plain(tiny_params, tiny_cfg, [[1]], 0, 0, 0.0, jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
    generate_plain(tiny_params, tiny_cfg, [[1]], 1000, 0, 0.0, jax.random.key(0))
