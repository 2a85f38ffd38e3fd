"""Drafter optimiser and the jitted, donated update step (only drafter weights train)."""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.drafter import DrafterConfig, fixed_part, trainable_part
from tlt_jax.drafter_training.loss import Windows
from tlt_jax.drafters.eagle import EagleDrafter
from tlt_jax.models.policy import Policy
from tlt_jax.optim import AdamWConfig, make_adamw


@dataclasses.dataclass(frozen=True)
class DrafterOptConfig:
  """AdamW as in EAGLE: betas (0.9, 0.95), weight decay 0.01, clip 1.0, linear warm-up; and
  the loss: ce_weight, train_depth and train_step_decay (see `drafter_loss`)."""
  learning_rate: float = 3e-4
  lr_warmup_steps: int = 20
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  ce_weight: float = 0.1
  train_depth: int = 1
  train_step_decay: float = 0.8
  section: str = "drafter"  # the config section named in errors

  def __post_init__(self):
    self.adamw()  # checks the optimizer's values
    if self.grad_clip <= 0:
      raise ValueError(f"{self.section}.grad_clip={self.grad_clip} must be positive")
    if self.ce_weight < 0:
      raise ValueError(f"{self.section}.ce_weight={self.ce_weight} must be >= 0")
    if self.train_depth < 1:
      raise ValueError(f"{self.section}.train_depth={self.train_depth} must be >= 1 "
                       f"(1 = single-step training)")
    if not 0 < self.train_step_decay <= 1:
      raise ValueError(f"{self.section}.train_step_decay={self.train_step_decay} must be in (0, 1]")

  def adamw(self) -> AdamWConfig:
    return AdamWConfig(learning_rate=self.learning_rate, lr_warmup_steps=self.lr_warmup_steps,
                       b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                       grad_clip=self.grad_clip, section=self.section)


def make_optimizer(oc: DrafterOptConfig) -> optax.GradientTransformation:
  return make_adamw(oc.adamw())


@flax.struct.dataclass
class DrafterTrainState:
  """params: the whole drafter; opt_state: over its trainable part (`trainable_part`)."""
  params: dict
  opt_state: optax.OptState
  step: jax.Array  # int32, advanced by every update


def init_train_state(params: dict, oc: DrafterOptConfig) -> DrafterTrainState:
  return DrafterTrainState(params=params,
                           opt_state=make_optimizer(oc).init(trainable_part(params)),
                           step=jnp.zeros((), jnp.int32))


def train_step(state: DrafterTrainState, policy_params: dict, batch: Windows, cfg: ModelConfig,
               dcfg: DrafterConfig, oc: DrafterOptConfig):
  """One AdamW update of the drafter on a batch of windows -> (new state, metrics). The
  fixed vocabulary map (if any) gets no gradient and no update. A non-finite loss or gradient
  leaves the weights and the optimizer state as they were (metric `nonfinite` = 1): one bad
  batch would otherwise poison the drafter for the rest of the run, and nothing would fail,
  since verification keeps the tokens exact while the accept length collapses."""
  fixed, trainable = fixed_part(state.params), trainable_part(state.params)
  policy = Policy(policy_params, cfg)
  grads, metrics = jax.grad(lambda p: EagleDrafter({**p, **fixed}, dcfg).loss(
      policy, batch, ce_weight=oc.ce_weight, train_depth=oc.train_depth,
      train_step_decay=oc.train_step_decay), has_aux=True)(trainable)
  updates, opt_state = make_optimizer(oc).update(grads, state.opt_state, trainable)
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
  params = {**keep(optax.apply_updates(trainable, updates), trainable), **fixed}
  metrics = dict(metrics, grad_norm=grad_norm, nonfinite=(~finite).astype(jnp.float32))
  return DrafterTrainState(params=params, opt_state=keep(opt_state, state.opt_state),
                           step=state.step + 1), metrics


def jit_train_step(cfg: ModelConfig, dcfg: DrafterConfig, oc: DrafterOptConfig):
  """train_step compiled with the train state donated (updated in place)."""
  return jax.jit(functools.partial(train_step, cfg=cfg, dcfg=dcfg, oc=oc), donate_argnums=(0,))
