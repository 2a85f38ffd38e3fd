"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two
biases. Advantages are centred within the group but not divided by its reward std (which
favours groups that are nearly all right or all wrong), and the loss sums its response
tokens over a constant, responses x max_new_tokens, instead of dividing each response by its
own length (which shrinks the penalty of long wrong answers). As TRL's loss_type='dr_grpo'.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from tlt_jax.rl.algorithms.base import register_algorithm
from tlt_jax.rl.algorithms.grpo import Grpo
from tlt_jax.rl.loss import group_advantages


@register_algorithm("dr_grpo")
@dataclasses.dataclass(frozen=True)
class DrGrpo(Grpo):
  """Dr. GRPO; see the module docstring."""
  reads: ClassVar[tuple[str, ...]] = ("clip_eps", "clip_eps_high", "kl_coef", "entropy_coef")

  def advantages(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int) -> np.ndarray:
    del lengths
    return group_advantages(rewards, group_size, scale_by_std=False)

  def loss_weights(self, loss_mask: np.ndarray) -> np.ndarray:
    """Every token weighs 1 / (responses x max_new_tokens): row b, n_b tokens, n_b times."""
    n = loss_mask.sum(axis=1).astype(np.float64)
    return (n / (max(int((n > 0).sum()), 1) * self.max_new_tokens)).astype(np.float32)
