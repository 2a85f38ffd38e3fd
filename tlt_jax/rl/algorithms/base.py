"""What an RL algorithm is to the main loop (tlt_jax.train), the policy update
(tlt_jax.rl.policy_update) and the memory budget (tlt_jax.budget): `Algorithm`, and the
registry `ALGORITHMS` its subclasses join by name (`register_algorithm`).

An algorithm is a frozen dataclass that owns everything in which algorithms differ; the loop
and the update only call it:

  declared
    inputs        the per-response batch inputs its host side makes (`BatchInput`s: key,
                  dtype, row or token level; GRPO: the advantages), and `batch_inputs`, all
                  its loss reads besides the sequence's (with the row weights and, when it
                  uses a reference policy, its log-probs): the update, its compile-ahead and
                  the memory budget lay out the batch from them
    min_group_size  the fewest samples per prompt it works with (`check_group_size`)
  on the host, once per step
    rounds        how many rollouts a step may take (1; DAPO's dynamic sampling takes more)
    keep_groups   which groups of a step's samples are worth an update (all; DAPO drops the
                  groups whose rewards are all equal, whose advantages would be 0)
    response_inputs  the values of `inputs` for each response, from the rewards and
                  response lengths (`advantages`: one float per response)
    loss_weights  the weight of each response's mean token loss in the loss of its
                  mini-batch: the aggregation and its normaliser (computed for the whole
                  mini-batch, so gradient accumulation over micro-batches is exact)
    step_metrics  the algorithm's own metrics.jsonl entries
  in the jitted update, per micro-batch
    clip_range    (eps_low, eps_high): the ratio's clip range [1 - eps_low, 1 + eps_high]
    log_ratio     the log importance ratio: per token [b, T], or per sequence [b, 1] (GSPO)
    policy_loss   the loss from the policy's log-probs of the batch: the clipped surrogate,
                  KL, entropy, aggregated with the batch's `weight`
    loss_fn       policy_loss of the current parameters' log-probs (what the update
                  differentiates)

The loss of a mini-batch is sum_b weight_b * mean_t(loss_bt) over its responses b (mean over
b's response tokens t): GRPO's token mean weighs response b by n_b / (all tokens), its
sequence mean by 1 / (responses), Dr. GRPO by n_b / (responses x max_new_tokens).

`loss` holds the shared rl.* loss knobs (`LossConfig`); `reads` names those an algorithm
uses, and a run that sets any other away from its default stops with one line
(`tlt_jax.rl.algorithms.make_algorithm`). An algorithm's own knobs are its `Settings`
dataclass: the config section `rl.<name>` is made from its fields and defaults
(tlt_jax.config). Adding one is a class decorated `@register_algorithm("name")`, in the
package or in a module of your own named in the config's `plugins` (docs/extending.md).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.knobs import NoSettings
from tlt_jax.models.config import ModelConfig
from tlt_jax.registry import register
from tlt_jax.rl.loss import (ADVANTAGES, REF_LOGP, SHARED_KNOBS, WEIGHT, BatchInput,
                             LossConfig, token_log_probs)

# name -> algorithm class (rl.algorithm), filled by `register_algorithm`
ALGORITHMS: dict[str, type] = {}


def register_algorithm(name: str):
  """Class decorator: registers an `Algorithm` subclass as rl.algorithm=`name` (its knobs:
  the section rl.<name>); ValueError for a name already registered, or for a `reads` that
  names a shared knob that does not exist (a typo would otherwise hide that knob's use)."""
  add = register(ALGORITHMS, name, "algorithm")

  def checked(cls: type) -> type:
    if unknown := sorted(set(getattr(cls, "reads", ())) - set(SHARED_KNOBS)):
      raise ValueError(f"rl.algorithm={name!r} declares shared knobs that do not exist: "
                       f"{unknown}; the shared knobs are {SHARED_KNOBS}")
    return add(cls)
  return checked


def token_mean_weights(loss_mask: np.ndarray) -> np.ndarray:
  """float32 [R] from loss_mask [R, T] bool: every response token of the mini-batch weighs
  the same (n_b / all tokens)."""
  n = loss_mask.sum(axis=1).astype(np.float64)
  return (n / max(n.sum(), 1.0)).astype(np.float32)


def sequence_mean_weights(loss_mask: np.ndarray) -> np.ndarray:
  """float32 [R] from loss_mask [R, T] bool: every response of the mini-batch weighs the
  same (1 / responses; padding rows, which have no tokens, 0)."""
  has = loss_mask.any(axis=1)
  return (has / max(float(has.sum()), 1.0)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Algorithm(abc.ABC):
  """An RL algorithm (see the module docstring): the PPO-clip loss per token with
  rl.kl_coef and rl.entropy_coef, over advantages and row weights that a subclass defines.
  max_new_tokens: the rollout's response budget (for algorithms that use it)."""
  Settings: ClassVar[type] = NoSettings
  # The shared rl.* knobs (LossConfig's fields) this algorithm reads.
  reads: ClassVar[tuple[str, ...]] = ()
  rounds: ClassVar[int] = 1  # the most rollouts one step may take
  # The per-response batch inputs `response_inputs` makes.
  inputs: ClassVar[tuple[BatchInput, ...]] = (ADVANTAGES,)
  min_group_size: ClassVar[int] = 2  # advantages compare the samples of a prompt
  loss: LossConfig = LossConfig()
  max_new_tokens: int = 256
  settings: object = NoSettings()

  # ---------------------------------------------------------------- declared

  @classmethod
  def check_group_size(cls, group_size: int, name: str) -> None:
    """ValueError (one line) when rl.num_samples=`group_size` is too few samples per prompt
    for rl.algorithm=`name`."""
    if group_size < cls.min_group_size:
      raise ValueError(f"rl.num_samples={group_size}: rl.algorithm={name!r} compares samples "
                       f"within a group, so it needs at least {cls.min_group_size}")

  @property
  def uses_reference(self) -> bool:
    """Whether the loss reads a frozen reference policy's log-probs ("ref_logp")."""
    return self.loss.kl_coef > 0

  @property
  def batch_inputs(self) -> tuple[BatchInput, ...]:
    """Every batch input the loss reads besides the sequence's (tokens, targets, loss_mask):
    `inputs`, the row weights, and the reference's log-probs when it uses one."""
    return (*self.inputs, WEIGHT, *((REF_LOGP,) if self.uses_reference else ()))

  # ---------------------------------------------------------------- host, once per step

  def keep_groups(self, rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [G]: which of the G = len(rewards) / group_size groups the update trains on."""
    return np.ones(len(rewards) // group_size, bool)

  @abc.abstractmethod
  def advantages(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int) -> np.ndarray:
    """float32 [N] from rewards [N] float32 and response lengths [N] int (tokens, EOS
    included); groups are consecutive runs of group_size."""

  def response_inputs(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int
                      ) -> dict[str, np.ndarray]:
    """key -> the values of each of `inputs` for the N responses (rewards [N] float32,
    lengths [N] int, groups of group_size): [N] for a row-level input, or for a token-level
    one N arrays of the response's tokens' values (placed at the positions that predict
    them)."""
    return {"advantages": self.advantages(rewards, lengths, group_size)}

  @abc.abstractmethod
  def loss_weights(self, loss_mask: np.ndarray) -> np.ndarray:
    """float32 [R]: the weight of each row's mean token loss in the loss of the mini-batch
    whose response tokens are loss_mask [R, T] bool (padding rows: none, weight 0)."""

  def step_metrics(self, rewards: np.ndarray, lengths: np.ndarray) -> dict:
    """Extra metrics.jsonl entries of a step (none by default)."""
    del rewards, lengths
    return {}

  # ---------------------------------------------------------------- jitted, per micro-batch

  @property
  def clip_range(self) -> tuple[float, float]:
    """(eps_low, eps_high): the ratio is clipped to [1 - eps_low, 1 + eps_high]."""
    return self.loss.clip_eps, self.loss.clip_eps_high

  def log_ratio(self, logp: jax.Array, old_logp: jax.Array, maskf: jax.Array) -> jax.Array:
    """log(pi / pi_old) per token: [b, T] float32 from log-probs [b, T] and the float mask."""
    del maskf
    return logp - old_logp

  def policy_loss(self, logp: jax.Array, batch: dict,
                  entropy: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(scalar loss, metrics) of one (micro-)batch from logp [b, T] float32, the log-probs
    of its targets under the parameters being trained (0 off the mask), and their entropy
    [b, T] (needed when entropy_coef > 0); batch: `batch_inputs` and the sequence's. The loss is this
    batch's share of its mini-batch's: sum_b weight_b * mean_t(loss_bt), with
    loss_bt = -min(ratio * A_b, clip(ratio) * A_b) + kl_coef * k3 - entropy_coef * entropy."""
    gc = self.loss
    maskf = batch["loss_mask"].astype(jnp.float32)
    adv = batch["advantages"][:, None]
    # Without old_logp the batch was sampled by these very params (one update per step).
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    ratio = jnp.exp(self.log_ratio(logp, old_logp, maskf))
    eps_low, eps_high = self.clip_range
    clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = -jnp.minimum(ratio * adv, clipped * adv)
    if gc.kl_coef > 0:  # k3, the low-variance estimator of KL(policy || reference)
      delta = batch["ref_logp"] - logp
      kl = jnp.exp(delta) - delta - 1.0
      per_token = per_token + gc.kl_coef * kl
    if gc.entropy_coef > 0:
      per_token = per_token - gc.entropy_coef * entropy
    row = jnp.sum(per_token * maskf, axis=1) / jnp.maximum(maskf.sum(axis=1), 1.0)
    loss = jnp.sum(batch["weight"] * row)

    def token_mean(x):  # x [b, T] or a sequence-level [b, 1]
      return jnp.sum(x * maskf) / jnp.maximum(maskf.sum(), 1.0)
    metrics = {"pg_loss": loss,
               # tokens whose gradient the clip removed (the clipped term won the min)
               "clip_frac": token_mean((clipped * adv < ratio * adv).astype(jnp.float32)),
               "ratio_mean": token_mean(ratio),
               "kl": token_mean(kl) if gc.kl_coef > 0 else jnp.zeros(()),
               "entropy": token_mean(entropy) if gc.entropy_coef > 0 else jnp.zeros(())}
    return loss, metrics

  def loss_fn(self, params: dict, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """(scalar loss, metrics) of one (micro-)batch (`tlt_jax.rl.loss`'s layout): the
    policy's log-probs of its targets (under the rollout's sampling distribution), then
    `policy_loss`."""
    logp, entropy = token_log_probs(params, batch["tokens"], batch["targets"],
                                    batch["loss_mask"], cfg, self.loss.sampling,
                                    with_entropy=self.loss.entropy_coef > 0)
    loss, metrics = self.policy_loss(logp, batch, entropy)
    if "rollout_logp" in batch:  # how far the trainer's numbers are from the rollout's
      diff = jnp.where(batch["loss_mask"], jnp.abs(jax.lax.stop_gradient(logp)
                                                   - batch["rollout_logp"]), 0.0)
      metrics["rollout_logp_diff_mean"] = jnp.sum(diff) / jnp.maximum(
          jnp.sum(batch["loss_mask"]), 1)
      metrics["rollout_logp_diff_max"] = jnp.max(diff)
    return loss, metrics
