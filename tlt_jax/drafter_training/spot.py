"""Spot training: drafter updates on mesh slices whose rollout work is done.

The trainer holds every trained drafter of the run by name (`train_step`: one update trains
them all on the same windows, each by its own loss).

The rollout engine calls `SpotTrainer.on_slice_idle(s, mesh, block)` from its host loop the
moment slice s runs out of sequences. The trainer files the slice's logged features in the
buffer and starts a thread that runs jitted drafter updates on that slice's devices, one at a
time: it dispatches a step, waits for it, and checks the stop flag before the next. When the
whole rollout ends, `finish()` sets the flag (under the lock that guards every dispatch, so no
step starts after it) and joins the threads, which costs at most the one step in flight.

Idle slices train independent copies of the drafter (no collective between slices that finish
at different times, no re-layout when one joins, one compile per slice for the run), each from
the state at the start of the rollout, on its own random windows. `finish()` averages them,
weighted by steps, in one jitted reduction over the copies stacked along the `replica` axis
(`tlt_jax.mesh.stack_slices`), the only exchange between processes. A process stops training
when its own slices are all done; waiting for other processes' rollouts is not reclaimed.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.drafter_training.buffer import FeatureBuffer
from tlt_jax.drafters.base import Windows
from tlt_jax.drafter_training.train_step import (DrafterOptConfig, DrafterTrainState,
                                                 make_optimizer, train_step)
from tlt_jax.mesh import (ROLLOUT_RULES, local_slices, logical_shardings, logical_to_mesh_spec,
                          replica_slices, stack_slices, to_mesh)
from tlt_jax.drafters import drafter_class, trainable_part
from tlt_jax.models.config import ModelConfig
from tlt_jax.optim import optimizer_shardings
from tlt_jax.rollout.feature_log import FeatureBlock
from tlt_jax.rollout.pool import ExecutablePool


@dataclasses.dataclass(frozen=True)
class SpotConfig:
  """window: slots per packed window; windows: packed rows drawn from the buffer per
  snapshot; batch_rows: windows per update; max_steps: cap per slice and rollout (0 = until
  the rollout ends)."""
  window: int = 256
  windows: int = 32
  batch_rows: int = 8
  max_steps: int = 0

  def __post_init__(self):
    for name, low in (("window", 1), ("windows", 1), ("batch_rows", 1), ("max_steps", 0)):
      if (value := getattr(self, name)) < low:
        raise ValueError(f"drafter.spot.{name} must be >= {low}, got {value}")


@dataclasses.dataclass
class DrafterStepRecord:
  """One drafter update: where it ran (ids of the devices holding its outputs) and when
  (time.perf_counter())."""
  slice: int
  t_dispatch: float
  t_done: float
  devices: frozenset
  loss: float
  top1: float
  tokens: float
  nonfinite: bool = False  # the update was skipped (train_step)


def _rows_step(state: DrafterTrainState, policy_params: dict, windows: Windows, rows,
               cfg, settings, oc):
  """train_step on the windows' rows `rows` [batch_rows] int32."""
  return train_step(state, policy_params, jax.tree.map(lambda x: x[rows], windows), cfg,
                    settings, oc)


def drafter_axes(settings: dict, cfg: ModelConfig) -> dict:
  """name -> the logical axes of each trained drafter's weights (settings: name -> its
  Settings)."""
  return {name: drafter_class(name).logical_axes(s, cfg) for name, s in settings.items()}


def train_state_shardings(tx, param_shapes: dict, param_axes: dict, mesh: Mesh, rules
                          ) -> DrafterTrainState:
  """Shardings of a drafter train state on `mesh`: params (name -> weights, arrays or
  ShapeDtypeStructs) by their logical axes (`drafter_axes`) under `rules`, tx's moments like
  their params, the step counter replicated."""
  p_sh = logical_shardings(param_axes, mesh, rules, param_shapes)
  o_sh = {}
  for name, shapes in param_shapes.items():
    trained = trainable_part(shapes)
    o_sh[name] = optimizer_shardings(tx, trained, {k: p_sh[name][k] for k in trained}, mesh)
  return DrafterTrainState(params=p_sh, opt_state=o_sh, step=NamedSharding(mesh, P()))


@jax.jit
def _copy(tree):
  return jax.tree.map(jnp.copy, tree)  # outputs of a jit never alias undonated inputs


def _average_slices(stacked: DrafterTrainState, counts: jax.Array) -> DrafterTrainState:
  """The slices' copies ([S, ...] leaves) averaged with weights counts / sum(counts) (float
  leaves; integer leaves take the maximum); the step counter advances by the total count.
  No steps anywhere: slice 0's copy, which is the state the rollout began with."""
  total = counts.sum()
  weights = counts.astype(jnp.float32) / jnp.maximum(total, 1)

  def one(x):
    if jnp.issubdtype(x.dtype, jnp.floating):
      w = weights.reshape((-1,) + (1,) * (x.ndim - 1))
      mean = (w * x.astype(jnp.float32)).sum(axis=0).astype(x.dtype)
      return jnp.where(total > 0, mean, x[0])
    return x.max(axis=0)
  out = jax.tree.map(one, stacked)
  return out.replace(step=out.step - counts.max() + total)


class SpotTrainer:
  """Owns the drafter's train state across RL steps and trains it on idle slices."""

  def __init__(self, cfg: ModelConfig, settings: dict, oc: DrafterOptConfig,
               drafter_params: dict, home: Mesh, spot: SpotConfig = SpotConfig(),
               buffer: FeatureBuffer | None = None, rules=ROLLOUT_RULES, seed: int = 0,
               opt_state=None, step: int = 0):
    """settings / drafter_params: name -> each trained drafter's Settings / weights.
    home: the mesh the canonical train state lives on, whose replica slices are the ones
    the rollout engine decodes on (the engine's mesh).
    opt_state / step: restore a saved optimizer state (default: a fresh one)."""
    self.cfg, self.settings, self.oc, self.spot = cfg, dict(settings), oc, spot
    self.rules, self.seed, self.home = tuple(rules), seed, home
    self.buffer = buffer if buffer is not None else FeatureBuffer()
    self._axes = drafter_axes(self.settings, cfg)
    self._tx = make_optimizer(oc)
    self._shardings: dict = {}
    self._shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), drafter_params)
    self.slices = replica_slices(home)
    self.local = local_slices(self.slices)
    home_sh = self._state_shardings(home)
    params = to_mesh(drafter_params, home_sh.params)
    if opt_state is None:
      opt_state = jax.jit(lambda p: {n: self._tx.init(trainable_part(x)) for n, x in p.items()},
                          out_shardings=home_sh.opt_state)(params)
    state = DrafterTrainState(params=params, opt_state=opt_state, step=jnp.asarray(step, jnp.int32))
    self.state = to_mesh(state, home_sh)
    self._average = jax.jit(_average_slices, out_shardings=home_sh)
    self._step = jax.jit(functools.partial(_rows_step, cfg=cfg, settings=self.settings, oc=oc),
                         donate_argnums=(0,))
    self._lock = threading.Lock()
    self.pool = ExecutablePool()  # the update, once per slice mesh
    self._threads: dict[int, threading.Thread] = {}
    self._results: dict[int, tuple[DrafterTrainState, int]] = {}
    self._errors: list[BaseException] = []
    self._stop = False
    self.rl_step = 0
    self.records: list[DrafterStepRecord] = []
    self.idle_since: dict[int, float] = {}
    self._policy_on: Callable[[int], dict] | None = None

  @property
  def params(self) -> dict:
    """name -> each drafter's weights (on the home mesh)."""
    return self.state.params

  def _state_shardings(self, mesh: Mesh) -> DrafterTrainState:
    """`train_state_shardings` of the train state on `mesh`, once per mesh."""
    if mesh not in self._shardings:
      self._shardings[mesh] = train_state_shardings(self._tx, self._shapes, self._axes, mesh,
                                                    self.rules)
    return self._shardings[mesh]

  @property
  def compile_s(self) -> float:
    """Seconds spent compiling the update (once per slice)."""
    return self.pool.compile_seconds

  def _executable(self, mesh: Mesh, args, ahead: bool = False):
    how = self.pool.compile_ahead if ahead else self.pool.get
    # Every slice runs the one update: traced once where this process drives several.
    return how(mesh, self._step, args, donate_argnums=(0,), mesh=mesh, kind="drafter_update",
               share="drafter_update" if len(self.local) > 1 else None)

  def precompile(self, meshes: list[Mesh], policy_on: Callable[[int], dict],
                 ahead: bool = False) -> float:
    """Compiles the update for each slice mesh ahead of the first rollout (otherwise a slice
    spends its first idle seconds compiling); slices of other processes (policy_on(s) is None)
    are skipped. ahead: in the background (`ExecutablePool.compile_ahead`; a slice that goes
    idle first waits for its compile). Returns the seconds it took."""
    t0 = time.perf_counter()
    sp = self.spot
    for s, mesh in enumerate(meshes):
      if policy_on(s) is None:
        continue
      def abstract(dtype, *feature, mesh=mesh):
        """[windows, window, *feature] on the slice, windows split over the batch axes."""
        shape = (sp.windows, sp.window, *feature)
        spec = logical_to_mesh_spec(P("batch", *[None] * (len(shape) - 1)), shape, mesh, self.rules)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
      ints = abstract(jnp.int32)
      windows = Windows(tokens=ints, features=abstract(jnp.float32, self.cfg.feature_size),
                        segment_ids=ints, positions=ints, loss_mask=abstract(jnp.bool_))
      state = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                           self.state, self._state_shardings(mesh))
      rows = jax.ShapeDtypeStruct((sp.batch_rows,), jnp.int32, sharding=NamedSharding(mesh, P()))
      self._executable(mesh, (state, policy_on(s), windows, rows), ahead=ahead)
    return time.perf_counter() - t0

  def begin(self, rl_step: int, policy_on: Callable[[int], dict]) -> None:
    """Starts a rollout session: policy_on(s) gives the policy params placed on slice s (their
    embedding and LM head are read by the loss)."""
    if self._threads:
      raise RuntimeError("SpotTrainer.begin called while a session is running; call finish()")
    self.rl_step, self._policy_on = rl_step, policy_on
    self._compile_at_begin = self.compile_s
    self._stop = False
    self.records, self.idle_since, self._results, self._errors = [], {}, {}, []

  def on_slice_idle(self, s: int, mesh: Mesh, block: FeatureBlock | None) -> None:
    """The engine's callback: file the slice's features, start training on the slice."""
    self.idle_since[s] = time.perf_counter()
    self.buffer.add(self.rl_step, block)
    if self._policy_on is None:
      raise RuntimeError("SpotTrainer.on_slice_idle before begin()")
    if len(self.idle_since) == len(self.local):
      # This process's last slice: its rollout is over, no step may start after this.
      self._stop_now()
      return
    if self.buffer.num_sequences == 0:
      return
    t = threading.Thread(target=self._train_on_slice, args=(s, mesh, self._policy_on(s)),
                         name=f"spot-train-{s}", daemon=True)
    self._threads[s] = t
    t.start()

  def _train_on_slice(self, s: int, mesh: Mesh, policy_params: dict) -> None:
    try:
      sp = self.spot
      # A private copy: the reshard may reuse buffers that the home state shares with the
      # engine's drafter weights, and each update donates its input.
      state = _copy(to_mesh(self.state, self._state_shardings(mesh)))
      rng = np.random.default_rng([self.seed, self.rl_step, s])
      rep = NamedSharding(mesh, P())
      version, windows, real, n = -1, None, 0, 0
      while not sp.max_steps or n < sp.max_steps:
        if self.buffer.version != version:  # new sequences arrived: re-pack
          version = self.buffer.version
          windows, real = self.buffer.windows_on(mesh, sp.window, sp.windows, rng, rules=self.rules)
        rows = jax.device_put(rng.integers(0, real, sp.batch_rows).astype(np.int32), rep)
        args = (state, policy_params, windows, rows)
        exe = self._executable(mesh, args)  # outside the lock: finish() never waits for it
        with self._lock:  # the stop check and the dispatch are one atomic unit
          if self._stop:
            break
          t = time.perf_counter()
          state, metrics = exe(*args)
        metrics = jax.device_get(metrics)  # waits for this step: one at a time
        n += 1
        devices = frozenset(d.id for x in jax.tree.leaves(state.params) for d in x.devices())
        self.records.append(DrafterStepRecord(
            slice=s, t_dispatch=t, t_done=time.perf_counter(), devices=devices,
            loss=float(metrics["loss"]), top1=float(metrics["top1"]),
            tokens=float(metrics["tokens"]), nonfinite=bool(metrics["nonfinite"])))
      self._results[s] = (state, n)
    except BaseException as e:  # re-raised by finish(): nothing fails silently
      self._errors.append(e)

  def _stop_now(self) -> float:
    """Stops every slice's loop (once); returns when that happened."""
    with self._lock:
      if not self._stop:
        self._stop, self._t_stop = True, time.perf_counter()
      return self._t_stop

  def finish(self) -> dict:
    """Stops training (if the last slice has not already: no step starts after that), joins
    the slices' threads, averages their states into the trainer's state and returns this
    rollout's metrics, summed over every process's slices: drafter_steps, drafter_tokens,
    drafter_loss / drafter_top1 (means over the steps with a finite loss; None without any),
    drafter_nonfinite (steps skipped for a non-finite loss or gradient), idle_slice_s
    (slice-seconds between each slice's idle moment and the end of the rollout),
    reclaimed_slice_s (slice-seconds spent in drafter steps in that window), drafter_compile_s
    (compiling the update for a slice the first time it trains), rollout_end (that end)."""
    t_end = self._stop_now()
    for t in self._threads.values():
      t.join()
    self._threads = {}
    if self._errors:
      raise RuntimeError("spot training failed on a slice") from self._errors[0]
    copies = {}
    for s in self.local:
      mesh = self.slices[s]
      state, n = self._results.get(s, (self.state, 0))
      copies[s] = (to_mesh(state, self._state_shardings(mesh)),
                   jax.device_put(np.int32(n), NamedSharding(mesh, P())))
    states, counts = stack_slices(copies, self.home)
    self.state = self._average(states, counts)
    recs = self.records
    finite = [r for r in recs if not r.nonfinite]
    sums = np.asarray([
        sum(n for _, n in self._results.values()), sum(r.tokens for r in recs),
        sum(r.loss for r in finite), sum(r.top1 for r in finite), len(finite),
        len(recs) - len(finite), sum(t_end - t for t in self.idle_since.values()),
        sum(min(r.t_done, t_end) - r.t_dispatch for r in recs)], np.float32)
    if jax.process_count() > 1:  # every process's slices count
      from jax.experimental import multihost_utils
      sums = multihost_utils.process_allgather(sums).sum(axis=0)
    steps, tokens, loss, top1, n_recs, nonfinite, idle, reclaimed = sums.tolist()
    return {"drafter_steps": int(steps), "drafter_tokens": tokens,
            "drafter_loss": loss / n_recs if n_recs else None,
            "drafter_top1": top1 / n_recs if n_recs else None,
            "drafter_nonfinite": int(nonfinite), "idle_slice_s": idle,
            "reclaimed_slice_s": reclaimed,
            "drafter_compile_s": self.compile_s - self._compile_at_begin, "rollout_end": t_end}
