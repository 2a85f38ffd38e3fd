"""What a job's compiled programs need on a GPU, known on any machine.

A job's programs (SFT step, rollout prefill / plain decode / SD decode, log-probs, policy
update, drafter update) are built here at the shapes its config gives, with abstract weights
(`jax.ShapeDtypeStruct`, nothing allocated), and then either

  - compiled for this machine's backend, to read XLA's `memory_analysis()` (arguments,
    outputs, temporaries) and the compile seconds: on CPU the temporaries are an estimate of
    the GPU's (same HLO, another backend's buffer assignment), good enough to tell 20 GiB
    from 200; or
  - lowered for CUDA under an abstract H100 (`lower_for_cuda`), which runs the whole Pallas ->
    Triton lowering of the attention kernel without a GPU.

A job's peak is its resident state (weights, optimizer states, reference weights: what lives
between programs) plus, for its hungriest program, the arguments that are not resident, the
temporaries and the outputs that do not reuse a donated buffer. One device: the budget is for
one-GPU configs (every mesh axis 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from tlt_jax.components import (drafter_config, drafter_opt_config, engine_config, grpo_config,
                                model_config, policy_adamw, sampling_params,
                                training_model_config)
from tlt_jax.drafter_training.loss import Windows
from tlt_jax.drafter_training.train_step import init_train_state, train_step
from tlt_jax.mesh import AXIS_ORDER, ROLLOUT_RULES
from tlt_jax.models import init_params
from tlt_jax.models.drafter import init_drafter_params
from tlt_jax.optim import make_adamw
from tlt_jax.rl.policy_update import make_log_probs, make_policy_update
from tlt_jax.rollout.pool import ExecutablePool, with_output_layout
from tlt_jax.rollout.programs import SlicePrograms
from tlt_jax.sft_update import make_optimizer, make_train_step
from tlt_jax.speculative.strategy import Strategy

GiB = 1024 ** 3
H100 = "NVIDIA H100 80GB HBM3"
JOBS = ("sft", "train", "warmup")


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program of a job: fn(*args), args arrays or ShapeDtypeStructs; `resident`
  are the indices of args that live for the whole job (counted once, in the job's resident
  bytes)."""
  name: str
  fn: Callable
  args: tuple
  donate_argnums: tuple = ()
  resident: tuple = ()


def tree_bytes(tree) -> int:
  """Bytes of every array (or ShapeDtypeStruct) leaf of a pytree (a PRNG key counts as
  its key data)."""
  def nbytes(x):
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):
      x = jax.eval_shape(jax.random.key_data, x)
    return int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
  return sum(nbytes(x) for x in jax.tree.leaves(tree))


# ---------------------------------------------------------------- CUDA lowering


@contextlib.contextmanager
def abstract_gpu(device_kind: str = H100, axes: Sequence[str] = AXIS_ORDER):
  """Traces inside run on a one-device abstract mesh of `device_kind` (every axis of `axes`
  of size 1), so that Pallas lowers for CUDA without a GPU (jax 0.11 refuses otherwise)."""
  mesh = AbstractMesh((1,) * len(axes), tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                      abstract_device=AbstractDevice(device_kind, None, "cuda"))
  with jax.sharding.use_abstract_mesh(mesh):
    yield


def lower_for_cuda(program: Program, device_kind: str = H100) -> jax.stages.Lowered:
  """program lowered for CUDA on any machine (see `abstract_gpu`)."""
  with abstract_gpu(device_kind):
    return jax.jit(program.fn, donate_argnums=program.donate_argnums).trace(
        *program.args).lower(lowering_platforms=("cuda",))


def triton_calls(lowered: jax.stages.Lowered) -> int:
  """How many Triton kernel calls (the Pallas attention) a CUDA lowering contains."""
  text = lowered.as_text()
  return text.count("__gpu$xla.gpu.triton") + text.count("triton_kernel_call")


# ---------------------------------------------------------------- the programs of a job


class RecordingPool(ExecutablePool):
  """An ExecutablePool that compiles nothing: it records each program the rollout asks for
  and hands back a stand-in that returns the output shapes, so `SlicePrograms` drives it as
  it drives the real pool."""

  def __init__(self):
    super().__init__()
    self.programs: dict = {}

  def get(self, key, fn, args, donate_argnums=(), out_shardings=None):
    if out_shardings is not None:
      fn = with_output_layout(fn, out_shardings)
    self.programs[key] = (fn, tuple(args), tuple(donate_argnums))
    return lambda *a: jax.eval_shape(fn, *a)


def _sft_programs(config, cfg, resident) -> list[Program]:
  params, opt = resident["policy params"], resident["policy optimizer"]
  rows, width = config.sft.rows, config.sft.seq_len
  batch = {k: jax.ShapeDtypeStruct((rows, width), jnp.bool_ if k == "loss_mask" else jnp.int32)
           for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
  step = make_train_step(training_model_config(config, cfg), _policy_optimizer(config, "sft"),
                         None, None).__wrapped__
  return [Program("sft_step", step, (params, opt, batch), (0, 1), (0, 1))]


def _rollout_programs(config, cfg, params, dcfg, dparams, log_features: bool,
                      max_new_tokens: int | None = None) -> list[Program]:
  """prefill at max_batch, a plain decode call at max_batch and, with a drafter, an SD call
  for every arm at the largest batch bucket SD runs at."""
  econf = engine_config(config)
  if max_new_tokens:
    econf = dataclasses.replace(econf, max_new_tokens=max_new_tokens)
  mesh = jax.make_mesh((1,) * len(AXIS_ORDER), AXIS_ORDER,
                       axis_types=(AxisType.Auto,) * len(AXIS_ORDER),
                       devices=jax.devices()[:1])
  pool = RecordingPool()
  progs = SlicePrograms(0, mesh, pool, cfg, dcfg, econf.capacity, econf.max_new_tokens, 0,
                        ROLLOUT_RULES, log_features)
  sp, key, b = sampling_params(config), jax.random.key(0), econf.max_batch
  prompts = np.zeros((b, econf.max_prompt_len), np.int32)
  state = progs.start(params, dparams, prompts, np.ones((b,), np.int32),
                      np.arange(b, dtype=np.int32), key, sp)
  progs.decode(params, dparams, state, key, sp, None, 1, econf.steps_per_call)
  if dcfg is not None and econf.sd_threshold:
    sd_batch = min(b, 1 << max(econf.sd_threshold - 1, 0).bit_length())
    small = progs.take_rows(state, np.arange(sd_batch))
    sd = config.rollout.speculative
    for arm in dict.fromkeys((*sd.arms, sd.strategy)):
      progs.decode(params, dparams, small, key, sp, Strategy.parse(arm), 1,
                   econf.steps_per_call)
  out = []
  for key_, (fn, args, donate) in pool.programs.items():
    kind = key_[1]
    if kind not in ("prefill", "decode"):
      continue  # cache allocation and row copies: no temporaries worth a line
    strategy = key_[3] if kind == "decode" else None
    name = f"rollout_{kind}" + (f"_sd{strategy.as_tuple()}" if strategy else "")
    out.append(Program(f"{name}_b{key_[2]}", fn, args, donate, (0, 1)))
  return out


def _drafter_program(config, cfg, dcfg, state, params, warmup: bool) -> Program:
  section = config.drafter.warmup if warmup else config.drafter.spot
  rows, width = section.batch_rows, section.window
  i32 = lambda: jax.ShapeDtypeStruct((rows, width), jnp.int32)  # noqa: E731
  windows = Windows(tokens=i32(), segment_ids=i32(), positions=i32(),
                    features=jax.ShapeDtypeStruct((rows, width, cfg.feature_size),
                                                  cfg.jnp_dtype),
                    loss_mask=jax.ShapeDtypeStruct((rows, width), jnp.bool_))
  fn = functools.partial(train_step, cfg=training_model_config(config, cfg), dcfg=dcfg,
                         oc=drafter_opt_config(config, warmup=warmup))
  return Program("drafter_step", fn, (state, params, windows), (0,), (0, 1))


def _policy_optimizer(config, job: str):
  return make_optimizer(config) if job == "sft" else make_adamw(policy_adamw(config))


def job_resident(config: ml_collections.ConfigDict, job: str) -> dict:
  """What `job` holds on the device between its programs, by name -> abstract pytree: the
  policy's weights, its optimizer state (sft, train), the reference weights (train with a KL
  term) and the drafter's weights and optimizer state (warmup; train with spot training)."""
  if job not in JOBS:
    raise ValueError(f"unknown job {job!r}; allowed: {JOBS}")
  cfg = model_config(config)
  params = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
  resident = {"policy params": params}
  if job in ("sft", "train"):
    resident["policy optimizer"] = jax.eval_shape(_policy_optimizer(config, job).init, params)
  if job == "train" and config.rl.kl_coef > 0:
    resident["reference params"] = params
  if job == "warmup" or (job == "train" and config.drafter.spot_training):
    dcfg = drafter_config(config)
    oc = drafter_opt_config(config, warmup=job == "warmup")
    resident["drafter train state"] = jax.eval_shape(
        lambda k: init_train_state(init_drafter_params(cfg, dcfg, k), oc), jax.random.key(0))
  return resident


def job_programs(config: ml_collections.ConfigDict, job: str
                 ) -> tuple[dict, list[Program]]:
  """(`job_resident`, programs) of `job` ("sft", "train" = the RL job, "warmup" = the
  drafter's offline warm-up) at the config's shapes; nothing is allocated or compiled."""
  resident = job_resident(config, job)
  cfg = model_config(config)
  if job == "sft":
    return resident, _sft_programs(config, cfg, resident)
  params = resident["policy params"]
  dcfg = drafter_config(config)
  dparams = jax.eval_shape(lambda k: init_drafter_params(cfg, dcfg, k), jax.random.key(0))
  if job == "warmup":
    step = _drafter_program(config, cfg, dcfg, resident["drafter train state"], params, True)
    return resident, [*_rollout_programs(config, cfg, params, None, None, False,
                                         config.drafter.warmup.max_new_tokens), step]
  rl, use_sd = config.rl, config.rollout.speculative.enable
  tcfg, gc = training_model_config(config, cfg), grpo_config(config)
  programs = _rollout_programs(config, cfg, params, dcfg if use_sd else None,
                               dparams if use_sd else None, config.drafter.spot_training)
  capacity = engine_config(config).capacity
  rows = rl.prompts_per_step * rl.num_samples
  unit = rl.mini_batches * rl.micro_batch_rows
  micro = -(-rows // unit) * unit // unit  # micro-batches per mini-batch
  shape = (micro, rl.micro_batch_rows, capacity)
  mini = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
          "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
          "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
          "advantages": jax.ShapeDtypeStruct(shape[:2], jnp.float32),
          "weight": jax.ShapeDtypeStruct(shape[:2], jnp.float32)}
  if rl.ppo_epochs * rl.mini_batches > 1 or rl.kl_coef > 0:
    programs.append(Program("log_probs", make_log_probs(tcfg, gc.sampling).__wrapped__,
                            (params, {k: mini[k] for k in ("tokens", "targets", "loss_mask")}),
                            (), (0,)))
  if rl.ppo_epochs * rl.mini_batches > 1:
    mini["old_logp"] = jax.ShapeDtypeStruct(shape, jnp.float32)
  if rl.kl_coef > 0:
    mini["ref_logp"] = jax.ShapeDtypeStruct(shape, jnp.float32)
  update = make_policy_update(tcfg, gc, _policy_optimizer(config, job), None, None).__wrapped__
  programs.append(Program("rl_update", update, (params, resident["policy optimizer"], mini),
                          (0, 1), (0, 1)))
  if config.drafter.spot_training:
    programs.append(_drafter_program(config, cfg, dcfg, resident["drafter train state"],
                                     params, False))
  return resident, programs


# ---------------------------------------------------------------- the budget


def program_memory(program: Program) -> dict:
  """Compiles `program` for this machine's backend -> XLA's memory analysis in bytes
  (argument, output, alias, temp, and the non-resident arguments) and compile seconds."""
  t0 = time.perf_counter()
  compiled = jax.jit(program.fn, donate_argnums=program.donate_argnums).lower(
      *program.args).compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  own = [a for i, a in enumerate(program.args) if i not in program.resident]
  return {"argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes),
          "alias_bytes": int(m.alias_size_in_bytes),
          "temp_bytes": int(m.temp_size_in_bytes),
          "nonresident_argument_bytes": tree_bytes(own),
          "compile_s": seconds}


def job_budget(config: ml_collections.ConfigDict, job: str, progress: Callable = print) -> dict:
  """Memory of `job` on one device: resident bytes by name, every program's analysis with its
  `peak_bytes` (resident + non-resident arguments + temporaries + outputs not aliased), and
  the job's `peak_bytes` (the largest)."""
  resident, programs = job_programs(config, job)
  resident_bytes = {k: tree_bytes(v) for k, v in resident.items()}
  held = sum(resident_bytes.values())
  rows = {}
  for p in programs:
    progress(f"  {job}: compiling {p.name} ...")
    m = program_memory(p)
    m["peak_bytes"] = (held + m["nonresident_argument_bytes"] + m["temp_bytes"]
                       + m["output_bytes"] - m["alias_bytes"])
    rows[p.name] = m
  return {"job": job, "resident_bytes": resident_bytes, "programs": rows,
          "peak_bytes": max((m["peak_bytes"] for m in rows.values()), default=held)}
