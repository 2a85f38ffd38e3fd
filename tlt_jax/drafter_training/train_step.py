"""Drafter optimiser and the jitted, donated update step (only drafter weights train).

A train state holds every trained drafter of a run by name (`{name: params}`), each with its
own optimizer state: one update step trains them all on the same windows, each by its own
loss (`TrainedDrafter.loss`), each exactly as if it trained alone."""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import optax

from tlt_jax.drafters.base import Windows
from tlt_jax.drafters import drafter_class, fixed_part, make_drafter, trainable_part
from tlt_jax.models.config import ModelConfig
from tlt_jax.models.policy import Policy
from tlt_jax.optim import AdamWConfig, make_adamw


@dataclasses.dataclass(frozen=True)
class DrafterOptConfig:
  """AdamW as in EAGLE: betas (0.9, 0.95), weight decay 0.01, clip 1.0, linear warm-up, for
  every trained drafter; and the shared loss knobs: ce_weight, train_depth and
  train_step_decay (EAGLE's `drafter_loss` reads all three, the MTP heads the decay: each
  family names what it reads in `loss_reads`)."""
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


# The loss knobs of DrafterOptConfig, read by the families that name them in `loss_reads`.
LOSS_KNOBS = ("ce_weight", "train_depth", "train_step_decay")


@flax.struct.dataclass
class DrafterTrainState:
  """params: name -> a trained drafter's whole weights; opt_state: name -> its optimizer
  state over its trainable part (`trainable_part`); step: updates taken (all drafters
  together)."""
  params: dict
  opt_state: dict
  step: jax.Array  # int32, advanced by every update


def init_train_state(params: dict, oc: DrafterOptConfig) -> DrafterTrainState:
  """A fresh train state of the drafters `params` (name -> weights)."""
  tx = make_optimizer(oc)
  return DrafterTrainState(params=params,
                           opt_state={n: tx.init(trainable_part(p)) for n, p in params.items()},
                           step=jnp.zeros((), jnp.int32))


def loss_options(name: str, oc: DrafterOptConfig) -> dict:
  """The shared loss knobs drafter `name`'s loss reads (its `loss_reads`)."""
  return {k: getattr(oc, k) for k in drafter_class(name).loss_reads}


def train_step(state: DrafterTrainState, policy_params: dict, batch: Windows, cfg: ModelConfig,
               settings: dict, oc: DrafterOptConfig):
  """One AdamW update of every drafter in the state on a batch of windows -> (new state,
  metrics). settings: name -> each drafter's Settings.

  Fixed index maps (a reduced vocabulary's) get no gradient and no update. A drafter whose
  loss or gradient is not finite keeps its weights and optimizer state (metric `nonfinite` =
  1): one bad batch would otherwise poison it for the rest of the run, and nothing would fail,
  since verification keeps the tokens exact while the accept length collapses.
  Metrics: with one drafter its loss's own (loss, top1, tokens, ...), grad_norm and nonfinite;
  with several, loss (their sum), top1 (their mean), tokens (the first's), grad_norm (over
  all), nonfinite (any), and each drafter's own as '<name>/<metric>'."""
  policy = Policy(policy_params, cfg)
  tx = make_optimizer(oc)
  params, opt_state, per = {}, {}, {}
  for name, p in state.params.items():
    fixed, trainable = fixed_part(p), trainable_part(p)
    grads, metrics = jax.grad(lambda t, name=name, fixed=fixed: make_drafter(
        name, settings[name], {**t, **fixed}).loss(policy, batch, **loss_options(name, oc)),
        has_aux=True)(trainable)
    updates, new_opt = tx.update(grads, state.opt_state[name], trainable)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])
    keep = lambda new, old, finite=finite: jax.tree.map(  # noqa: E731
        lambda n, o: jnp.where(finite, n, o), new, old)
    params[name] = {**keep(optax.apply_updates(trainable, updates), trainable), **fixed}
    opt_state[name] = keep(new_opt, state.opt_state[name])
    per[name] = dict(metrics, grad_norm=grad_norm, nonfinite=(~finite).astype(jnp.float32))
  new_state = DrafterTrainState(params=params, opt_state=opt_state, step=state.step + 1)
  if len(per) == 1:
    return new_state, next(iter(per.values()))
  first = next(iter(per.values()))
  metrics = {"loss": sum(m["loss"] for m in per.values()),
             "top1": sum(m["top1"] for m in per.values()) / len(per), "tokens": first["tokens"],
             "grad_norm": jnp.sqrt(sum(m["grad_norm"] ** 2 for m in per.values())),
             "nonfinite": jnp.max(jnp.stack([m["nonfinite"] for m in per.values()]))}
  metrics.update({f"{name}/{k}": v for name, m in per.items() for k, v in m.items()})
  return new_state, metrics


def jit_train_step(cfg: ModelConfig, settings: dict, oc: DrafterOptConfig):
  """train_step compiled with the train state donated (updated in place)."""
  return jax.jit(functools.partial(train_step, cfg=cfg, settings=settings, oc=oc),
                 donate_argnums=(0,))
