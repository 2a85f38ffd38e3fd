"""The drafter families by name: MTP heads learn and export as their family, prompt lookup
copies from the prompt, trained families train together exactly as alone, and a run's
drafters come from its config (a weightless-only run needs no EAGLE drafter)."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import REPO
from tests.drafter_training.test_loss import _samples
from tests.speculative.drafters import random_drafter, random_mtp
from tlt_jax.components import load_drafters_for, make_engine, run_drafters, validate_config
from tlt_jax.config import ConfigError, base_config
from tlt_jax.drafter_training.train_step import (DrafterOptConfig, init_train_state,
                                                 jit_train_step)
from tlt_jax.drafter_training.windows import pack_windows
from tlt_jax.drafters import (DRAFTERS, DraftContext, MtpDrafter, PromptLookupDrafter,
                              param_count)
from tlt_jax.drafters.mtp import MtpSettings
from tlt_jax.drafters.prompt_lookup import PromptLookupSettings
from tlt_jax.mesh import make_mesh
from tlt_jax.models import ModelConfig, Policy
from tlt_jax.drafters.io import load_drafter, save_drafter
from tlt_jax.models.hf import load_hf_config
from tlt_jax.speculative.strategy import Strategy


def _batch(cfg, params):
  return jax.tree.map(jnp.asarray, pack_windows(
      _samples(cfg, params, [12, 9, 15, 7, 10], seed=2), window=16))


def test_mtp_heads_learn_the_policys_next_tokens(tiny_cfg, tiny_params):
  """On a fixed buffer the heads' loss falls and head 0's top-1 agreement rises; an untrained
  head reads like the policy's own head (identity on the feature)."""
  mtp = random_mtp(tiny_cfg, seed=1, num_heads=3)
  fresh = MtpDrafter.init_params(mtp.settings, tiny_cfg, jax.random.key(0))
  np.testing.assert_array_equal(fresh["head_0"]["fc"]["kernel"][:tiny_cfg.hidden_size],
                                np.eye(tiny_cfg.hidden_size))
  assert not np.any(fresh["head_2"]["res"]["kernel"])
  batch = _batch(tiny_cfg, tiny_params)
  policy = Policy(tiny_params, tiny_cfg)
  first, first_aux = mtp.loss(policy, batch)
  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=5)
  step = jit_train_step(tiny_cfg, {"mtp": mtp.settings}, oc)
  state = init_train_state({"mtp": mtp.params}, oc)
  for _ in range(60):
    state, metrics = step(state, tiny_params, batch)
  last, aux = mtp.replace(params=state.params["mtp"]).loss(policy, batch)
  assert float(last) < 0.7 * float(first)
  assert float(aux["top1"]) > float(first_aux["top1"]) + 0.2
  assert 0 < float(aux["tokens"]) and set(metrics) >= {"loss", "top1", "grad_norm", "nonfinite"}


def test_trained_families_train_together_exactly_as_alone(tiny_cfg, tiny_params):
  """One update of EAGLE and MTP together: each family's weights and optimizer state are
  those of its own update alone; the metrics sum the losses and name each family's."""
  batch = _batch(tiny_cfg, tiny_params)
  dcfg, eagle = random_drafter(tiny_cfg, seed=3)
  mtp = random_mtp(tiny_cfg, seed=4)
  eagle, mtp = jax.device_get((eagle, mtp))  # host copies: each update donates its state
  oc = DrafterOptConfig(learning_rate=3e-3, lr_warmup_steps=0, train_depth=2)
  settings = {"eagle": dcfg, "mtp": mtp.settings}
  both, metrics = jit_train_step(tiny_cfg, settings, oc)(
      init_train_state(jax.tree.map(jnp.asarray, {"eagle": eagle, "mtp": mtp.params}), oc),
      tiny_params, batch)
  for name, params in (("eagle", eagle), ("mtp", mtp.params)):
    alone, own = jit_train_step(tiny_cfg, {name: settings[name]}, oc)(
        init_train_state({name: jax.tree.map(jnp.asarray, params)}, oc), tiny_params, batch)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 (both.params[name], both.opt_state[name]),
                 (alone.params[name], alone.opt_state[name]))
    np.testing.assert_allclose(metrics[f"{name}/loss"], own["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["loss"], metrics["eagle/loss"] + metrics["mtp/loss"],
                             rtol=1e-6)


def test_mtp_heads_export_as_their_family_and_load_back(tmp_path, tiny_cfg):
  mtp = random_mtp(tiny_cfg, seed=2, num_heads=2, use_token=False)
  save_drafter(str(tmp_path), "mtp", mtp.settings, mtp.params, tiny_cfg)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["family"] == "mtp" and config["drafter"] == {"num_heads": 2, "use_token": False}
  name, settings, params = load_drafter(str(tmp_path), tiny_cfg, expect="mtp")
  assert (name, settings) == ("mtp", mtp.settings)
  jax.tree.map(np.testing.assert_array_equal, params, jax.device_get(mtp.params))
  assert param_count(params) == 2 * (32 * 32 + 32 + 32 * 32)
  with pytest.raises(ValueError, match=r"holds a 'mtp' drafter, not 'eagle'; give "
                                       r"drafter.eagle.path a folder exported for 'eagle'"):
    load_drafter(str(tmp_path), tiny_cfg, expect="eagle")
  with pytest.raises(ValueError, match=r"trained for another policy shape: hidden_size=32 "
                                       r"\(policy has 64\)"):
    load_drafter(str(tmp_path), tiny_cfg.replace(hidden_size=64))
  # As a run's drafter: the config's section must agree, and the key names the family.
  c = base_config()
  c.rollout.speculative.arms = ("3,2,6,mtp",)
  c.drafter.mtp.path = str(tmp_path)
  with pytest.raises(ConfigError, match=r"drafter.mtp.path=.* holds a drafter MtpSettings\("
                                        r"num_heads=2, use_token=False\) but the config's "
                                        r"drafter.mtp section describes"):
    load_drafters_for(c, tiny_cfg)
  c.drafter.mtp.update(num_heads=2, use_token=False)
  assert load_drafters_for(c, tiny_cfg)["mtp"].settings == mtp.settings
  c.rollout.speculative.arms = ("3,2,6",)
  c.drafter.eagle.path, c.drafter.mtp.path = str(tmp_path), ""
  c.drafter.mtp.update(num_heads=4, use_token=True)
  with pytest.raises(ConfigError, match=r"drafter.eagle.path=.*: drafter folder .* holds a "
                                        r"'mtp' drafter, not 'eagle'"):
    validate_config(c)


def test_exports_from_before_families_had_names_are_eagle():
  """assets/tiny-drafter's config.json names no family: it loads as the EAGLE drafter."""
  path = os.path.join(REPO, "assets", "tiny-drafter")
  assert "family" not in json.loads(open(os.path.join(path, "config.json")).read())
  cfg = load_hf_config(os.path.join(REPO, "assets", "tiny-policy"))
  name, settings, params = load_drafter(path, cfg, expect="eagle")
  assert name == "eagle" and settings.num_layers == 1 and "layer_0" in params


def test_prompt_lookup_copies_what_followed_the_last_ngram_in_the_prompt_or_response():
  """Row 0's response ends in (7, 8), which its prompt holds followed by 9 10 11: the chain.
  Row 1's last token (4) appears in its own response before (4 5): it copies 5 4, up to its end.
  Row 2 has a token seen nowhere: no draft."""
  vocab = 16
  policy = Policy({}, ModelConfig(vocab_size=vocab, hidden_size=4, intermediate_size=4,
                                  num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4))
  prompt = jnp.asarray([[3, 7, 8, 9, 10, 11, -1, -1], [1, 2, -1, -1, -1, -1, -1, -1],
                        [1, 2, 3, -1, -1, -1, -1, -1]], jnp.int32)
  out = jnp.asarray([[2, 7, 8, 0, 0], [4, 5, 4, 0, 0], [6, 0, 0, 0, 0]], jnp.int32)
  num_out = jnp.asarray([3, 3, 1], jnp.int32)
  ctx = DraftContext(root=out[jnp.arange(3), num_out - 1], features=jnp.zeros((3, 4)),
                     active=jnp.ones((3,), bool), out=out, num_out=num_out, prompt=prompt)
  drafter = PromptLookupDrafter(PromptLookupSettings(max_ngram=3, min_ngram=1))
  cands, _ = drafter.propose(policy, None, ctx, Strategy.parse("3,1,4,prompt_lookup"))
  tokens, scores = np.asarray(cands.tokens), np.asarray(cands.scores)
  np.testing.assert_array_equal(tokens[0], [9, 10, 11])
  np.testing.assert_array_equal(tokens[1, :2], [5, 4])
  assert np.isfinite(scores[:2, :2]).all() and (np.diff(scores[0]) <= 0).all()
  assert (scores[2] == -np.inf).all()
  # min_ngram=2: row 1's match is one token long, too short now.
  strict = PromptLookupDrafter(PromptLookupSettings(max_ngram=3, min_ngram=2))
  scores = np.asarray(strict.propose(policy, None, ctx,
                                     Strategy.parse("3,1,4,prompt_lookup"))[0].scores)
  assert np.isfinite(scores[0]).all() and (scores[1] == -np.inf).all()


def test_a_run_drafts_with_what_its_strategies_name_and_no_more(tiny_cfg, tiny_params):
  """Weightless arms build no EAGLE drafter and still run SD; drafter.names lists the
  drafters explicitly (the arms' must be among them); unknown names list the registered
  ones; a section of a drafter the run does not use is refused."""
  c = base_config()
  c.rollout.speculative.arms = ("4,1,5,suffix", "4,2,8,suffix+prompt_lookup")
  validate_config(c)
  drafters = load_drafters_for(c, tiny_cfg)
  assert run_drafters(c) == ("suffix", "prompt_lookup") == tuple(drafters)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  engine = make_engine(c, tiny_cfg, tiny_params, mesh, 0, 0, drafters=drafters)
  assert engine.speculative and set(engine.drafters) == {"suffix", "prompt_lookup"}
  assert not make_engine(c, tiny_cfg, tiny_params, mesh, 0, 0).speculative  # none given
  c.drafter.prompt_lookup.max_ngram = 2  # its section: read
  validate_config(c)
  c.drafter.mtp.num_heads = 2
  with pytest.raises(ConfigError, match=r"drafter.mtp.num_heads=2 is set but the run does not "
                                        r"use drafter 'mtp' \(its drafters: \['suffix', "
                                        r"'prompt_lookup'\], from rollout.speculative.arms\)"):
    validate_config(c)
  c.drafter.names = ("suffix", "prompt_lookup", "mtp")  # MTP trained alongside, not drafted
  validate_config(c)
  assert run_drafters(c) == ("suffix", "prompt_lookup", "mtp")
  c.drafter.names = ("suffix",)
  with pytest.raises(ConfigError, match=r"rollout.speculative.arms drafts with "
                                        r"\['prompt_lookup'\], which drafter.names=\('suffix',\)"
                                        r" does not list"):
    validate_config(c)
  c.drafter.names = ("suffix", "medusa")
  with pytest.raises(ConfigError, match=r"drafter.names=\('suffix', 'medusa'\): unknown drafter "
                                        r"'medusa'; the registered drafters are "
                                        + re.escape(str(sorted(DRAFTERS)))):
    validate_config(c)


@pytest.mark.parametrize("heads,message", [
    (1000, r"^drafter.mtp.num_heads must be in \[1, 16\], got 1000$"),
    (5, r"^drafter.mtp.num_heads=5 is more heads than the deepest strategy that drafts with MTP "
        r"drafts \(4 tokens, in rollout.speculative.arms or rollout.speculative.strategy\): "
        r"heads past depth 4 are trained and never draft; set drafter.mtp.num_heads=4"),
])
def test_mtp_heads_are_refused_past_the_deepest_draft_and_past_a_bound(heads, message):
  """Refused where the config is checked, before 1,000 heads' spot update compiles for
  minutes; the deepest MTP strategy bounds the count (the EAGLE arm's depth 6 does not)."""
  c = base_config()
  c.rollout.speculative.update(arms=("4,2,8,mtp", "3,2,6,mtp", "6,2,12"), strategy="3,2,6,mtp")
  c.drafter.mtp.num_heads = 4
  validate_config(c)
  c.drafter.mtp.num_heads = heads
  with pytest.raises(ConfigError, match=message):
    validate_config(c)


def test_every_registered_drafter_has_a_config_section_from_its_settings():
  c = base_config()
  for name, cls in DRAFTERS.items():
    fields = {f for f in cls.Settings.__dataclass_fields__}
    if cls.trained:
      fields.add("path")
    assert set(c.drafter.get(name, {})) == fields, name
  assert c.drafter.mtp.num_heads == MtpSettings().num_heads


def _job(module, workdir, *args):
  r = subprocess.run([sys.executable, "-m", module, "--config", "configs/default.py:runlocal",
                      "--workdir", str(workdir), *args], cwd=REPO,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                     timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout + r.stderr


@pytest.mark.slow
def test_mtp_heads_warm_up_export_and_draft_in_an_rl_run_beside_prompt_lookup(tmp_path):
  """The warm-up trains the MTP heads (the run's only trained drafter) and exports them as
  export/mtp; an RL run loads them by name, drafts with them merged with prompt lookup (no
  EAGLE drafter anywhere) and exports them again (spot training them: see test_spot.py)."""
  mtp_only = ["--config.drafter.eagle.path=", "--config.rollout.speculative.tuner=fixed",
              "--config.drafter.mtp.num_heads=3"]
  warm = tmp_path / "warm"
  out = _job("tlt_jax.warmup_drafter", warm, *mtp_only,
             "--config.rollout.speculative.strategy=3,2,6,mtp")
  assert "greedy SD accept length" in out
  assert sorted(os.listdir(warm / "export")) == ["mtp"]
  config = json.loads((warm / "export" / "mtp" / "config.json").read_text())
  assert config["family"] == "mtp" and config["drafter"]["num_heads"] == 3
  summary = json.loads((warm / "summary.json").read_text())
  assert summary["loss_last"] < summary["loss_first"]

  run = tmp_path / "rl"  # one step, no held-out evaluation: the rollout drafts
  out = _job("tlt_jax.train", run, *mtp_only,
             f"--config.drafter.mtp.path={warm / 'export' / 'mtp'}",
             "--config.rollout.speculative.strategy=3,2,6,mtp+prompt_lookup",
             "--config.rl.steps=1", "--config.rl.num_eval_examples=0")
  assert "SD on with mtp+prompt_lookup" in out
  (metrics,) = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert metrics["sd_accept_len_mean"] > 1.0
  assert sorted(os.listdir(run / "export")) == ["mtp", "policy"]


@pytest.mark.parametrize("args,message", [
    (["--config.rollout.speculative.arms=('4,1,5,suffix',)",
      "--config.rollout.speculative.strategy=4,1,5,suffix"],
     "the run uses no trained drafter (its drafters: ['suffix']), so there is nothing to warm"),
    (["--config.rollout.speculative.arms=('4,2,8,mtp',)"],
     "rollout.speculative.strategy='4,2,8' (the warm-up's accept-length check) drafts with "
     "['eagle'], which the run does not use (its drafters: ['mtp'])"),
])
def test_the_warm_up_refuses_a_run_it_cannot_warm_in_one_line(tmp_path, args, message):
  r = subprocess.run([sys.executable, "-m", "tlt_jax.warmup_drafter", "--config",
                      "configs/default.py:runlocal", "--workdir", str(tmp_path / "w"),
                      "--config.drafter.eagle.path=", *args], cwd=REPO,
                     env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                     timeout=300)
  assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
  assert "Traceback" not in r.stderr
