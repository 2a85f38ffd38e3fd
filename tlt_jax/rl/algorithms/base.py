"""What an RL algorithm is to the main loop (tlt_jax.train), and the GRPO one.

An algorithm is a frozen dataclass with four parts, each called at one point of a step:

  rounds        how many rollouts a step may take (1; DAPO's dynamic sampling takes more)
  keep_groups   which groups of a step's samples are worth an update (all; DAPO drops the
                groups whose rewards are all equal, whose advantages would be 0)
  advantages    one float per response from the rewards and response lengths
  loss_fn       the per-(micro-)batch loss the update differentiates, jittable

`loss` holds the clipped-surrogate settings (`GrpoConfig`), which every algorithm here shares.
An algorithm's own knobs are its `Settings` dataclass: the config schema's section `rl.<name>`
is made from its fields and defaults (tlt_jax.config), so adding one is its module and a line
in `tlt_jax.rl.algorithms.ALGORITHMS`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import numpy as np

from tlt_jax.knobs import NoSettings
from tlt_jax.models.config import ModelConfig
from tlt_jax.rl.grpo import GrpoConfig, group_advantages, grpo_loss


@dataclasses.dataclass(frozen=True)
class Grpo:
  """GRPO: one rollout per step, every group trained on, advantages normalised within each
  prompt's group (`group_advantages`), the PPO-clip loss (`grpo_loss`). max_new_tokens: the
  rollout's response budget (for algorithms that shape rewards by length)."""
  Settings: ClassVar[type] = NoSettings
  rounds: ClassVar[int] = 1  # the most rollouts one step may take
  loss: GrpoConfig = GrpoConfig()
  max_new_tokens: int = 256
  settings: object = NoSettings()

  def keep_groups(self, rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [G]: which of the G = len(rewards) / group_size groups the update trains on."""
    return np.ones(len(rewards) // group_size, bool)

  def advantages(self, rewards: np.ndarray, lengths: np.ndarray, group_size: int) -> np.ndarray:
    """float32 [N] from rewards [N] float32 and response lengths [N] int (tokens, EOS
    included); groups are consecutive runs of group_size."""
    del lengths
    return group_advantages(rewards, group_size, self.loss.scale_by_std)

  def loss_fn(self, params: dict, batch: dict, cfg: ModelConfig) -> tuple[jax.Array, dict]:
    """(scalar loss, metrics) of one (micro-)batch with `tlt_jax.rl.grpo`'s keys."""
    return grpo_loss(params, batch, cfg, self.loss)

  def step_metrics(self, rewards: np.ndarray, lengths: np.ndarray) -> dict:
    """Extra metrics.jsonl entries of a step (none for GRPO)."""
    del rewards, lengths
    return {}
