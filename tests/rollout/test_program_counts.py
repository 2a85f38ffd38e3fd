"""The compiled decode programs' operations per iteration (tlt_jax/hlo_counts.py), pinned for a
tiny model: a change that adds work to every decode iteration (a copy of the KV cache, a sort,
a nested loop, a host transfer) fails here before it costs a GPU launch per step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.speculative.drafters import random_drafter
from experiments.profile_decode import weight_shapes
from tlt_jax import hlo_counts
from tlt_jax.drafters import EagleDrafter
from tlt_jax.mesh import ROLLOUT_RULES, make_mesh
from tlt_jax.models import init_cache
from tlt_jax.rollout.pool import ExecutablePool, wait_for_compiles_ahead
from tlt_jax.rollout.programs import SlicePrograms
from tlt_jax.speculative.sampling import SamplingParams
from tlt_jax.speculative.strategy import Strategy

# Per iteration at 1 row, jax 0.10.2, under the suite's XLA:CPU flags (its threefry runs as rolled
# while loops, which a GPU unrolls; each layer's weights are sliced out of the stacked arrays by
# a copy here; the GPU trace shows what XLA:GPU does). Before the draft tree's ancestor mask lost its loop over
# the nodes and the drafter stopped writing out a full-vocabulary log-softmax per depth, SD
# (4,2,8) was 786 ops / 9 loops; plain is unchanged at 295. The rollout's log-probs of the
# tokens it draws (one log-softmax over the vocabulary per emitted token, what the trainer's
# importance ratio compares with) then added 7 ops to a plain iteration and 37 ops and a loop
# (XLA:CPU expands the gather of the accepted path's logits into one) to an SD iteration. The
# token noise's position then moved from a second key derivation into threefry's counter: one
# threefry per token instead of two (-93 ops and a loop in both programs): plain 209 (295 at
# b9a3a3a, -29%), SD 670 (786, -15%).
PINNED = {None: {"ops": 209, "while_loops": 1, "weight_copies": 6},
          (4, 2, 8): {"ops": 670, "while_loops": 8, "weight_copies": 6}}


@pytest.fixture(scope="module")
def counts(tiny_cfg, tiny_params, optimised_compiles):
  """{strategy tuple or None: decode_loop_counts} of the engine's 1-row decode programs."""
  cap, max_new = 64, 32
  dcfg, dparams = random_drafter(tiny_cfg, seed=3)
  eagle = EagleDrafter(dparams, dcfg)
  mesh = make_mesh({"replica": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
  progs = SlicePrograms(0, mesh, ExecutablePool(), tiny_cfg, {"eagle": eagle.replace(params=None)},
                        cap, max_new, -1, ROLLOUT_RULES, log_features=False)
  sp = SamplingParams(1.0)
  prompts = np.ones((1, 8), np.int32)
  ones = np.zeros(1, np.int32)
  state = progs.start(tiny_params, {"eagle": eagle}, prompts, np.full(1, 8, np.int32), ones,
                      ones, jax.random.key(0), sp)
  big = {"kv_cache": {tuple(init_cache(tiny_cfg, 1, cap).k.shape)},
         "weights": weight_shapes(tiny_params)}
  out = {}
  # Compiled, not run: a call would donate the state that both programs are compiled for.
  for strategy, drafters, st in ((None, {}, state.replace(drafts={})),
                                 (Strategy(4, 2, 8), {"eagle": eagle}, state)):
    progs.decode_ahead(tiny_params, drafters, st, jax.random.key(1), sp, [(1, strategy)])
    wait_for_compiles_ahead()
    exe = progs.decode_executable(1, strategy, sp)
    out[None if strategy is None else strategy.as_tuple()[:3]] = \
        hlo_counts.decode_loop_counts(exe.as_text(), big)
  return out


@pytest.mark.parametrize("program", [None, (4, 2, 8)], ids=["plain", "sd_4_2_8"])
def test_no_iteration_copies_the_cache_or_talks_to_the_host(counts, program):
  c = counts[program]
  assert c["loop_found"]
  it = c["per_iteration"]
  assert it["kv_cache_copies"] == 0, it["by_opcode"]
  assert it["host_transfers"] == 0 and it["host_callbacks"] == 0
  assert it["all_reduces"] == 0 and it["all_gathers"] == 0  # one device: no collectives
  assert it["unknown_trip_loops"] == 0  # no data-dependent loop nested in an iteration
  assert c["per_call"]["kv_cache_copies"] == 0


@pytest.mark.skipif(not jax.__version__.startswith("0.10."),
                    reason="pinned on jax 0.10 (XLA:CPU's fusion differs between versions)")
@pytest.mark.parametrize("program", [None, (4, 2, 8)], ids=["plain", "sd_4_2_8"])
def test_operations_per_iteration_are_pinned(counts, program):
  it = counts[program]["per_iteration"]
  got = {k: it[k] for k in PINNED[program]}
  assert got == PINNED[program], (
      f"{program or 'plain'}: {got} per iteration, pinned {PINNED[program]}: a rise is work "
      f"added to every decode iteration (by opcode: {it['by_opcode']}); a fall, update PINNED")


def test_counts_read_nested_loops_fusions_and_copies():
  def body(i, carry):
    x, y = carry
    inner = jax.lax.fori_loop(0, 3, lambda j, z: jnp.sin(z) * 2.0, x)
    return inner + jnp.sort(y)[0], jnp.cos(y)

  def fn(x, y, n):
    x, y = jax.lax.fori_loop(0, n, body, (x, y))
    return x, y

  text = jax.jit(fn).lower(jnp.ones(8), jnp.ones(16), 5).compile().as_text()
  c = hlo_counts.decode_loop_counts(text, {"big": {(16,)}})
  it = c["per_iteration"]
  assert c["loop_found"] and it["sorts"] == 1
  assert it["while_loops"] == 1 and it["unknown_trip_loops"] == 0  # the inner loop, trip 3
  assert it["ops"] >= 3 * 1 + 1  # the inner body three times, the sort
  assert hlo_counts.shape_bytes("f32[2,3]{1,0}") == ((2, 3), 24)
  assert hlo_counts.shape_bytes("(f32[], s32[])") == ((), 0)
