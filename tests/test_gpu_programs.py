"""Every compiled program of every job, checked for a GPU on this CPU machine: it lowers for
CUDA with the Pallas kernel in it (an abstract H100), and the one-GPU config's programs fit
70 GiB by XLA's own memory analysis at their full shapes."""

import jax
import pytest

from tests.conftest import repo_config
from tlt_jax.budget import (GiB, JOBS, job_budget, job_meshes, job_programs, job_resident,
                            lower_for_cuda, tree_bytes, triton_calls)
from tlt_jax.components import engine_config, model_config
from tlt_jax.models.kv_cache import init_cache
from tlt_jax.models.shapes import with_model_shape

# What each job must contain (names as job_programs gives them).
EXPECTED = {"sft": {"sft_step"},
            "train": {"rollout_prefill_b16", "rollout_decode_b16", "rl_update", "drafter_step",
                      "rollout_decode_sd(4, 2, 8)_b2"},
            "warmup": {"rollout_prefill_b16", "rollout_decode_b16", "drafter_step"}}


def test_the_sd_program_is_at_the_engine_s_bucket_for_the_sd_threshold():
  """The budget lays out the SD call at the program batch the engine runs SD in: the smallest
  of rollout.batch_sizes that holds rollout.sd_threshold rows (not the next power of two)."""
  c = repo_config("gpu_demo", "quick")
  with c.unlocked():
    c.rollout.batch_sizes = (6,)
  names = {p.name for p in job_programs(c, "train")[1]}
  assert "rollout_decode_sd(4, 2, 8)_b6" in names, names
  assert not any(n.startswith("rollout_decode_sd") and n.endswith("_b2") for n in names)


def _forced_kernel_config(model_type="qwen2"):
  c = repo_config("gpu_demo", "quick")
  with c.unlocked():
    c.model.attention_impl = "pallas"  # "auto" would pick the reference on this machine
    c.model.dtype = c.model.param_dtype = "bfloat16"
    c.model.head_dim = 32
    c.model.model_type = model_type
  return c


@pytest.mark.parametrize("job", JOBS)
def test_every_program_lowers_for_cuda_with_the_kernel(job):
  _, programs = job_programs(_forced_kernel_config(), job)
  names = {p.name for p in programs}
  assert EXPECTED[job] <= names, names
  calls = {}
  for p in programs:
    calls[p.name] = text_calls = triton_calls(lower_for_cuda(p))
    if p.name.startswith("rollout_"):  # prefill, plain decode and SD verify run the kernel
      assert text_calls >= 1, p.name
    if p.name.startswith("rollout_decode_sd"):  # the drafter's attention and the verify
      assert text_calls >= 2, p.name
  if job == "train":  # slices that share one trace lower the same kernel calls (one SD program)
    sd = next(p for p in programs if p.name.startswith("rollout_decode_sd"))
    assert triton_calls(lower_for_cuda(sd, shared=True)) == calls[sd.name], sd.name


def test_a_qwen3_policy_lowers_for_cuda_with_the_kernel():
  """The RL job's programs with Qwen3's per-head q/k norms (head_dim 32, hidden / heads 16):
  the kernel in prefill, plain and SD decode, the norms' weights in every update."""
  c = _forced_kernel_config("qwen3")
  resident, programs = job_programs(c, "train")
  assert "q_norm" in resident["policy params"]["layers"]["self_attn"]
  assert EXPECTED["train"] <= {p.name for p in programs}
  for p in programs:
    calls = triton_calls(lower_for_cuda(p))
    if p.name.startswith("rollout_"):
      assert calls >= (2 if p.name.startswith("rollout_decode_sd") else 1), p.name


@pytest.mark.slow
@pytest.mark.parametrize("job", JOBS)
def test_the_one_gpu_demo_fits_70_gib(job):
  """configs/gpu_demo.py at its full shapes (SFT 32 x 1536, RL update 32 x 1920, rollout
  128 rows x 1920 slots), compiled here: each program's peak under 70 GiB. Its weights are
  bfloat16, so on this CPU the rollout's temporaries come from the float32 stand-in (checked
  on the warm-up's programs; the RL job's rollout programs are measured as compiled, an
  over-estimate, to halve their compiles). The RL job: its three largest programs, the
  update and the rollout at its 128 rows; its drafter step and SD programs peak under 2 GiB
  (every program: `python -m tools.gpu_budget`, docs/results/gpu_budget.json)."""
  stand_in = None if job == "warmup" else False
  only = {"rl_update", "rollout_prefill_b128", "rollout_decode_b128"} if job == "train" else None
  budget = job_budget(repo_config("gpu_demo"), job, progress=lambda _: None,
                      stand_in=stand_in, only=only)
  for name, m in budget["programs"].items():
    assert m["peak_bytes"] < 70 * GiB, (name, m["peak_bytes"] / GiB)
    from_stand_in = job == "warmup" and name.startswith("rollout_")
    assert m["temp_source"] == ("float32 scan stand-in" if from_stand_in else "compiled"), name
  assert budget["peak_bytes"] > sum(budget["resident_bytes"].values())


@pytest.mark.slow
def test_the_budget_sees_what_the_memory_knobs_save():
  """Without rematerialisation and chunked attention the same SFT step needs >100 GiB: the
  check is not vacuous, and the knobs are what makes the demo fit."""
  c = repo_config("gpu_demo")
  with c.unlocked():
    c.model.remat = "none"
    c.model.attention_query_chunk = 0
  assert job_budget(c, "sft", progress=lambda _: None)["peak_bytes"] > 100 * GiB


def test_a_7b_policy_cannot_train_on_one_80gb_gpu():
  """Why configs/qwen2_5_gpu.py has no one-GPU variant: a Qwen2.5-7B-shaped policy's bf16
  weights and AdamW state, with the rollout cache of the paper's 64 rows x 8.7k slots, pass
  the 70 GiB budget before any activation (the update's float32 logits add ~39 GiB more)."""
  c = with_model_shape(repo_config("qwen2_5_gpu", "8gpu"), "qwen2.5-7b")
  with c.unlocked():
    c.mesh.axes.replica = 1
    c.rl.kl_coef = 0.0
    c.drafter.spot_training = False
    c.rollout.max_batch = 64
  resident = job_resident(c, "train")
  params = sum(x.size for x in jax.tree.leaves(resident["policy params"]))
  assert 7.0e9 < params < 8.0e9
  cache = jax.eval_shape(lambda: init_cache(model_config(c), c.rollout.max_batch,
                                            engine_config(c).capacity))
  held = sum(tree_bytes(v) for v in resident.values())
  assert held > 40 * GiB and tree_bytes(cache) > 28 * GiB
  assert held + tree_bytes(cache) > 70 * GiB


@pytest.mark.parametrize("config,model_type", [("qwen2_5_gpu", "qwen2"), ("qwen3_gpu", "qwen3")])
def test_the_8gpu_layouts_split_training_state_and_keep_whole_rollout_weights(config,
                                                                              model_type):
  """configs/qwen2_5_gpu.py:8gpu and configs/qwen3_gpu.py:8gpu on 8 devices (a small model of
  their architecture): each device holds 1/8 of the weights and AdamW state in the training
  layout, and a whole copy of the weights in the rollout layout (its slice decodes without
  gathering weights). At the Qwen2.5-7B shape that is 1.8 + 3.5 (+ 1.8 for the KL reference)
  GiB of training state and 14.2 GiB of rollout weights per device, beside each program's own
  needs (docs/results/gpu_budget_8gpu.json; Qwen3-8B: gpu_budget_qwen3_8b_8gpu.json). Their
  rollout and update programs lower for CUDA on an abstract mesh of 8 H100s (the update over
  all 8, the rollout on one slice, with the kernel)."""
  c = with_model_shape(repo_config(config, "8gpu"), "small")
  with c.unlocked():
    c.model.model_type = model_type
  meshes = job_meshes(c, 8)
  assert meshes.train.devices.size == 8 and meshes.rollout.devices.size == 1
  resident = job_resident(c, "train", meshes)
  whole = lambda tree: tree_bytes(jax.tree.map(  # noqa: E731
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
  for name in ("policy params", "policy optimizer", "reference params"):
    assert tree_bytes(resident[name]) <= whole(resident[name]) / 8 * 1.05, name
  assert tree_bytes(resident["rollout params"]) == whole(resident["policy params"])
  with c.unlocked():
    c.model.attention_impl = "pallas"
    c.rollout.max_new_tokens = 512  # the lowering does not depend on it
  programs = {p.name: p for p in job_programs(c, "train", 8)[1]}
  update = lower_for_cuda(programs["rl_update"])
  assert "mhlo.num_partitions = 8" in update.as_text()
  decode = next(p for name, p in programs.items() if name.startswith("rollout_decode_sd"))
  assert triton_calls(lower_for_cuda(decode)) >= 2


@pytest.mark.slow
@pytest.mark.parametrize("variant,shape,devices", [("8gpu", "qwen3-8b", 8),
                                                   ("1gpu", "qwen3-1.7b", 1)])
def test_the_qwen3_configs_largest_programs_fit_70_gib(variant, shape, devices):
  """configs/qwen3_gpu.py at its named shapes (Qwen3-8B on 8 devices, Qwen3-1.7B on one),
  compiled here: the policy update and the rollout prefill, each variant's largest programs
  (every program's budget: docs/results/gpu_budget_qwen3_*.json), peak under 70 GiB per
  device with the resident state (the rollout's whole copy of the weights included)."""
  c = with_model_shape(repo_config("qwen3_gpu", variant), shape)
  only = {"rl_update", f"rollout_prefill_b{c.rollout.max_batch}"}
  budget = job_budget(c, "train", progress=lambda _: None, num_devices=devices, only=only)
  assert set(budget["programs"]) == only
  assert model_config(c).qk_norm
  for name, m in budget["programs"].items():
    assert m["peak_bytes"] < 70 * GiB, (name, m["peak_bytes"] / GiB)


def test_the_rl_jobs_programs_lower_for_cuda_with_the_invariant_numerics():
  """model.numerics="invariant" (bfloat16): every program of the RL job lowers for CUDA, the
  policy's attention the blockwise jnp one: the prefill and the SD programs call the Pallas
  kernel once less than with the fast numerics (the drafter's attention keeps it)."""
  fast = {p.name: triton_calls(lower_for_cuda(p))
          for p in job_programs(_forced_kernel_config(), "train")[1]
          if p.name.startswith("rollout_")}
  c = _forced_kernel_config()
  with c.unlocked():
    c.model.numerics = "invariant"
  _, programs = job_programs(c, "train")
  assert EXPECTED["train"] <= {p.name for p in programs}
  for p in programs:
    calls = triton_calls(lower_for_cuda(p))
    if p.name in fast:
      fewer = p.name.startswith(("rollout_prefill", "rollout_decode_sd"))
      assert calls == fast[p.name] - fewer, (p.name, calls, fast[p.name])
