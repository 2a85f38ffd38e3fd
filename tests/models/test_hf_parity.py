"""Logit parity with transformers' PyTorch Qwen2, Llama and Qwen3 (untied and tied) on
ragged prompts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.models import hf_fixtures
from tlt_jax.models import decode, init_cache, prefill
from tlt_jax.models.hf import load_hf_config, load_hf_params

PROMPT_LENS = (5, 11, 1, 8)
DECODE_STEPS = 8
TOL = 1e-4


HF_CONFIGS = {"qwen2": hf_fixtures.qwen2_config, "llama": hf_fixtures.llama_config,
              "qwen3": hf_fixtures.qwen3_config,
              "qwen3-tied": lambda: hf_fixtures.qwen3_config(tied=True)}


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def hf_model(request, tmp_path_factory):
  path = str(tmp_path_factory.mktemp(request.param))
  model = hf_fixtures.save_random_model(HF_CONFIGS[request.param](), path)
  return request.param, path, model


def _torch_logits(model, ids):
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].float().numpy()


def test_prefill_and_decode_match_transformers(hf_model):
  name, path, torch_model = hf_model
  cfg = load_hf_config(path)
  assert cfg.model_type == name.removesuffix("-tied")
  params = load_hf_params(path, cfg)
  rng = np.random.default_rng(0)
  seqs = [rng.integers(0, hf_fixtures.VOCAB, n + DECODE_STEPS).tolist() for n in PROMPT_LENS]
  width = max(PROMPT_LENS)
  tokens = np.zeros((len(seqs), width), np.int32)
  for b, (s, n) in enumerate(zip(seqs, PROMPT_LENS)):
    tokens[b, :n] = s[:n]

  cache = init_cache(cfg, len(seqs), width + DECODE_STEPS)
  logits, _, cache = jax.jit(functools.partial(prefill, cfg=cfg))(
      params, jnp.asarray(tokens), jnp.asarray(PROMPT_LENS, jnp.int32), cache)
  step = jax.jit(functools.partial(decode, cfg=cfg))
  decoded = []
  for k in range(DECODE_STEPS):
    next_tokens = jnp.asarray([s[n + k] for s, n in zip(seqs, PROMPT_LENS)], jnp.int32)
    step_logits, _, cache = step(params, next_tokens, cache)
    decoded.append(np.asarray(step_logits))
  np.testing.assert_array_equal(np.asarray(cache.lengths),
                                np.asarray(PROMPT_LENS) + DECODE_STEPS)

  worst = 0.0
  for b, (s, n) in enumerate(zip(seqs, PROMPT_LENS)):
    ref = _torch_logits(torch_model, s)
    ours = np.concatenate([np.asarray(logits[b, :n]), np.stack([d[b] for d in decoded])], 0)
    # ours[n + k] comes from decoding token s[n + k], i.e. HF's logits at that position.
    np.testing.assert_allclose(ours[:n], ref[:n], atol=TOL, rtol=0)
    np.testing.assert_allclose(ours[n:], ref[n:n + DECODE_STEPS], atol=TOL, rtol=0)
    worst = max(worst, float(np.abs(ours - ref[:n + DECODE_STEPS]).max()))
  print(f"{name}: max |logit diff| vs transformers = {worst:.2e}")
