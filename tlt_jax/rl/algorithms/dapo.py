"""DAPO (Yu et al., 2025): GRPO with dynamic sampling, overlong reward shaping, clip-higher
and a token-level loss.

- Dynamic sampling: a group whose rewards are all equal (every sample right, or every one
  wrong) has zero advantages and teaches nothing; DAPO drops it and rolls out fresh prompts
  until `rl.prompts_per_step` groups with a spread are kept, at most `max_rounds` rollouts
  per step. Short of that, the step trains on the groups it kept (the batch keeps its shape:
  the missing rows are padding), or on none.
- Overlong shaping: a response longer than max_new_tokens - overlong_buffer loses
  overlong_penalty x (how far into the buffer it went) / overlong_buffer from its reward, in
  the advantages only (`reward_mean` stays the task's reward, so runs compare). The buffer is
  a quarter of the budget unless set (DAPO's runs: 4096 of 20480 tokens).
- Clip-higher is GRPO's `rl.clip_eps_high` above `rl.clip_eps` (the defaults); the loss is
  always the token-level mean (so DAPO does not read rl.loss_agg).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import numpy as np

from tlt_jax.rl.algorithms.base import register_algorithm, token_mean_weights
from tlt_jax.rl.algorithms.grpo import Grpo
from tlt_jax.rl.loss import group_advantages


@dataclasses.dataclass(frozen=True)
class DapoSettings:
  """max_rounds: rollouts a step may take to fill its groups (1 = filter only).
  overlong_buffer: the last tokens of the response budget over which the length penalty
  ramps up (0 = no shaping; -1 = a quarter of rollout.max_new_tokens, so that any budget
  runs DAPO as it is). overlong_penalty: the penalty at the budget."""
  max_rounds: int = 3
  overlong_buffer: int = -1
  overlong_penalty: float = 1.0


@register_algorithm("dapo")
@dataclasses.dataclass(frozen=True)
class Dapo(Grpo):
  """DAPO; see the module docstring."""
  Settings: ClassVar[type] = DapoSettings
  reads: ClassVar[tuple[str, ...]] = ("clip_eps", "clip_eps_high", "scale_by_std", "kl_coef",
                                      "entropy_coef")
  settings: DapoSettings = DapoSettings()

  def __post_init__(self):
    s = self.settings
    if s.max_rounds < 1:
      raise ValueError(f"rl.dapo.max_rounds={s.max_rounds} must be >= 1")
    if s.overlong_buffer != -1 and not 0 <= s.overlong_buffer < self.max_new_tokens:
      raise ValueError(f"rl.dapo.overlong_buffer={s.overlong_buffer} must be in [0, "
                       f"rollout.max_new_tokens={self.max_new_tokens}), or -1 for a quarter "
                       f"of it")
    if s.overlong_penalty < 0:
      raise ValueError(f"rl.dapo.overlong_penalty={s.overlong_penalty} must be >= 0")

  @property
  def rounds(self) -> int:
    return self.settings.max_rounds

  @property
  def buffer(self) -> int:
    """The overlong buffer in tokens (rl.dapo.overlong_buffer, -1 resolved)."""
    b = self.settings.overlong_buffer
    return self.max_new_tokens // 4 if b == -1 else b

  def keep_groups(self, rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Groups whose rewards are not all equal."""
    g = np.asarray(rewards, np.float64).reshape(-1, group_size)
    return g.max(axis=1) > g.min(axis=1)

  def overlong_penalty(self, lengths: np.ndarray) -> np.ndarray:
    """float32 [N] <= 0: the soft overlong punishment of each response length."""
    buffer = self.buffer
    if not buffer:
      return np.zeros(len(lengths), np.float32)
    over = np.asarray(lengths, np.float64) - (self.max_new_tokens - buffer)
    return (-self.settings.overlong_penalty * np.clip(over / buffer, 0.0, 1.0)
            ).astype(np.float32)

  def advantages(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int) -> np.ndarray:
    shaped = np.asarray(rewards, np.float32) + self.overlong_penalty(lengths)
    return group_advantages(shaped, group_size, self.loss.scale_by_std)

  def loss_weights(self, loss_mask: np.ndarray) -> np.ndarray:
    """The token-level mean."""
    return token_mean_weights(loss_mask)

  def step_metrics(self, rewards: np.ndarray, lengths: np.ndarray) -> dict:
    return {"overlong_penalty_mean": float(self.overlong_penalty(lengths).mean())}
