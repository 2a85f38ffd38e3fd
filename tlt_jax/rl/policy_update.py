"""The policy update: batches built on the host, log-probs and the update jitted over the
whole mesh, with gradient accumulation over micro-batches; `PolicyUpdater` runs one RL step's
epochs of it with an algorithm's loss weights and loss (tlt_jax.rl.algorithms), and decides
nothing an algorithm could.

Shapes: a step's B = prompts x samples rows are padded to mini_batches x micro_batches x
micro_rows (padding rows have an empty loss mask and weight 0) and laid out
[mini_batches, micro_batches, micro_rows, T]; T is the longest row rounded up to a multiple of
64, so a run compiles a handful of widths, not one per step.

With `widths` (rl.update_widths), T is always the rollout's capacity, so a run compiles one
update, and each micro-batch is computed at the narrowest of the widths that holds its rows
(a `lax.switch` over statically sliced copies of the step, inside that one program), the rows
of each mini-batch sorted longest first: in a long-tailed step only the micro-batch of the
longest responses pays for their width, the rest for their own.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tlt_jax.knobs import ConfigError
from tlt_jax.mesh import data_parallel_size, logical_to_mesh_spec
from tlt_jax.models.config import ModelConfig
from tlt_jax.optim import init_optimizer
from tlt_jax.rl.algorithms import Algorithm
from tlt_jax.rl.loss import (ADVANTAGES, OLD_LOGP, REF_LOGP, ROLLOUT_LOGP, SEQUENCE_INPUTS,
                             BatchInput, token_log_probs)
from tlt_jax.rollout.pool import ExecutablePool
from tlt_jax.speculative.sampling import SamplingParams

WIDTH_MULTIPLE = 64
SEQUENCE_KEYS = tuple(i.key for i in SEQUENCE_INPUTS)  # what the log-probs are computed from


def batch_inputs(algorithm: Algorithm, old_logp: bool, rollout_logp: bool = False
                 ) -> tuple[BatchInput, ...]:
  """Every array of an update's batch (tlt_jax.rl.loss): the sequence's, the algorithm's
  (`Algorithm.batch_inputs`), and the update's own old_logp (when a step takes more than one
  optimizer step) and rollout_logp (when the rollout's log-probs are passed)."""
  return (*SEQUENCE_INPUTS, *algorithm.batch_inputs, *((OLD_LOGP,) if old_logp else ()),
          *((ROLLOUT_LOGP,) if rollout_logp else ()))


def check_micro_batch_rows(micro_batch_rows: int, data_ways: int) -> None:
  """The policy update splits each micro-batch's rows over the data-parallel devices."""
  if micro_batch_rows % data_ways:
    raise ConfigError(f"rl.micro_batch_rows={micro_batch_rows} must be a multiple of the "
                      f"data-parallel devices (replica x fsdp = {data_ways})")


def build_rows(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               inputs: dict, rows: int, pad_id: int, max_width: int | None = None,
               declared: Sequence[BatchInput] = (ADVANTAGES,)) -> dict[str, np.ndarray]:
  """Host arrays of (prompt + completion) sequences, [rows] or [rows, T] (rows >=
  len(prompts)): the sequence's (tlt_jax.rl.loss) and one per key of `inputs`, each laid out
  as the `declared` input of that key says: a row-level one from [len(prompts)] values
  (padding rows 0), a token-level one from each completion's values of its tokens, placed at
  the positions that predict them (0 elsewhere)."""
  n = len(prompts)
  if rows < n:
    raise ValueError(f"{n} sequences do not fit in {rows} rows")
  levels = {i.key: i for i in declared}
  if set(inputs) - set(levels):
    raise ValueError(f"batch inputs {sorted(set(inputs) - set(levels))} are not declared; "
                     f"declared: {sorted(levels)}")
  longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
  width = -(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
  if max_width is not None:
    width = min(width, max(max_width, longest))
  tokens = np.full((rows, width), pad_id, np.int32)
  targets = np.zeros((rows, width), np.int32)
  mask = np.zeros((rows, width), bool)
  for i, (p, c) in enumerate(zip(prompts, completions)):
    seq = list(p) + list(c)
    tokens[i, :len(seq)] = seq
    targets[i, :len(seq) - 1] = seq[1:]
    # Position t predicts token t + 1: the response tokens are predicted from len(p) - 1 on.
    mask[i, len(p) - 1:len(seq) - 1] = True
  out = {"tokens": tokens, "targets": targets, "loss_mask": mask}
  for key, values in inputs.items():
    spec = levels[key]
    if spec.level == "row":
      out[key] = np.pad(np.asarray(values[:n], spec.dtype), (0, rows - n))
      continue
    out[key] = np.zeros((rows, width), spec.dtype)
    for i, (p, v) in enumerate(zip(prompts, values)):
      out[key][i, len(p) - 1:len(p) - 1 + len(v)] = v
  return out


def by_length(batch: dict[str, np.ndarray], mini_batches: int) -> dict[str, np.ndarray]:
  """[rows, ...] with each mini-batch's rows sorted by their tokens, longest first (a stable
  sort: rows of one length keep their order); which rows a mini-batch holds is unchanged."""
  rows = batch["tokens"].shape[0]
  size = rows // mini_batches
  length = batch["loss_mask"].shape[1] - np.argmax(batch["loss_mask"][:, ::-1], axis=1)
  length = np.where(batch["loss_mask"].any(axis=1), length, 0)
  order = np.concatenate([m * size + np.argsort(-length[m * size:(m + 1) * size], kind="stable")
                          for m in range(mini_batches)])
  return {k: v[order] for k, v in batch.items()}


def at_narrowest_width(fn: Callable, widths: Sequence[int], pads_output: bool = False
                       ) -> Callable:
  """fn(mb) for a micro-batch dict whose [b, T] arrays are cut to the narrowest of `widths`
  (ascending) that holds every row's loss mask, T itself when none does: one branch per
  width (`lax.switch`), so a micro-batch of short rows computes at their width. pads_output:
  fn returns one [b, width] array, padded back with zeros to [b, T]."""
  def run(mb):
    full = mb["loss_mask"].shape[1]
    cuts = tuple(sorted({min(w, full) for w in widths} | {full}))
    col = jnp.arange(full)
    needed = jnp.max(jnp.where(mb["loss_mask"], col + 2, 0))  # the target's column + 1
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(cuts), needed), len(cuts) - 1)

    def branch(w):
      def at(mb):
        cut = {k: v[:, :w] if v.ndim == 2 and v.shape[1] == full else v for k, v in mb.items()}
        out = fn(cut)
        return jnp.pad(out, ((0, 0), (0, full - w))) if pads_output else out
      return at
    return jax.lax.switch(index, [branch(w) for w in cuts], mb)
  return run


def split_minibatches(batch: dict[str, np.ndarray], mini_batches: int, micro_rows: int,
                      loss_weights: Callable[[np.ndarray], np.ndarray]
                      ) -> dict[str, np.ndarray]:
  """[rows, ...] -> [mini_batches, micro_batches, micro_rows, ...], adding each mini-batch's
  row weights "weight", loss_weights(its loss_mask [rows of the mini-batch, T]) (an
  algorithm's `loss_weights`); rows must be a multiple of mini_batches * micro_rows."""
  rows = batch["tokens"].shape[0]
  if rows % (mini_batches * micro_rows):
    raise ValueError(f"{rows} rows do not split into {mini_batches} mini-batches of "
                     f"micro-batches of {micro_rows} rows")
  micro = rows // (mini_batches * micro_rows)
  out = {k: v.reshape(mini_batches, micro, micro_rows, *v.shape[1:]) for k, v in batch.items()}
  mask = out["loss_mask"].reshape(mini_batches, micro * micro_rows, -1)
  out["weight"] = np.stack([loss_weights(m) for m in mask]).reshape(
      mini_batches, micro, micro_rows)
  return out


def make_log_probs(cfg: ModelConfig, sp: SamplingParams, widths: Sequence[int] = ()):
  """jitted (params, micro_batches [M, b, T] dict) -> log-probs [M, b, T] under the sampling
  distribution sp, one micro-batch at a time (so memory is that of one micro-batch); with
  `widths`, each at its narrowest (`at_narrowest_width`)."""

  @jax.jit
  def log_probs(params, mb):
    def one(x):
      return token_log_probs(params, x["tokens"], x["targets"], x["loss_mask"], cfg, sp)[0]
    return jax.lax.map(at_narrowest_width(one, widths, pads_output=True) if widths else one,
                       mb)
  return log_probs


def nonfinite_update_message(step: int, metrics: dict, last_checkpoint: int | None) -> str:
  """One line: which of the update's quantities were not finite, and what is intact."""
  bad = [f"{k} {metrics[k]}" for k in ("loss", "grad_norm") if not math.isfinite(metrics[k])]
  if not metrics["params_finite"]:
    bad.append("the updated parameters")
  kept = (f"the checkpoint of step {last_checkpoint} is intact" if last_checkpoint else
          "no checkpoint was written")
  return (f"step {step}: the policy update was not finite ({', '.join(bad)}); it was not "
          f"applied and the run stopped before any checkpoint or export ({kept}). Lower "
          f"rl.learning_rate, check the rewards, or set rl.on_nonfinite=skip to go on without "
          f"such updates")


def make_policy_update(cfg: ModelConfig, loss_fn: Callable, tx: optax.GradientTransformation,
                       param_sharding, opt_sharding, widths: Sequence[int] = ()):
  """jitted (params, opt_state, mini_batch [M, b, T] dict) -> (params, opt_state, metrics):
  gradients of loss_fn(params, micro_batch, cfg) -> (loss, metrics) (an algorithm's
  `loss_fn`) summed over the M micro-batches (each already weighted by its share of the
  mini-batch; with `widths`, each computed at its narrowest, `at_narrowest_width`), then one
  optimizer step. Metrics are token means over the micro-batches, those named *_max their
  maximum. params and opt_state are donated. An update whose
  loss, gradient norm or new parameters are not finite is not applied (the old params and
  optimizer state come back) and reports metrics["nonfinite"] = 1, so the caller can stop
  before anything non-finite reaches a checkpoint, or go on without it."""

  @functools.partial(jax.jit, donate_argnums=(0, 1),
                     out_shardings=(param_sharding, opt_sharding, None))
  def update(params, opt_state, mini_batch):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def micro(mb):
      (loss, metrics), grads = grad_fn(params, mb, cfg)
      return grads, (loss, metrics)

    def body(acc, mb):
      grads, out = (at_narrowest_width(micro, widths) if widths else micro)(mb)
      return jax.tree.map(jnp.add, acc, grads), out

    grads, (losses, metrics) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), mini_batch)
    updates, new_opt_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # Token means of micro-batches, weighted by their tokens (a padding one holds none).
    tokens = jnp.sum(mini_batch["loss_mask"], axis=(1, 2), dtype=jnp.float32)
    share = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {k: jnp.max(v) if k.endswith("_max") else jnp.sum(v * share)
           for k, v in metrics.items() if k != "pg_loss"}
    out.update(loss=jnp.sum(losses), grad_norm=optax.tree.norm(grads))
    params_finite = all_finite(new_params)
    finite = jnp.isfinite(out["loss"]) & jnp.isfinite(out["grad_norm"]) & params_finite
    out.update(nonfinite=(~finite).astype(jnp.float32),
               params_finite=params_finite.astype(jnp.float32))
    def keep(new, old):
      return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    return keep(new_params, params), keep(new_opt_state, opt_state), out

  return update


def all_finite(tree) -> jax.Array:
  """Scalar bool: every floating element of every leaf of `tree` is finite."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


class PolicyUpdater:
  """One RL step's update of the policy: `ppo_epochs` passes over the step's responses, each
  `mini_batches` optimizer steps of gradients accumulated over micro-batches of
  `micro_batch_rows` rows, on the whole mesh. The update is compiled ahead of time once per
  batch shape (a handful of widths per run), so the seconds spent compiling are reported apart
  from the update's. widths: each micro-batch at the narrowest of these widths that holds it,
  in one program whatever the step (see the module docstring); () = every step at its longest
  row's width."""

  def __init__(self, cfg: ModelConfig, algorithm: Algorithm, tx: optax.GradientTransformation,
               params: dict, mesh: Mesh, rules, ppo_epochs: int, mini_batches: int,
               micro_batch_rows: int, ref_params: dict | None = None,
               widths: Sequence[int] = ()):
    check_micro_batch_rows(micro_batch_rows, data_parallel_size(mesh))
    self.algorithm, self.mesh, self.rules = algorithm, mesh, rules
    self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
    self.micro_rows, self.ref_params = micro_batch_rows, ref_params
    self.widths = tuple(sorted(widths))
    # With one optimizer step per RL step the ratio is 1: old log-probs are not needed.
    self.needs_old_logp = ppo_epochs * mini_batches > 1
    if algorithm.uses_reference != (ref_params is not None):
      raise ValueError(f"the algorithm {'reads' if algorithm.uses_reference else 'does not read'}"
                       f" a reference policy's log-probs (rl.kl_coef="
                       f"{algorithm.loss.kl_coef}): give ref_params exactly when it does")
    self.opt_state, opt_sharding = init_optimizer(tx, params, mesh)
    param_sharding = jax.tree.map(lambda x: x.sharding, params)
    self._update = make_policy_update(cfg, algorithm.loss_fn, tx, param_sharding, opt_sharding,
                                      self.widths)
    self._log_probs = make_log_probs(cfg, algorithm.loss.sampling, self.widths)
    self.pool = ExecutablePool()  # one update and one log-prob program per batch shape

  def rows_for(self, sequences: int) -> int:
    """Rows of a step's batch: `sequences` rounded up to whole mini-batches."""
    unit = self.mini_batches * self.micro_rows
    return -(-sequences // unit) * unit

  def __call__(self, params: dict, prompts: Sequence[Sequence[int]],
               completions: Sequence[Sequence[int]], inputs: dict, pad_id: int,
               max_width: int, min_rows: int = 0,
               rollout_logps: Sequence[Sequence[float]] | None = None
               ) -> tuple[dict, dict, float]:
    """Updates `params` (donated) and the optimizer state on one step's responses (prompts[i] +
    completions[i]) with their values of the algorithm's `inputs` (its `response_inputs`, e.g.
    {"advantages": [N] float32}); returns (params, the updates' mean metrics, seconds spent
    compiling). min_rows: pad the batch to at least the rows of this many sequences (a step
    that trains on fewer responses than usual keeps the usual batch shape, so it compiles nothing
    new, and takes one optimizer step per mini-batch that holds responses). rollout_logps: the
    rollout's log-probs of the completions' tokens: the metrics then hold how far the
    trainer's own log-probs of them, before any optimizer step, are from them
    (rollout_logp_diff_mean and _max, over the first mini-batch's tokens: after its step the
    policy has moved)."""
    declared = self.algorithm.inputs
    if set(inputs) != {i.key for i in declared}:
      raise ValueError(f"the algorithm's inputs are {[i.key for i in declared]}; got "
                       f"{sorted(inputs)}")
    if rollout_logps is not None:
      inputs, declared = {**inputs, ROLLOUT_LOGP.key: rollout_logps}, (*declared, ROLLOUT_LOGP)
    rows = build_rows(prompts, completions, inputs,
                      self.rows_for(max(len(prompts), min_rows)), pad_id, max_width=max_width,
                      declared=declared)
    if self.widths:  # one width, the rollout's capacity: one program for every step
      rows = by_length(_widened(rows, _round_up(max_width)), self.mini_batches)
    batch = self._place(split_minibatches(rows, self.mini_batches, self.micro_rows,
                                          self.algorithm.loss_weights))
    compile_before = self.pool.compile_seconds
    if self.needs_old_logp:
      batch[OLD_LOGP.key] = self._batch_log_probs(params, batch)
    if self.algorithm.uses_reference:
      batch[REF_LOGP.key] = self._batch_log_probs(self.ref_params, batch)
    # A mini-batch of padding rows alone takes no optimizer step: with zero gradients AdamW
    # would still move the weights (momentum, weight decay) and count a step.
    real = np.flatnonzero(rows["loss_mask"].reshape(self.mini_batches, -1).any(axis=1))
    metrics = []
    for _ in range(self.ppo_epochs):
      for m in real:
        mini = {k: v[m] for k, v in batch.items()}
        update = self.pool.get(("update", _shapes(mini)), self._update,
                               (params, self.opt_state, mini), donate_argnums=(0, 1),
                               mesh=self.mesh, kind="policy_update")
        params, self.opt_state, out = update(params, self.opt_state, mini)
        metrics.append(out)
    metrics = jax.device_get(metrics)
    out = {k: float(np.mean([m[k] for m in metrics])) for k in metrics[0]}
    for k in ("rollout_logp_diff_mean", "rollout_logp_diff_max"):
      if k in out:  # the first optimizer step's: the parameters that sampled the rollout
        out[k] = float(metrics[0][k])
    out["nonfinite"] = float(sum(m["nonfinite"] for m in metrics))  # updates not applied
    out["params_finite"] = float(min(m["params_finite"] for m in metrics))
    return params, out, self.pool.compile_seconds - compile_before

  def compile_ahead(self, params: dict, sequences: int, max_width: int,
                    priority: int = 0, rollout_logps: bool = False) -> None:
    """Queues the compiles of a step's programs (`ExecutablePool.compile_ahead`) for
    `sequences` responses (rounded up to whole mini-batches) of `max_width` tokens at most:
    the update and, when the step needs them, the log-probs. Needs `widths` (one shape for
    every step). rollout_logps: the steps pass the rollout's log-probs (`__call__`)."""
    if not self.widths:
      raise ValueError("compiling the update ahead needs rl.update_widths (one batch shape "
                       "for every step)")
    shape = (self.mini_batches, self.rows_for(sequences) // (self.mini_batches * self.micro_rows),
             self.micro_rows, _round_up(max_width))
    batch = {i.key: self._abstract(i.shape(shape[:3], shape[3]), i.dtype)
             for i in batch_inputs(self.algorithm, self.needs_old_logp, rollout_logps)}
    if self.needs_old_logp or self.algorithm.uses_reference:  # `_batch_log_probs`' inputs
      flat = {k: self._abstract((shape[0] * shape[1], *shape[2:]), batch[k].dtype, lead=1)
              for k in SEQUENCE_KEYS}
      self.pool.compile_ahead(("log_probs", _shapes(flat)), self._log_probs, (params, flat),
                              mesh=self.mesh, kind="log_probs", priority=priority)
    mini = {k: self._abstract(v.shape[1:], v.dtype, lead=1) for k, v in batch.items()}
    self.pool.compile_ahead(("update", _shapes(mini)), self._update,
                            (params, self.opt_state, mini), donate_argnums=(0, 1),
                            mesh=self.mesh, kind="policy_update", priority=priority)

  def _abstract(self, shape, dtype, lead: int = 2) -> jax.ShapeDtypeStruct:
    """An abstract array laid out as `_place` lays out one: the dimension after `lead`
    leading ones (rows) split over the data-parallel axes."""
    names = (None,) * lead + ("batch",) + (None,) * (len(shape) - lead - 1)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(self.mesh, (
        logical_to_mesh_spec(P(*names), shape, self.mesh, self.rules))))

  def _place(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """[mini, micro, rows, ...] host arrays, rows split over the data-parallel axes."""
    return {k: jax.device_put(v, self._abstract(v.shape, v.dtype).sharding)
            for k, v in batch.items()}

  def _batch_log_probs(self, params: dict, batch: dict) -> jax.Array:
    """log-probs over the [mini_batches, micro_batches, rows, T] batch -> [.., T]."""
    flat = {k: batch[k].reshape(-1, *batch[k].shape[2:])
            for k in SEQUENCE_KEYS}
    # Laid out as `compile_ahead` expects them (a reshape may leave another layout).
    flat = {k: jax.device_put(v, self._abstract(v.shape, v.dtype, lead=1).sharding)
            for k, v in flat.items()}
    log_probs = self.pool.get(("log_probs", _shapes(flat)), self._log_probs,
                              (params, flat), mesh=self.mesh, kind="log_probs")
    return log_probs(params, flat).reshape(batch["tokens"].shape)


def _shapes(batch: dict) -> tuple:
  """A batch's key in the pool: its arrays' names and shapes."""
  return tuple(sorted((k, tuple(v.shape)) for k, v in batch.items()))


def _round_up(width: int) -> int:
  return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def _widened(rows: dict[str, np.ndarray], width: int) -> dict[str, np.ndarray]:
  """`build_rows`' token-level arrays padded (pad columns: token and target as the last
  column's padding, no loss, 0 for the others) to `width` columns."""
  out = dict(rows)
  for k, v in rows.items():
    if v.ndim == 2 and v.shape[1] < width:  # the token-level arrays
      fill = rows["tokens"][:, -1:] if k == "tokens" else np.zeros_like(v[:, :1])
      out[k] = np.concatenate([v, np.broadcast_to(fill, (v.shape[0], width - v.shape[1]))],
                              axis=1)
  return out
