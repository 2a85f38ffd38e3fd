"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization"): GRPO's advantages with
an importance ratio per response, not per token: s_b = exp(mean over b's tokens of
log(pi / pi_old)), clipped to [1 - eps, 1 + eps_high] and applied to the whole response, and
every response weighing the same in the loss. A sequence ratio moves far less than a token's,
so the clip range is GSPO's own (`rl.gspo`, the paper's 3e-4 and 4e-4), and rl.clip_eps /
rl.clip_eps_high / rl.loss_agg are not read. As TRL's importance_sampling_level='sequence'
with loss_type='grpo'.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from tlt_jax.rl.algorithms.base import register_algorithm, sequence_mean_weights
from tlt_jax.rl.algorithms.grpo import Grpo


@dataclasses.dataclass(frozen=True)
class GspoSettings:
  """clip_eps / clip_eps_high: the sequence ratio's clip range [1 - clip_eps,
  1 + clip_eps_high]."""
  clip_eps: float = 3e-4
  clip_eps_high: float = 4e-4


@register_algorithm("gspo")
@dataclasses.dataclass(frozen=True)
class Gspo(Grpo):
  """GSPO; see the module docstring."""
  Settings: ClassVar[type] = GspoSettings
  reads: ClassVar[tuple[str, ...]] = ("scale_by_std", "kl_coef", "entropy_coef")
  settings: GspoSettings = GspoSettings()

  def __post_init__(self):
    s = self.settings
    if not 0 < s.clip_eps < 1 or s.clip_eps_high <= 0:
      raise ValueError(f"rl.gspo.clip_eps={s.clip_eps} must be in (0, 1) and "
                       f"rl.gspo.clip_eps_high={s.clip_eps_high} positive")

  def loss_weights(self, loss_mask: np.ndarray) -> np.ndarray:
    """Every response weighs the same."""
    return sequence_mean_weights(loss_mask)

  @property
  def clip_range(self) -> tuple[float, float]:
    return self.settings.clip_eps, self.settings.clip_eps_high

  def log_ratio(self, logp: jax.Array, old_logp: jax.Array, maskf: jax.Array) -> jax.Array:
    """[b, 1]: the mean token log-ratio of each response."""
    total = jnp.sum((logp - old_logp) * maskf, axis=1, keepdims=True)
    return total / jnp.maximum(maskf.sum(axis=1, keepdims=True), 1.0)
