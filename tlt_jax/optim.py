"""The one optimizer every trainer uses (SFT, GRPO, drafter): AdamW after global-norm
clipping, with a linear warm-up and an optional cosine decay; and its state's placement."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


@dataclasses.dataclass(frozen=True)
class AdamWConfig:
  """learning_rate: the peak. With lr_warmup_steps = W > 0, update s (0-based) of the first W
  uses learning_rate * (s + 1) / (W + 1), so the first update already trains, and the peak
  is reached at update W.
  decay_steps: 0 keeps the peak after the warm-up; else a cosine decay reaching
  end_lr_fraction * learning_rate at decay_steps (the run's length, `<section>.steps`).
  grad_clip: the global gradient norm is clipped to this (0 = no clipping).
  section: the config section named in errors."""
  learning_rate: float
  lr_warmup_steps: int = 0
  decay_steps: int = 0
  end_lr_fraction: float = 1.0
  b1: float = 0.9
  b2: float = 0.999
  weight_decay: float = 0.0
  grad_clip: float = 0.0
  section: str = "optimizer"

  def __post_init__(self):
    s = self.section
    if self.learning_rate <= 0:
      raise ValueError(f"{s}.learning_rate={self.learning_rate} must be positive")
    for name in ("lr_warmup_steps", "decay_steps", "weight_decay", "grad_clip"):
      if getattr(self, name) < 0:
        raise ValueError(f"{s}.{name}={getattr(self, name)} must be >= 0")
    if self.decay_steps and self.lr_warmup_steps >= self.decay_steps:
      raise ValueError(f"{s}.lr_warmup_steps={self.lr_warmup_steps} must be < {s}.steps="
                       f"{self.decay_steps} (the decay's length)")
    if not 0.0 <= self.end_lr_fraction <= 1.0:
      raise ValueError(f"{s}.end_lr_fraction={self.end_lr_fraction} must be in [0, 1]")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"{s}.{name}={getattr(self, name)} must be in [0, 1)")

  def schedule(self) -> optax.Schedule | float:
    """The learning rate of update s (0-based): a float when it is constant."""
    # optax's warm-ups start at init_value; from 0 the first update would not move the
    # weights. Starting one warm-up increment above 0 gives peak * (s + 1) / (W + 1).
    first = self.learning_rate / (self.lr_warmup_steps + 1)
    if self.decay_steps:
      return optax.warmup_cosine_decay_schedule(
          init_value=first, peak_value=self.learning_rate,
          warmup_steps=self.lr_warmup_steps,
          decay_steps=self.decay_steps, end_value=self.learning_rate * self.end_lr_fraction)
    if self.lr_warmup_steps:
      return optax.linear_schedule(first, self.learning_rate, self.lr_warmup_steps)
    return self.learning_rate


def make_adamw(oc: AdamWConfig, decay_mask: Callable | None = None
               ) -> optax.GradientTransformation:
  """The optimizer `oc` describes; decay_mask(params) -> bool pytree picks the leaves that
  weight decay applies to (None: all)."""
  return optax.chain(
      optax.clip_by_global_norm(oc.grad_clip) if oc.grad_clip > 0 else optax.identity(),
      optax.adamw(oc.schedule(), b1=oc.b1, b2=oc.b2, weight_decay=oc.weight_decay,
                  mask=decay_mask))


def init_optimizer(tx: optax.GradientTransformation, params: dict, mesh: Mesh):
  """(opt_state, its shardings) for params already placed on `mesh`: moments are laid out
  like their params (asked for explicitly: XLA would replicate the zeros that init makes,
  a full copy of both moments on every device); scalars (step counts) are replicated."""
  sharding = optimizer_shardings(tx, params, jax.tree.map(lambda x: x.sharding, params), mesh)
  return jax.jit(tx.init, out_shardings=sharding)(params), sharding


def optimizer_shardings(tx: optax.GradientTransformation, params, param_shardings, mesh: Mesh):
  """The shardings of tx's state for `params` (arrays or ShapeDtypeStructs) laid out as
  `param_shardings`: every moment like its param, scalars replicated on `mesh`."""
  replicated = NamedSharding(mesh, P())
  return optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(tx.init, params),
                               param_shardings, transform_non_params=lambda _: replicated)
