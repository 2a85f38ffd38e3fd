"""What every RL algorithm (tlt_jax.rl.algorithms) shares: the shared rl.* loss knobs
(`LossConfig`), the layout of the update's batch (`BatchInput`), group-normalised advantages
and the policy's log-probs, as pure functions. What differs between algorithms (advantages,
aggregation, importance ratio, clipping, the loss itself, and which batch inputs the loss
reads) is the algorithm's (`tlt_jax.rl.algorithms.base.Algorithm`).

A batch holds one sequence (prompt + response) per row, right-padded to a bucketed width.
Each of its arrays is a `BatchInput`: a key, a dtype and a level, "row" ([B], one value per
sequence) or "token" ([B, T], one per position). Every batch has the sequence's own
(`SEQUENCE_INPUTS`):

  tokens [B, T] int32      prompt + response ids
  targets [B, T] int32     tokens shifted left: the token each position predicts
  loss_mask [B, T] bool    positions whose target is a response token

the algorithm declares the rest (`Algorithm.batch_inputs`); GRPO's:

  advantages [B] float32   one per sequence (the algorithm's `response_inputs`)
  weight [B] float32       each row's weight in its mini-batch's loss (the algorithm's
                           `loss_weights`)
  ref_logp [B, T] float32  the frozen reference policy's log-probs (when it uses a reference:
                           kl_coef > 0)

and the update adds two of its own:

  old_logp [B, T] float32  log-probs of the targets under the policy that sampled them,
                           recomputed by the trainer (the rollout's numbers are not trusted);
                           only when a step takes more than one optimizer step (absent = the
                           current params sampled the batch)
  rollout_logp [B, T] f32  the rollout's own log-probs of the response tokens (when given:
                           the update reports how far its own are from them)

Every log-prob (logp, old_logp, ref_logp) and the entropy are taken under the distribution the
rollout sampled from (`LossConfig.sampling`: temperature, top-k, top-p, exactly as
`speculative.sampling.support_logits` applies them), so at temperature 0.7 the gradient is that
of the policy that produced the tokens, not of the untempered one. Top-k / top-p renormalise
over the support the current parameters give, with the scored token always inside it: at the
sampling parameters that is exactly the sampler's q, and after an update has moved the support
the token keeps a finite log-prob (and a gradient) instead of -inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.models.config import ModelConfig
from tlt_jax.models.attention_inputs import rows_inputs
from tlt_jax.models.decoder import forward
from tlt_jax.speculative.sampling import SamplingParams, log_softmax, support_logits

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean")
INPUT_LEVELS = ("row", "token")


@dataclasses.dataclass(frozen=True)
class BatchInput:
  """One array of the update's batch: `key`, its numpy `dtype`, and its `level`: "row" (one
  value per sequence, [..., B]) or "token" (one per position, [..., B, T])."""
  key: str
  dtype: type
  level: str

  def __post_init__(self):
    if self.level not in INPUT_LEVELS:
      raise ValueError(f"batch input {self.key!r}: level={self.level!r} is not allowed; "
                       f"allowed values: {INPUT_LEVELS}")

  def shape(self, rows: tuple[int, ...], width: int) -> tuple[int, ...]:
    """Its shape in a batch of `rows` (the leading dims, rows last) of `width` tokens."""
    return (*rows, width) if self.level == "token" else tuple(rows)


TOKENS = BatchInput("tokens", np.int32, "token")
TARGETS = BatchInput("targets", np.int32, "token")
LOSS_MASK = BatchInput("loss_mask", np.bool_, "token")
SEQUENCE_INPUTS = (TOKENS, TARGETS, LOSS_MASK)
ADVANTAGES = BatchInput("advantages", np.float32, "row")
WEIGHT = BatchInput("weight", np.float32, "row")
REF_LOGP = BatchInput("ref_logp", np.float32, "token")
OLD_LOGP = BatchInput("old_logp", np.float32, "token")
ROLLOUT_LOGP = BatchInput("rollout_logp", np.float32, "token")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The shared loss knobs; all but `sampling` are the config's rl.<field> knobs, with these
  defaults (SHARED_KNOBS). Each algorithm reads some of them (its `reads`); a run that sets
  another away from its default stops (`tlt_jax.components.unread_knobs`).
  clip_eps / clip_eps_high: the ratio's clip range [1 - eps, 1 + eps_high]
  (eps_high > eps: DAPO's clip-higher; equal: plain PPO clipping). scale_by_std: divide
  advantages by the group's reward std. loss_agg: 'token_mean' (every response token weighs
  the same) or 'sequence_mean' (every response weighs the same). kl_coef: weight of the KL to
  the reference (0 = no reference). entropy_coef: weight of the entropy bonus. sampling: the
  rollout's sampling distribution, under which tokens are scored (see the module docstring);
  it must not be greedy."""
  clip_eps: float = 0.2
  clip_eps_high: float = 0.28
  scale_by_std: bool = True
  loss_agg: str = "token_mean"
  kl_coef: float = 0.0
  entropy_coef: float = 0.0
  sampling: SamplingParams = SamplingParams()

  def __post_init__(self):
    if self.sampling.greedy:
      raise ValueError("rollout.temperature=0 (greedy) gives every sample of a prompt the same "
                       "response, so every GRPO advantage is 0 and nothing is learnt; set "
                       "rollout.temperature > 0 (e.g. 1.0)")
    if not 0 < self.clip_eps < 1 or self.clip_eps_high <= 0:
      raise ValueError(f"rl.clip_eps={self.clip_eps} must be in (0, 1) and rl.clip_eps_high="
                       f"{self.clip_eps_high} positive")
    if self.loss_agg not in LOSS_AGGREGATIONS:
      raise ValueError(f"rl.loss_agg={self.loss_agg!r} is not allowed; allowed values: "
                       f"{LOSS_AGGREGATIONS}")
    if self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError("rl.kl_coef and rl.entropy_coef must be >= 0")


# The rl.* knobs LossConfig holds, which algorithms share.
SHARED_KNOBS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name != "sampling")


def group_advantages(rewards: np.ndarray, group_size: int, scale_by_std: bool = True,
                     eps: float = 1e-6) -> np.ndarray:
  """(r - mean of its group) [/ (std of its group + eps)] for rewards [N], groups being
  consecutive runs of group_size (the samples of one prompt). float32 [N]."""
  r = np.asarray(rewards, np.float64)
  if r.ndim != 1 or r.size % group_size:
    raise ValueError(f"{r.size} rewards do not split into groups of {group_size}")
  g = r.reshape(-1, group_size)
  adv = g - g.mean(axis=1, keepdims=True)
  if scale_by_std:
    adv = adv / (g.std(axis=1, keepdims=True) + eps)
  return adv.reshape(-1).astype(np.float32)


def token_log_probs(params: dict, tokens: jax.Array, targets: jax.Array, loss_mask: jax.Array,
                    cfg: ModelConfig, sp: SamplingParams = SamplingParams(),
                    with_entropy: bool = False):
  """log q(targets) [B, T] float32 (0 off the mask) under the sampling distribution sp (not
  greedy; see the module docstring) and, if asked, the entropy of q [B, T]."""
  sp = sp.with_numerics(cfg.numerics)
  logits, _, _, _ = forward(params, tokens, rows_inputs(*tokens.shape), cfg)
  scaled = logits.astype(jnp.float32) / sp.temperature
  support = support_logits(logits, sp)
  if sp.top_k or sp.top_p < 1.0:
    is_target = jax.nn.one_hot(targets, scaled.shape[-1], dtype=jnp.bool_)
    support = jnp.where(is_target, scaled, support)
  logq_all = log_softmax(support, sp)
  logp = jnp.take_along_axis(logq_all, targets[..., None], axis=-1)[..., 0]
  logp = jnp.where(loss_mask, logp, 0.0)
  if not with_entropy:
    return logp, None
  q = jnp.exp(logq_all)
  # Off the top-k / top-p support log q is -inf: zero it before the product, so that neither
  # the value nor the gradient sees 0 * -inf (a where after the product would pass NaN back).
  entropy = -jnp.sum(q * jnp.where(q > 0, logq_all, 0.0), axis=-1)
  return logp, jnp.where(loss_mask, entropy, 0.0)
