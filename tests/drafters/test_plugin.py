"""A drafter defined here, in the test, is one registration away from the engine and the
config; and registering a drafter changes none of a run's programs that do not draft with it."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.engines import engine_config
from tests.conftest import REPO
from tests.speculative.test_sd_greedy import GREEDY, LENGTHS, PROMPTS
from tlt_jax.components import load_drafters_for, make_engine, validate_config
from tlt_jax.config import ConfigError, base_config
from tlt_jax.drafters import DRAFTERS, Candidates, Drafter, make_drafter
from tlt_jax.mesh import make_mesh, on_mesh
from tlt_jax.models import Policy, init_cache
from tlt_jax.rollout import pool as pool_module
from tlt_jax.rollout.engine import RolloutEngine
from tlt_jax.speculative.decoding import plain_step, sd_step, start
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy
from tlt_jax.speculative.tuner import FixedTuner


@dataclasses.dataclass(frozen=True)
class EchoSettings:
  """shift: the chain proposes root + shift (mod the vocabulary) at every depth."""
  shift: int = 0


@flax.struct.dataclass
class EchoState:
  """How many (token, feature) pairs the drafter has read per row: its proof of being kept
  in step with the policy's cache."""
  seen: jax.Array  # [B] int32

  def row_axes(self):
    return EchoState(seen=0)

  def logical_axes(self):
    return EchoState(seen=P("batch"))


@flax.struct.dataclass
class EchoDrafter(Drafter):
  """A toy family: a chain repeating the root (shifted), with a state that counts pairs."""
  Settings = EchoSettings
  settings: EchoSettings = flax.struct.field(pytree_node=False, default=EchoSettings())

  @staticmethod
  def candidate_count(depth: int, topk: int) -> int:
    return depth

  def init_state(self, cfg, batch: int, capacity: int) -> EchoState:
    return EchoState(seen=jnp.zeros((batch,), jnp.int32))

  def prefill(self, policy, state, prompts, lengths, hidden) -> EchoState:
    return EchoState(seen=state.seen + lengths)

  def catch_up(self, policy, state, tokens, prev_features, count) -> EchoState:
    return EchoState(seen=state.seen + count)

  def propose(self, policy, state, ctx, strategy, limits=None):
    b, d = ctx.root.shape[0], strategy.depth
    token = (ctx.root + self.settings.shift) % policy.cfg.vocab_size
    depth = jnp.arange(d)[None]
    scores = jnp.where(depth < (d if limits is None else limits[0]), -0.5 * (depth + 1), -jnp.inf)
    return Candidates(tokens=jnp.broadcast_to(token[:, None], (b, d)).astype(jnp.int32),
                      parents=jnp.broadcast_to(jnp.arange(-1, d - 1, dtype=jnp.int32), (b, d)),
                      scores=jnp.broadcast_to(scores, (b, d)).astype(jnp.float32)), \
        EchoState(seen=state.seen + ctx.active)  # it read the root pair (the interface's rule)


@pytest.fixture
def echo(monkeypatch):
  """The toy family registered as 'echo' for one test: its one registration line."""
  monkeypatch.setitem(DRAFTERS, "echo", EchoDrafter)


def _mesh():
  return make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])


def test_a_toy_drafter_registered_here_runs_through_the_engine_exactly(echo, tiny_cfg,
                                                                       tiny_params):
  """GRPO-shaped groups (4 samples per prompt), greedy and sampled, SD from the first token
  with the toy alone and merged with the suffix drafter: plain decoding's tokens; its state
  reads every committed pair, so it is as long as the policy's cache."""
  ec = engine_config(max_batch=4, max_prompt_len=8, max_new_tokens=12, batch_sizes=(4, 1),
                    prompt_widths=(8,))  # fewer programs, the same tokens
  prompts = [list(p[:n]) for p, n in zip(PROMPTS, LENGTHS)]
  for sp in (GREEDY, SamplingParams(0.9)):
    plain = RolloutEngine(tiny_cfg, tiny_params, _mesh(), ec).generate(
        prompts, 4, sp, jax.random.key(1))
    for strategy in ("3,1,4,echo", "3,1,5,echo+suffix"):
      engine = RolloutEngine(tiny_cfg, tiny_params, _mesh(),
                             dataclasses.replace(ec, sd_threshold=4),
                             drafters={"echo": make_drafter("echo"),
                                       "suffix": make_drafter("suffix")},
                             tuner=FixedTuner(strategy))
      assert set(engine.drafters) == set(Strategy.parse(strategy).drafts)
      res = engine.generate(prompts, 4, sp, jax.random.key(1))
      assert res.tokens == plain.tokens, strategy
      assert all(r.mode in ("prefill", "sd") for r in res.timeline)

  policy = Policy(tiny_params, tiny_cfg)
  drafters = {"echo": EchoDrafter(EchoSettings(shift=1))}
  cap = 32
  state = start(policy, jnp.asarray(PROMPTS), jnp.asarray(LENGTHS), init_cache(tiny_cfg, 3, cap),
                jax.random.key(0), GREEDY, 10, -1, drafters=drafters,
                draft_states={"echo": drafters["echo"].init_state(tiny_cfg, 3, cap)})
  state, _ = plain_step(policy, state, jax.random.key(0), GREEDY, -1, drafters)
  for _ in range(3):
    state, _ = sd_step(policy, drafters, state, jax.random.key(0), GREEDY, -1,
                       Strategy.parse("3,1,4,echo"))
  np.testing.assert_array_equal(state.drafts["echo"].seen, state.cache.lengths)


def test_a_registered_drafter_gets_its_config_section(echo, tiny_cfg):
  c = base_config()
  assert c.drafter.echo.shift == 0
  c.drafter.echo.shift = 3
  with pytest.raises(ConfigError, match="drafter.echo.shift=3 is set but the run does not use "
                                        "drafter 'echo'"):
    validate_config(c)
  c.rollout.speculative.arms = ("3,1,4,echo", "4,2,8,eagle+echo")
  validate_config(c)
  drafters = load_drafters_for(c, tiny_cfg)
  assert set(drafters) == {"echo", "eagle"} and drafters["echo"].settings == EchoSettings(3)


def _run_programs(config, cfg, params, speculative: bool, monkeypatch) -> list:
  """What a run of `config` compiles for a small rollout, as train.py builds its engine:
  (kind, StableHLO text) of every program, in compile order."""
  compiled, compile_once = [], pool_module._compile

  def recording(fn, args, donate_argnums, out_shardings, mesh, kind, *sharing):
    laid_out = pool_module.with_output_layout(fn, out_shardings) if out_shardings else fn
    with on_mesh(mesh):
      compiled.append((kind, jax.jit(laid_out, donate_argnums=donate_argnums).lower(
          *args).as_text()))
    return compile_once(fn, args, donate_argnums, out_shardings, mesh, kind, *sharing)
  monkeypatch.setattr(pool_module, "_compile", recording)
  drafters = load_drafters_for(config, cfg) if speculative else None
  engine = make_engine(config, cfg, params, _mesh(), 0, 0, drafters=drafters,
                       speculative=speculative, max_batch=4, max_new_tokens=12,
                       compile_ahead=False)
  prompts = [list(p[:n]) for p, n in zip(PROMPTS, LENGTHS)]
  engine.generate(prompts, 2, SamplingParams(0.8), jax.random.key(0))
  monkeypatch.setattr(pool_module, "_compile", compile_once)
  assert len(compiled) == engine.pool.report()["compiles"]
  return compiled


def test_registering_a_drafter_changes_no_program_of_a_run_that_does_not_use_it(
    monkeypatch, tiny_cfg, tiny_params):
  """The baseline (no SD) and an EAGLE run compile the same programs, byte for byte, with the
  toy family registered (a drafter with a state, which every plain step would keep in step
  if the engine built it)."""
  def programs():  # of the baseline (False) and an EAGLE run (True), as registered now
    config = base_config()  # its drafter sections: the registered families'
    config.rollout.sd_threshold = 4
    config.rollout.speculative.update(tuner="fixed", strategy="3,2,6")
    config.rollout.update(batch_sizes=(4, 1), prompt_widths=(8,))  # fewer programs to compare
    return {sd: _run_programs(config, tiny_cfg, tiny_params, sd, monkeypatch)
            for sd in (False, True)}
  before = programs()
  monkeypatch.setitem(DRAFTERS, "echo", EchoDrafter)
  after = programs()
  for sd in (False, True):
    assert len(after[sd]) == len(before[sd]) > 0  # the compiled program count
    assert after[sd] == before[sd]  # and the programs themselves
  assert "rollout_decode_sd" in {kind for kind, _ in after[True]}


@pytest.mark.slow
def test_a_family_from_a_users_file_is_covered_by_the_shared_tests(tmp_path):
  """docs/extending.md's toy drafter, as a file of the user's own named in TLT_PLUGINS: the
  shared exactness tests collect and pass it with no edit to a test file: greedy (here the
  family's chain of them), sampled (chi-square, alone and in the hybrid of every family)."""
  page = (pathlib.Path(REPO) / "docs" / "extending.md").read_text()
  module = re.search(r"```python\n(.*?)```", page, re.S).group(1)  # the first block: the family
  assert '@register_drafter("repeat")' in module
  (tmp_path / "repeat_drafter.py").write_text(module)
  env = {**os.environ, "TLT_PLUGINS": str(tmp_path / "repeat_drafter.py")}
  env.pop("PYTEST_XDIST_WORKER", None)
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q",
       "-rA", "tests/speculative/test_sd_greedy.py", "tests/speculative/test_sd_sampling.py",
       "-k", "(test_greedy_every_family and repeat-4-1-5) or "
             "(test_every_family_and_hybrid_trees_sample_exactly and repeat)"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  passed = [line for line in done.stdout.splitlines() if line.startswith("PASSED")]
  assert any("[repeat-4-1-5]" in line for line in passed), done.stdout[-3000:]
  assert any("[repeat]" in line for line in passed), done.stdout[-3000:]
  assert any("eagle+mtp+prompt_lookup+repeat+suffix" in line for line in passed), \
      done.stdout[-3000:]
