"""GRPO (Shao et al., 2024): one rollout per step, every group trained on, advantages
normalised within each prompt's group (`group_advantages`, rl.scale_by_std), the PPO-clip
loss with clip-higher per token (`Algorithm.policy_loss`), aggregated by rl.loss_agg, with
rl.kl_coef and rl.entropy_coef. DAPO, Dr. GRPO and GSPO refine it."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from tlt_jax.rl.algorithms.base import (Algorithm, register_algorithm, sequence_mean_weights,
                                        token_mean_weights)
from tlt_jax.rl.loss import SHARED_KNOBS, group_advantages


@register_algorithm("grpo")
@dataclasses.dataclass(frozen=True)
class Grpo(Algorithm):
  """GRPO; see the module docstring."""
  reads: ClassVar[tuple[str, ...]] = SHARED_KNOBS

  def advantages(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int) -> np.ndarray:
    del lengths
    return group_advantages(rewards, group_size, self.loss.scale_by_std)

  def loss_weights(self, loss_mask: np.ndarray) -> np.ndarray:
    """rl.loss_agg: the token mean or the sequence mean."""
    if self.loss.loss_agg == "token_mean":
      return token_mean_weights(loss_mask)
    return sequence_mean_weights(loss_mask)
