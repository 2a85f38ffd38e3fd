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
  the loss: ce_weight, steps_ahead and step_decay (see `drafter_loss`)."""
  learning_rate: float = 3e-4
  warmup_steps: int = 20
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  ce_weight: float = 0.1
  steps_ahead: int = 1
  step_decay: float = 0.8
  section: str = "drafter"  # the config section named in errors

  def __post_init__(self):
    self.adamw()  # checks the optimizer's values
    if self.clip_norm <= 0:
      raise ValueError(f"{self.section}.clip_norm={self.clip_norm} must be positive")
    if self.ce_weight < 0:
      raise ValueError(f"{self.section}.ce_weight={self.ce_weight} must be >= 0")
    if self.steps_ahead < 1:
      raise ValueError(f"{self.section}.train_steps_ahead={self.steps_ahead} must be >= 1 "
                       f"(1 = single-step training)")
    if not 0 < self.step_decay <= 1:
      raise ValueError(f"{self.section}.train_step_decay={self.step_decay} must be in (0, 1]")

  def adamw(self) -> AdamWConfig:
    return AdamWConfig(learning_rate=self.learning_rate, warmup_steps=self.warmup_steps,
                       b1=self.b1, b2=self.b2, weight_decay=self.weight_decay,
                       grad_clip=self.clip_norm, section=self.section)


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
  fixed vocabulary map (if any) gets no gradient and no update."""
  fixed, trainable = fixed_part(state.params), trainable_part(state.params)
  policy = Policy(policy_params, cfg)
  grads, metrics = jax.grad(lambda p: EagleDrafter({**p, **fixed}, dcfg).loss(
      policy, batch, ce_weight=oc.ce_weight, steps_ahead=oc.steps_ahead,
      step_decay=oc.step_decay), has_aux=True)(trainable)
  updates, opt_state = make_optimizer(oc).update(grads, state.opt_state, trainable)
  params = {**optax.apply_updates(trainable, updates), **fixed}
  metrics = dict(metrics, grad_norm=optax.tree.norm(grads))
  return DrafterTrainState(params=params, opt_state=opt_state, step=state.step + 1), metrics


def jit_train_step(cfg: ModelConfig, dcfg: DrafterConfig, oc: DrafterOptConfig):
  """train_step compiled with the train state donated (updated in place)."""
  return jax.jit(functools.partial(train_step, cfg=cfg, dcfg=dcfg, oc=oc), donate_argnums=(0,))
