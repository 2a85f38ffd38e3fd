"""Qwen3 (dense) against transformers' own Qwen3, on random tiny models that transformers
makes: untied and tied embeddings, head_dim 16 where hidden / heads is 12 or 8, per-head q/k
norms with non-trivial weights. The folder loads with its tokenizer and chat template; the
export round trip is exact; prefill and tree verify through the Pallas kernel (interpreted)
give transformers' logits; greedy generation through the engine, plain and with SD, is
transformers' greedy decoding; a GRPO step's log-probs and update are transformers'; a
drafter for the policy warms up, spot-trains, exports and loads. (Prefill and decode logits
of the reference path: tests/models/test_hf_parity.py; folders that cannot run:
tests/models/test_hf_io.py; GGUF: tests/models/test_gguf_import.py.)"""

import functools
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.engines import engine_config
from tests.models import hf_fixtures
from tests.speculative.drafters import drafter_set
from tlt_jax.drafter_training.spot import SpotConfig, SpotTrainer
from tlt_jax.drafter_training.train_step import DrafterOptConfig
from tlt_jax.drafter_training.warmup import collect_samples, train_drafter
from tlt_jax.mesh import DEFAULT_RULES, make_mesh, shard_pytree
from tlt_jax.models import init_cache, param_logical_axes, prefill, verify
from tlt_jax.models.attention_inputs import ancestor_mask, tree_depths
from tlt_jax.drafters.eagle.network import DrafterConfig, init_drafter_params
from tlt_jax.drafters.io import load_drafter, save_drafter
from tlt_jax.models.hf import load_hf_config, load_hf_params, load_tokenizer, save_hf_checkpoint
from tlt_jax.rl.algorithms import Grpo
from tlt_jax.rl.loss import LossConfig
from tlt_jax.rl.policy_update import PolicyUpdater, build_rows, make_log_probs, split_minibatches
from tlt_jax.rl.tokenizer import prompt_ids
from tlt_jax.rollout.engine import RolloutEngine, accept_length
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.tuner import FixedTuner

TOL = 1e-4
MESSAGES = ("ab a", "b a b ab", "a")
NEW_TOKENS = 16
GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module", params=["untied", "tied"])
def qwen3(request, tmp_path_factory):
  """A random tiny Qwen3 folder (transformers' model and a Qwen tokenizer with a chat
  template), the torch model, and tlt_jax's config and params loaded from the folder."""
  path = str(tmp_path_factory.mktemp(f"qwen3-{request.param}"))
  model = hf_fixtures.save_random_model(hf_fixtures.qwen3_config(request.param == "tied"), path)
  hf_fixtures.save_chat_tokenizer(path)
  cfg = load_hf_config(path, attention_impl="reference")
  tokenizer = load_tokenizer(path)
  return types.SimpleNamespace(
      name=request.param, path=path, torch=model, cfg=cfg, params=load_hf_params(path, cfg),
      tokenizer=tokenizer, prompts=[prompt_ids(tokenizer, m) for m in MESSAGES])


def _torch_logits(model, ids) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def hf_greedy(qwen3):
  """transformers' greedy continuation of each prompt (NEW_TOKENS tokens, no EOS) and the
  smallest gap between the chosen logit and the runner-up over all of them."""
  out, gap = [], np.inf
  for p in qwen3.prompts:
    ids = list(p)
    for _ in range(NEW_TOKENS):
      last = _torch_logits(qwen3.torch, ids)[-1]
      top2 = np.sort(last)[-2:]
      ids.append(int(last.argmax()))
      gap = min(gap, float(top2[1] - top2[0]))
    out.append(ids[len(p):])
  return types.SimpleNamespace(tokens=out, gap=gap)


def test_the_folder_loads_with_its_architecture_tokenizer_and_chat_template(qwen3):
  cfg = qwen3.cfg
  assert (cfg.model_type, cfg.qk_norm, cfg.qkv_bias) == ("qwen3", True, False)
  assert cfg.tie_embeddings == (qwen3.name == "tied")
  assert cfg.head_dim * cfg.num_heads != cfg.hidden_size
  layer = qwen3.params["layers"]["self_attn"]
  assert layer["q_norm"]["weight"].shape == layer["k_norm"]["weight"].shape == (
      cfg.num_layers, cfg.head_dim)
  assert ("lm_head" in qwen3.params) == (qwen3.name == "untied")
  hf_tokenizer = AutoTokenizer.from_pretrained(qwen3.path, local_files_only=True)
  assert type(qwen3.tokenizer).__name__ == "Qwen2Tokenizer"
  for message, ids in zip(MESSAGES, qwen3.prompts):
    want = hf_tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                            add_generation_prompt=True, tokenize=True)
    assert ids == list(want["input_ids"])
    assert ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_the_export_round_trip_is_exact(qwen3, tmp_path):
  """Loaded and exported again: the same tensors bit for bit, transformers loads the export
  as a Qwen3 and computes the same logits, tlt_jax loads it back to the same config and
  params, and the tokenizer and chat template come along."""
  out = str(tmp_path / "export")
  save_hf_checkpoint(out, qwen3.params, qwen3.cfg, qwen3.tokenizer)
  original = load_file(os.path.join(qwen3.path, "model.safetensors"))
  exported = load_file(os.path.join(out, "model.safetensors"))
  assert set(exported) == set(original)
  assert ("lm_head.weight" in exported) == (qwen3.name == "untied")  # a tied head: not written
  assert any(".self_attn.q_norm.weight" in name for name in exported)
  for name, value in exported.items():
    np.testing.assert_array_equal(value, original[name], err_msg=name)

  model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
  assert type(model).__name__ == "Qwen3ForCausalLM"
  ids = qwen3.prompts[1] + list(range(5, 25))
  np.testing.assert_array_equal(_torch_logits(model, ids), _torch_logits(qwen3.torch, ids))

  assert load_hf_config(out, attention_impl="reference") == qwen3.cfg
  back = load_hf_params(out, qwen3.cfg)
  assert jax.tree.structure(back) == jax.tree.structure(qwen3.params)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back, qwen3.params)
  tokenizer = load_tokenizer(out)
  assert tokenizer.chat_template == qwen3.tokenizer.chat_template
  assert [prompt_ids(tokenizer, m) for m in MESSAGES] == qwen3.prompts


def test_prefill_and_tree_verify_through_the_kernel_match_transformers(qwen3):
  """attention_impl='pallas_interpret' (the Pallas kernel, interpreted on CPU): the prompts'
  logits and every node of a branching draft tree equal transformers' logits of the prompt
  followed by the node's root-to-node path."""
  cfg = qwen3.cfg.replace(attention_impl="pallas_interpret")
  prompts = qwen3.prompts
  lengths = np.asarray([len(p) for p in prompts], np.int32)
  tokens = np.zeros((len(prompts), lengths.max()), np.int32)
  for b, p in enumerate(prompts):
    tokens[b, :len(p)] = p
  cache = init_cache(cfg, len(prompts), 64)
  logits, _, cache = jax.jit(functools.partial(prefill, cfg=cfg))(
      qwen3.params, jnp.asarray(tokens), jnp.asarray(lengths), cache)
  parents = np.asarray([[-1, 0, 0, 1, 1, 2, 3, 0]] * len(prompts), np.int32)
  tree = np.random.default_rng(5).integers(0, cfg.vocab_size, parents.shape).astype(np.int32)
  mask = ancestor_mask(jnp.asarray(parents))
  tree_logits, _, _ = jax.jit(functools.partial(verify, cfg=cfg))(
      qwen3.params, jnp.asarray(tree), tree_depths(mask), mask, cache)
  worst = 0.0
  for b, p in enumerate(prompts):
    ref = _torch_logits(qwen3.torch, p)
    np.testing.assert_allclose(np.asarray(logits[b, :len(p)]), ref, atol=TOL, rtol=0)
    worst = max(worst, float(np.abs(np.asarray(logits[b, :len(p)]) - ref).max()))
    for i in range(parents.shape[1]):
      path = np.flatnonzero(np.asarray(mask[b, i]))  # root ... node i
      # The root is the newest token, not yet in the cache: it follows the prompt.
      ref = _torch_logits(qwen3.torch, p + tree[b, path].tolist())[-1]
      np.testing.assert_allclose(np.asarray(tree_logits[b, i]), ref, atol=TOL, rtol=0,
                                 err_msg=f"row {b} node {i}")
      worst = max(worst, float(np.abs(np.asarray(tree_logits[b, i]) - ref).max()))
  print(f"qwen3 {qwen3.name}, Pallas kernel (interpreted): max |logit diff| vs "
        f"transformers = {worst:.2e}")


def _engine(qwen3, mesh, drafter=None, **kw):
  kw.setdefault("prompt_widths", (32,))  # one prefill width: fewer programs, the same tokens
  ec = engine_config(max_batch=4, max_prompt_len=32, max_new_tokens=NEW_TOKENS,
                    sd_threshold=4 if drafter else 0, **kw)
  if drafter is None:
    return RolloutEngine(qwen3.cfg, qwen3.params, mesh, ec, log_features=True)
  return RolloutEngine(qwen3.cfg, qwen3.params, mesh, ec, drafters=drafter_set(drafter),
                       tuner=FixedTuner((3, 2, 6)))


def _one_device():
  return make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


@pytest.fixture(scope="module")
def drafter(qwen3, hf_greedy):
  """An EAGLE drafter (one Qwen3 layer, q/k norms included) warmed up on the policy's
  features over its greedy responses, with the warm-up's losses."""
  samples = collect_samples(qwen3.params, qwen3.cfg, qwen3.prompts, hf_greedy.tokens,
                            batch_size=4)
  dcfg = DrafterConfig()
  params, history = train_drafter(
      {"eagle": init_drafter_params(qwen3.cfg, dcfg, jax.random.key(1))}, qwen3.params, samples,
      qwen3.cfg, {"eagle": dcfg}, DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=5),
      steps=40, window=32, batch_rows=3, progress=False)
  return dcfg, params["eagle"], [m["loss"] for m in history]


@pytest.mark.slow
def test_greedy_generation_through_the_engine_is_transformers_plain_and_with_sd(
    qwen3, hf_greedy, drafter):
  """3 prompts x 2 samples on 4 rows (refills, compaction): plain decoding and SD on every
  decode call (the warmed-up drafter) both emit transformers' greedy tokens."""
  assert hf_greedy.gap > 1e-3  # no near-ties for float32 sums in another order to flip
  want = [t for t in hf_greedy.tokens for _ in range(2)]
  plain = _engine(qwen3, _one_device()).generate(qwen3.prompts, 2, GREEDY, jax.random.key(0))
  assert plain.tokens == want
  assert {r.mode for r in plain.timeline} == {"prefill", "plain"}
  sd = _engine(qwen3, _one_device(), drafter[:2]).generate(qwen3.prompts, 2, GREEDY,
                                                            jax.random.key(0))
  assert sd.tokens == want
  assert {r.mode for r in sd.timeline} == {"prefill", "sd"}
  accepted = accept_length(sd)
  assert accepted > 1.0  # drafts were accepted: the acceptance path ran, not only the bonus
  print(f"qwen3 {qwen3.name}: {sum(map(len, want))} greedy tokens identical plain and with SD "
        f"({accepted:.2f} tokens per row and SD iteration; smallest top-2 logit gap "
        f"{hf_greedy.gap:.1e})")


@pytest.mark.slow
def test_the_drafter_warms_up_spot_trains_exports_and_loads(qwen3, hf_greedy, drafter,
                                                            tmp_path):
  """The warm-up lowered the drafter's loss; spot training on the idle slice of a 2-slice
  rollout updates it without touching the rollout; the export holds its q/k norms and
  loads back exactly."""
  dcfg, params, losses = drafter
  assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5]), losses
  layer = params["layer_0"]["self_attn"]
  assert layer["q_norm"]["weight"].shape == (qwen3.cfg.head_dim,)
  assert "input_layernorm" not in params["layer_0"]  # EAGLE's first layer

  mesh = make_mesh({"replica": 2, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
  ec = engine_config(max_batch=1, max_prompt_len=32, max_new_tokens=48, sd_threshold=0)
  engine = RolloutEngine(qwen3.cfg, qwen3.params, mesh, ec, log_features=True)
  spot = SpotTrainer(qwen3.cfg, {"eagle": dcfg},
                     DrafterOptConfig(learning_rate=1e-3, lr_warmup_steps=1), {"eagle": params},
                     mesh, SpotConfig(window=32, windows=4, batch_rows=2))
  spot.precompile(engine.slices, engine.policy_on)
  spot.begin(0, engine.policy_on)
  res = engine.generate(qwen3.prompts, 1, GREEDY, jax.random.key(0),
                        on_slice_idle=spot.on_slice_idle)
  metrics = spot.finish()
  # Spot training never touches the rollout: it is the policy's greedy decoding.
  assert [t[:NEW_TOKENS] for t in res.tokens] == hf_greedy.tokens
  assert metrics["drafter_steps"] >= 1 and metrics["drafter_tokens"] > 0
  trained = jax.device_get(spot.params["eagle"])
  assert not np.allclose(trained["layer_0"]["self_attn"]["q_norm"]["weight"],
                         np.asarray(layer["q_norm"]["weight"]))

  out = str(tmp_path / "drafter")
  save_drafter(out, "eagle", dcfg, trained, qwen3.cfg)
  names = set(load_file(os.path.join(out, "model.safetensors")))
  assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= names
  _, dcfg_back, back = load_drafter(out, qwen3.cfg, expect="eagle")
  assert dcfg_back == dcfg
  assert jax.tree.structure(back) == jax.tree.structure(trained)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               back, trained)


def _grpo_batch(qwen3):
  """Two prompts with two sampled-looking completions each, GRPO advantages, as the policy
  update lays them out ([mini-batches, micro-batches, rows, T])."""
  rng = np.random.default_rng(7)
  prompts = [qwen3.prompts[0]] * 2 + [qwen3.prompts[1]] * 2
  completions = [rng.integers(3, qwen3.cfg.vocab_size, n).tolist() for n in (9, 4, 12, 6)]
  advantages = np.asarray([1.0, -1.0, 0.5, -0.5], np.float32)
  return prompts, completions, advantages


def _torch_log_probs(model, tokens, targets, mask):
  logits = model(torch.tensor(tokens)).logits
  logp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(targets)[..., None])[..., 0]
  return logp * torch.tensor(mask)


@pytest.mark.slow
def test_a_grpo_step_is_transformers(qwen3, tmp_path):
  """One GRPO update (SGD, so that the step is the gradient) through the training forward
  (untied: scanned layers, full remat, attention over 8 queries at a time; tied: the layer
  loop with 'dots' remat): its log-probs before and after the step, and the step itself, are
  what transformers computes for the same loss on the same batch."""
  lr = 0.5
  variant = (dict(scan_layers=True, remat="full", attention_query_chunk=8)
             if qwen3.name == "untied" else dict(remat="dots"))
  cfg = qwen3.cfg.replace(**variant)
  prompts, completions, advantages = _grpo_batch(qwen3)
  rows = build_rows(prompts, completions, {"advantages": advantages}, 4, pad_id=0)
  algorithm = Grpo(loss=LossConfig(sampling=SamplingParams(1.0)))
  batch = split_minibatches(rows, 1, 4, algorithm.loss_weights)
  flat = {k: jnp.asarray(batch[k][0]) for k in ("tokens", "targets", "loss_mask")}
  log_probs = make_log_probs(cfg, SamplingParams(1.0))

  model = hf_fixtures.MODEL_CLASSES["qwen3"].from_pretrained(qwen3.path).train(False)
  torch_before = _torch_log_probs(model, rows["tokens"], rows["targets"], rows["loss_mask"])
  ours_before = np.asarray(log_probs(qwen3.params, flat))[0]
  np.testing.assert_allclose(ours_before, torch_before.detach().numpy(), atol=TOL, rtol=0)

  # The same loss in torch: one update, so the ratio is 1 and its gradient is the log-prob's.
  logp = torch_before
  ratio = torch.exp(logp - logp.detach())
  mask = torch.tensor(rows["loss_mask"], dtype=torch.float32)
  per_row = (-ratio * torch.tensor(advantages)[:, None] * mask).sum(1) / mask.sum(1).clamp(min=1)
  loss = (torch.tensor(batch["weight"][0, 0]) * per_row).sum()
  loss.backward()
  with torch.no_grad():
    for p in model.parameters():
      p -= lr * p.grad

  mesh = _one_device()
  start = shard_pytree(jax.tree.map(jnp.copy, qwen3.params), param_logical_axes(cfg), mesh,
                       DEFAULT_RULES)
  updater = PolicyUpdater(cfg, algorithm, optax.sgd(lr), start, mesh, DEFAULT_RULES, ppo_epochs=1,
                          mini_batches=1, micro_batch_rows=4)
  new, metrics, _ = updater(start, prompts, completions, {"advantages": advantages}, 0,
                            max_width=64)
  assert metrics["nonfinite"] == 0.0
  np.testing.assert_allclose(metrics["loss"], float(loss.detach()), rtol=1e-5)
  out = str(tmp_path / "updated")
  save_hf_checkpoint(out, jax.device_get(new), cfg)
  ours = load_file(os.path.join(out, "model.safetensors"))
  theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
  before = load_file(os.path.join(qwen3.path, "model.safetensors"))
  for name, value in ours.items():
    step, want = value - before[name], theirs[name] - before[name]
    assert np.abs(want).max() > 0, name  # every weight moved (the q/k norms included)
    np.testing.assert_allclose(step, want, atol=1e-4 * np.abs(want).max(), rtol=0,
                               err_msg=name)
  after = _torch_log_probs(model, rows["tokens"], rows["targets"], rows["loss_mask"])
  np.testing.assert_allclose(np.asarray(log_probs(new, flat))[0], after.detach().numpy(),
                             atol=TOL, rtol=0)
