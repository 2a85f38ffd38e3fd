"""Teacher-forced accept lengths: on the engine's own responses they are the engine's SD
iterations, accept for accept, for EAGLE and MTP trees at a sampling temperature, and the
suffix drafter finds a response's repetition from its own text and its group's."""

import jax
import numpy as np
import pytest

from tests.engines import engine_config
from tests.speculative.drafters import oracle_drafter, random_mtp
from tlt_jax.drafters import EagleDrafter, SuffixDrafter
from tlt_jax.mesh import make_mesh
from tlt_jax.models import Policy
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.teacher_forced import ResponseDepths, response_depths
from tlt_jax.speculative.tuner import FixedTuner


@pytest.fixture(scope="module")
def sharp(tiny_cfg, tiny_params):
  """The tiny policy with a sharper head (drafts are right often, not always, at T = 1) and
  a drafter that is the policy's copy with a little noise."""
  params = dict(tiny_params, lm_head={"kernel": tiny_params["lm_head"]["kernel"] * 6.0})
  dcfg, dparams = oracle_drafter(tiny_cfg, params)
  keys = iter(jax.random.split(jax.random.key(5), 64))
  dparams = jax.tree.map(lambda x: x + 1e-3 * jax.random.normal(next(keys), x.shape, x.dtype),
                         dparams)
  return params, {"eagle": EagleDrafter(params=dparams, settings=dcfg),
                  "mtp": random_mtp(tiny_cfg, seed=2)}


@pytest.mark.parametrize("strategy", [Strategy(3, 2, 6), Strategy(2, 2, 4, ("mtp",))])
def test_the_walk_is_what_the_engine_accepts(tiny_cfg, sharp, strategy):
  params, drafters = sharp
  used = {name: drafters[name] for name in strategy.drafts}
  ec = engine_config(max_batch=8, max_prompt_len=8, max_new_tokens=40, sd_threshold=8)
  engine = RolloutEngine(tiny_cfg, params, make_mesh({"replica": 1}, jax.devices()[:1]), ec, drafters=used,
                         tuner=FixedTuner(strategy))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, tiny_cfg.vocab_size, 5).tolist() for _ in range(4)]
  result = engine.generate(prompts, 2, SamplingParams(1.0), jax.random.key(1))
  sd = [r for r in result.timeline if r.mode == "sd"]
  policy = Policy(params, tiny_cfg)
  walks = [response_depths(policy, used, strategy, prompts[i // 2], tokens, rows=16).walk()
           for i, tokens in enumerate(result.tokens)]
  accepted = [a for walk in walks for _, a in walk]
  # Every row runs SD from its first token: the walks are the engine's row-iterations.
  assert len(accepted) == sum(r.row_iterations for r in sd)
  assert sum(accepted) == pytest.approx(sum(r.accept_mean * r.row_iterations for r in sd))
  assert min(accepted) == 1 and max(accepted) > 1  # rejections and acceptances both happen


def test_suffix_drafts_copy_the_response_and_its_group(tiny_cfg, tiny_params):
  policy = Policy(tiny_params, tiny_cfg)
  suffix = {"suffix": SuffixDrafter()}
  chain = Strategy(4, 1, 5, ("suffix",))
  loop = [7, 8, 9, 10, 11] * 6
  own = response_depths(policy, suffix, chain, [1, 2, 3], loop).depths
  # Once the loop has been written once, every later position's chain follows it.
  assert (own[6:len(loop) - 5] == 4).all()
  assert (own[:3] == 0).all()
  fresh = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
  alone = response_depths(policy, suffix, chain, [1, 2, 3], fresh).depths
  assert not alone.any()
  # A sibling that wrote part of it: copied from once it has finished (lockstep), before
  # that only as far as it got.
  group = [[22, 23, 24, 25]]
  copied = response_depths(policy, suffix, chain, [1, 2, 3], fresh, group=group).depths
  assert copied[2] == 0  # the sibling has written 22, 23, 24: no match of two tokens
  assert copied[3] == 2  # finished: 22, 23 -> 24, 25, where it ends


def test_walk_steps_over_accepted_tokens():
  assert ResponseDepths(np.array([2, 0, 0, 1, 0, 0, 0])).walk() == [(0, 3), (3, 2), (5, 1)]
  assert ResponseDepths(np.array([0])).walk() == []
