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

A job's peak (`job_budget`) is per device: its resident state (what lives between programs)
plus its hungriest program's own needs. On a mesh of several devices (`num_devices`; on CPU
emulated with `jax_num_cpu_devices`) the programs are laid out as the job lays them out
(`job_meshes`), and the rollout's own copy of the weights is resident beside the training
state.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Collection, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tlt_jax.components import (algorithm_from_config, drafter_opt_config, drafter_settings,
                                engine_config, model_config, policy_adamw, run_drafters,
                                sampling_params, training_model_config)
from tlt_jax.drafters.base import Windows
from tlt_jax.drafter_training.spot import drafter_axes, train_state_shardings
from tlt_jax.drafter_training.train_step import init_train_state, train_step
from tlt_jax.drafter_training.train_step import make_optimizer as make_drafter_optimizer
from tlt_jax.mesh import (AXIS_ORDER, logical_shardings, logical_to_mesh_spec, make_mesh,
                          on_mesh, replica_slices)
from tlt_jax.models import init_params, param_logical_axes
from tlt_jax.drafters import drafter_class, make_drafter
from tlt_jax.optim import make_adamw, optimizer_shardings
from tlt_jax.rl.policy_update import (SEQUENCE_KEYS, batch_inputs, make_log_probs,
                                      make_policy_update)
from tlt_jax.rollout.pool import ExecutablePool, with_output_layout
from tlt_jax.rollout.programs import SlicePrograms
from tlt_jax.rollout.traces import export_program
from tlt_jax.sft_update import make_optimizer, make_train_step
from tlt_jax.speculative.strategy import Strategy

GiB = 1024 ** 3
H100 = "NVIDIA H100 80GB HBM3"
JOBS = ("sft", "train", "warmup")


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled program of a job: fn(*args), args arrays or ShapeDtypeStructs; `resident`
  are the indices of args that live for the whole job (counted once, in the job's resident
  bytes); `mesh`, the mesh it is traced under (None: no mesh)."""
  name: str
  fn: Callable
  args: tuple
  donate_argnums: tuple = ()
  resident: tuple = ()
  mesh: Mesh | None = None


def tree_bytes(tree) -> int:
  """Bytes of one device's share of every array (or ShapeDtypeStruct) leaf of a pytree: the
  whole leaf without a sharding, its shard with one (a PRNG key counts as its key data)."""
  def nbytes(x):
    sharding = getattr(x, "sharding", None)
    shape = x.shape if sharding is None else sharding.shard_shape(x.shape)
    if jnp.issubdtype(x.dtype, jax.dtypes.extended):
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, x.dtype))
      return int(np.prod(data.shape)) * jnp.dtype(data.dtype).itemsize
    return int(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return sum(nbytes(x) for x in jax.tree.leaves(tree))


def _placed(tree, shardings):
  """ShapeDtypeStructs of `tree`'s leaves carrying `shardings` (a matching pytree)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _rows_on(mesh: Mesh, rules, x: jax.ShapeDtypeStruct, row_dim: int = 0):
  """x with its dimension `row_dim` split like rows (`batch`) on mesh."""
  names = ["batch" if dim == row_dim else None for dim in range(len(x.shape))]
  spec = logical_to_mesh_spec(P(*names), x.shape, mesh, rules)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))


@dataclasses.dataclass(frozen=True)
class JobMeshes:
  """Where a job's programs run: `train` (the whole mesh, training layout `rules`) and
  `rollout` (its first replica slice, rollout layout `rollout_rules`)."""
  train: Mesh
  rollout: Mesh
  rules: tuple
  rollout_rules: tuple


def job_meshes(config: ml_collections.ConfigDict, num_devices: int = 1) -> JobMeshes:
  """The config's mesh over this machine's first `num_devices` devices, and its first slice."""
  devices = jax.devices()
  if num_devices > len(devices):
    raise ValueError(f"the budget asks for {num_devices} devices but this machine has "
                     f"{len(devices)}; on CPU emulate them (jax_num_cpu_devices, set before "
                     f"JAX starts; python -m tools.gpu_budget --devices does it)")
  axes = dict(config.mesh.axes) | {n: 1 for n in AXIS_ORDER if n not in config.mesh.axes}
  mesh = make_mesh(axes, devices[:num_devices])
  return JobMeshes(mesh, replica_slices(mesh)[0], tuple(config.mesh.rules),
                   tuple(config.mesh.rollout_rules))


# ---------------------------------------------------------------- CUDA lowering


def gpu_mesh(device_kind: str = H100, axes: Sequence[str] = AXIS_ORDER,
             sizes: Sequence[int] | None = None) -> AbstractMesh:
  """An abstract mesh of `device_kind` GPUs with the named axes (default: every size 1)."""
  sizes = tuple(sizes) if sizes is not None else (1,) * len(axes)
  return AbstractMesh(sizes, tuple(axes), axis_types=(AxisType.Auto,) * len(axes),
                      abstract_device=AbstractDevice(device_kind, None, "cuda"))


def abstract_gpu(device_kind: str = H100, axes: Sequence[str] = AXIS_ORDER):
  """A context: traces inside run on a one-device abstract mesh of `device_kind` (`axes` all of
  size 1), so that Pallas lowers for CUDA without a GPU (jax 0.11 refuses otherwise)."""
  return jax.sharding.use_abstract_mesh(gpu_mesh(device_kind, axes))


def lower_for_cuda(program: Program, device_kind: str = H100,
                   shared: bool = False) -> jax.stages.Lowered:
  """program lowered for CUDA on any machine: traced under an abstract mesh of `device_kind`
  GPUs shaped like the program's mesh (one device without one), its arguments laid out on
  that mesh as they are on the program's. shared: as a slice that shares another's trace
  lowers it (`tlt_jax.rollout.traces`): exported for CUDA, then a call of the export."""
  mesh = program.mesh
  abstract = (gpu_mesh(device_kind) if mesh is None
              else gpu_mesh(device_kind, mesh.axis_names, mesh.axis_sizes))

  def retarget(x):
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(abstract, spec))
  args = jax.tree.map(retarget, program.args)
  with jax.sharding.use_abstract_mesh(abstract):
    fn = program.fn
    if shared:
      fn = export_program(fn, args, program.donate_argnums, platforms=("cuda",)).call
    return jax.jit(fn, donate_argnums=program.donate_argnums).trace(
        *args).lower(lowering_platforms=("cuda",))


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

  def get(self, key, fn, args, donate_argnums=(), out_shardings=None, mesh=None, kind="program",
          share=None):
    if out_shardings is not None:
      fn = with_output_layout(fn, out_shardings)
    self.programs[key] = (fn, tuple(args), tuple(donate_argnums), mesh)
    return lambda *a: jax.eval_shape(fn, *a)


def _sft_programs(config, cfg, resident, meshes: JobMeshes) -> list[Program]:
  params, opt = resident["policy params"], resident["policy optimizer"]
  rows, width = config.sft.rows, config.sft.seq_len
  batch = {k: _rows_on(meshes.train, meshes.rules, jax.ShapeDtypeStruct(
      (rows, width), jnp.bool_ if k == "loss_mask" else jnp.int32))
           for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids")}
  step = make_train_step(training_model_config(config, cfg), _policy_optimizer(config, "sft"),
                         None, None).__wrapped__
  return [Program("sft_step", step, (params, opt, batch), (0, 1), (0, 1), meshes.train)]


def _rollout_programs(config, cfg, params, drafters: dict, log_features: bool,
                      meshes: JobMeshes, max_new_tokens: int | None = None) -> list[Program]:
  """prefill at max_batch, a plain decode call at max_batch and, with drafters (name ->
  drafter, weights on the rollout slice), an SD call for every arm at the largest batch
  bucket SD runs at, on the first slice."""
  econf = engine_config(config)
  if max_new_tokens:
    econf = dataclasses.replace(econf, max_new_tokens=max_new_tokens)
  pool = RecordingPool()
  templates = {n: d.replace(params=None) if d.trained else d for n, d in drafters.items()}
  progs = SlicePrograms(0, meshes.rollout, pool, cfg, templates, econf.capacity,
                        econf.max_new_tokens, 0, meshes.rollout_rules, log_features)
  sp, key, b = sampling_params(config), jax.random.key(0), econf.max_batch
  prompts = np.zeros((b, econf.max_prompt_len), np.int32)  # all distinct: the largest prefill
  rows = np.arange(b, dtype=np.int32)
  state = progs.start(params, drafters, prompts, np.ones((b,), np.int32), rows, rows, key, sp)
  progs.decode(params, drafters, state, key, sp, None, 1, econf.iterations_per_call)
  if drafters and econf.sd_threshold:
    sd_batch = econf.batch_for(econf.sd_threshold)  # the engine's own bucket for it
    small = progs.take_rows(state, np.arange(sd_batch))
    sd = config.rollout.speculative
    for arm in dict.fromkeys((*sd.arms, sd.strategy)):
      strategy = Strategy.parse(arm)
      if set(strategy.drafts) <= set(drafters):
        progs.decode(params, drafters, small, key, sp, strategy, 1, econf.iterations_per_call)
  out = []
  for key_, (fn, args, donate, mesh) in pool.programs.items():
    kind = key_[1]
    if kind not in ("prefill", "decode"):
      continue  # cache allocation and row copies: no temporaries worth a line
    strategy = key_[3] if kind == "decode" else None
    name = f"rollout_{kind}" + (f"_sd{strategy.as_tuple()}" if strategy else "")
    out.append(Program(f"{name}_b{key_[2]}", fn, args, donate, (0, 1), mesh))
  return out


def _drafter_program(config, cfg, settings: dict, state, params, warmup: bool,
                     meshes: JobMeshes) -> Program:
  """The drafter's update on the first slice (spot training and the warm-up train there)."""
  section = config.drafter.warmup if warmup else config.drafter.spot
  rows, width = section.batch_rows, section.window

  def on_slice(dtype, shape=(rows, width)):
    return _rows_on(meshes.rollout, meshes.rollout_rules, jax.ShapeDtypeStruct(shape, dtype))
  windows = Windows(tokens=on_slice(jnp.int32), segment_ids=on_slice(jnp.int32),
                    positions=on_slice(jnp.int32), loss_mask=on_slice(jnp.bool_),
                    features=on_slice(cfg.jnp_dtype, (rows, width, cfg.feature_size)))
  fn = functools.partial(train_step, cfg=training_model_config(config, cfg), settings=settings,
                         oc=drafter_opt_config(config, warmup=warmup))
  return Program("drafter_step", fn, (state, params, windows), (0,), (0, 1), meshes.rollout)


def _policy_optimizer(config, job: str):
  return make_optimizer(config) if job == "sft" else make_adamw(policy_adamw(config))


def job_resident(config: ml_collections.ConfigDict, job: str, meshes: JobMeshes | None = None
                 ) -> dict:
  """What `job` holds on the device between its programs, by name -> abstract pytree laid out
  on `meshes` (default: one device): policy, optimizer, reference, rollout and drafter state,
  each where the job needs it."""
  if job not in JOBS:
    raise ValueError(f"unknown job {job!r}; allowed: {JOBS}")
  meshes = meshes or job_meshes(config)
  cfg = model_config(config)
  shapes = jax.eval_shape(functools.partial(init_params, cfg), jax.random.key(0))
  axes = param_logical_axes(cfg)
  train_sh = logical_shardings(axes, meshes.train, meshes.rules, shapes)
  params = _placed(shapes, train_sh)
  resident = {"policy params": params}
  if job in ("sft", "train"):
    tx = _policy_optimizer(config, job)
    resident["policy optimizer"] = _placed(
        jax.eval_shape(tx.init, shapes), optimizer_shardings(tx, shapes, train_sh, meshes.train))
  if job == "train" and config.rl.kl_coef > 0:
    resident["reference params"] = params
  if job != "sft" and meshes.train.devices.size > 1:
    resident["rollout params"] = _placed(shapes, logical_shardings(
        axes, meshes.rollout, meshes.rollout_rules, shapes))
  settings = _trained_settings(config)
  if settings and (job == "warmup" or (job == "train" and config.drafter.spot_training)):
    oc = drafter_opt_config(config, warmup=job == "warmup")
    state = jax.eval_shape(lambda k: init_train_state(_init_drafters(settings, cfg, k), oc),
                           jax.random.key(0))
    resident["drafter train state"] = _placed(state, train_state_shardings(
        make_drafter_optimizer(oc), state.params, drafter_axes(settings, cfg),
        meshes.rollout, meshes.rollout_rules))
  return resident


def _trained_settings(config) -> dict:
  """name -> Settings of the run's trained drafters."""
  return {n: drafter_settings(config, n) for n in run_drafters(config) if drafter_class(n).trained}


def _init_drafters(settings: dict, cfg, key) -> dict:
  return {n: drafter_class(n).init_params(s, cfg, key) for n, s in settings.items()}


def job_programs(config: ml_collections.ConfigDict, job: str, num_devices: int = 1
                 ) -> tuple[dict, list[Program]]:
  """(`job_resident`, programs) of `job` ("sft", "train" = the RL job, "warmup" = the
  drafter's offline warm-up) at the config's shapes on its mesh over `num_devices` devices;
  nothing is allocated or compiled."""
  meshes = job_meshes(config, num_devices)
  resident = job_resident(config, job, meshes)
  cfg = model_config(config)
  if job == "sft":
    return resident, _sft_programs(config, cfg, resident, meshes)
  rollout_params = resident.get("rollout params", resident["policy params"])
  settings = _trained_settings(config)
  dstate = resident.get("drafter train state")
  if job == "warmup":
    step = _drafter_program(config, cfg, settings, dstate, rollout_params, True, meshes)
    return resident, [*_rollout_programs(config, cfg, rollout_params, {}, False,
                                         meshes, config.drafter.warmup.max_new_tokens), step]
  rl, use_sd = config.rl, config.rollout.speculative.enable
  drafters = {}
  if use_sd:  # the run's drafters, trained ones with their weights on the slice
    shapes = (dstate.params if dstate is not None else
              jax.eval_shape(lambda k: _init_drafters(settings, cfg, k), jax.random.key(0)))
    placed = _placed(shapes, logical_shardings(drafter_axes(settings, cfg), meshes.rollout,
                                               meshes.rollout_rules, shapes))
    drafters = {n: make_drafter(n, drafter_settings(config, n), placed.get(n))
                for n in run_drafters(config)}
  tcfg, algorithm = training_model_config(config, cfg), algorithm_from_config(config)
  params = resident["policy params"]
  spot_on = config.drafter.spot_training and bool(settings)
  programs = _rollout_programs(config, cfg, rollout_params, drafters, spot_on, meshes)
  rows = rl.prompts_per_step * rl.num_samples
  micro = -(-rows // (rl.mini_batches * rl.micro_batch_rows))  # micro-batches per mini-batch
  shape = (micro, rl.micro_batch_rows, engine_config(config).capacity)
  needs_old_logp = rl.ppo_epochs * rl.mini_batches > 1
  mini = {i.key: _rows_on(meshes.train, meshes.rules,
                          jax.ShapeDtypeStruct(i.shape(shape[:2], shape[2]), i.dtype), row_dim=1)
          for i in batch_inputs(algorithm, needs_old_logp)}
  if needs_old_logp or algorithm.uses_reference:
    programs.append(Program("log_probs", make_log_probs(tcfg, algorithm.loss.sampling,
                                                         tuple(rl.update_widths)).__wrapped__,
                            (params, {k: mini[k] for k in SEQUENCE_KEYS}),
                            (), (0,), meshes.train))
  update = make_policy_update(tcfg, algorithm.loss_fn, _policy_optimizer(config, job), None,
                              None, tuple(rl.update_widths)).__wrapped__
  programs.append(Program("rl_update", update, (params, resident["policy optimizer"], mini),
                          (0, 1), (0, 1), meshes.train))
  if spot_on:
    programs.append(_drafter_program(config, cfg, settings, dstate, rollout_params, False,
                                     meshes))
  return resident, programs


# ---------------------------------------------------------------- the budget


def program_memory(program: Program) -> dict:
  """Compiles `program` for this machine's backend -> XLA's memory analysis in bytes
  (argument, output, alias, temp, and the non-resident arguments) and compile seconds."""
  t0 = time.perf_counter()
  with on_mesh(program.mesh):
    compiled = jax.jit(program.fn, donate_argnums=program.donate_argnums).lower(
        *program.args).compile()
  seconds = time.perf_counter() - t0
  m = compiled.memory_analysis()
  own = [a for i, a in enumerate(program.args) if i not in program.resident]
  return {**{f"{k}_bytes": int(getattr(m, f"{k}_size_in_bytes"))
             for k in ("argument", "output", "alias", "temp")},
          "nonresident_argument_bytes": tree_bytes(own), "compile_s": seconds}


def needs_rollout_stand_in(config: ml_collections.ConfigDict) -> bool:
  """Whether this machine's compiles misstate the rollout's temporaries for a GPU: on CPU,
  where bfloat16 matmuls run on float32 copies of their operands and the rollout's decode
  loop converts every layer's weights at once (at the 7B shape two float32 copies of the
  weights, ~57 GiB of temporaries that a GPU, with bfloat16 matmuls, never holds)."""
  return jax.default_backend() == "cpu" and "bfloat16" in (config.model.dtype,
                                                            config.model.param_dtype)


def rollout_stand_in(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config whose rollout programs stand in for the GPU's temporaries on a CPU: float32
  compute and weights (no conversions; every activation twice its bfloat16 size, so an upper
  bound) and a scan over the layers (one layer's weights in flight; on a GPU the decode loop
  reads its static per-layer slices in place)."""
  out = config.copy_and_resolve_references()
  with out.unlocked():
    out.model.update(dtype="float32", param_dtype="float32", scan_layers="all")
  return out


def job_budget(config: ml_collections.ConfigDict, job: str, progress: Callable = print,
               num_devices: int = 1, stand_in: bool | None = None,
               only: Collection[str] | None = None) -> dict:
  """Memory of `job` per device on its mesh over `num_devices` devices: resident bytes by
  name, every program's analysis with its `peak_bytes` (resident + non-resident arguments +
  temporaries + outputs not aliased), and the job's `peak_bytes` (the largest).

  With `stand_in` (default: where `needs_rollout_stand_in`), each rollout program's
  temporaries come from the same program of `rollout_stand_in(config)` (its row says so in
  `temp_source`; the program's own compile is kept as `temp_bytes_as_compiled`); everything
  else is the config's own. `only`: the names of the programs to compile (default all; the
  job's peak is then theirs)."""
  resident, programs = job_programs(config, job, num_devices)
  if only is not None:
    missing = set(only) - {p.name for p in programs}
    if missing:
      raise ValueError(f"job {job!r} has no programs {sorted(missing)}; it has "
                       f"{[p.name for p in programs]}")
    programs = [p for p in programs if p.name in only]
  stand_in = needs_rollout_stand_in(config) if stand_in is None else stand_in
  stand_in = {p.name: p for p in job_programs(rollout_stand_in(config), job, num_devices)[1]
              if p.name.startswith("rollout_") and (only is None or p.name in only)
              } if stand_in else {}
  resident_bytes = {k: tree_bytes(v) for k, v in resident.items()}
  held = sum(resident_bytes.values())
  rows = {}
  for p in programs:
    progress(f"  {job}: compiling {p.name} ...")
    m = program_memory(p)
    m["temp_source"] = "compiled"
    if p.name in stand_in:
      m["temp_bytes_as_compiled"] = m["temp_bytes"]
      m["temp_bytes"] = program_memory(stand_in[p.name])["temp_bytes"]
      m["temp_source"] = "float32 scan stand-in"
    m["peak_bytes"] = (held + m["nonresident_argument_bytes"] + m["temp_bytes"]
                       + m["output_bytes"] - m["alias_bytes"])
    rows[p.name] = m
  return {"job": job, "resident_bytes": resident_bytes, "programs": rows,
          "peak_bytes": max((m["peak_bytes"] for m in rows.values()), default=held)}
