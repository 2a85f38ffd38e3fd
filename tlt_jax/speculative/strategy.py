"""An SD strategy: how deep to draft, how wide to branch, and how many tokens to verify."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
  """(steps, topk, verify_tokens), as in EAGLE-2.

  steps: drafter passes; the tree is at most `steps` deep, so at most steps + 1 tokens are
    emitted per iteration (accepted path plus the bonus token).
  topk: branches kept per expansion (children per beam and beams per level).
  verify_tokens: tree size T verified by the policy, root included.
  """
  steps: int
  topk: int
  verify_tokens: int

  def __post_init__(self):
    if self.steps < 1 or self.topk < 1 or self.verify_tokens < 2:
      raise ValueError(f"strategy {self.as_tuple()}: need steps >= 1, topk >= 1, "
                       f"verify_tokens >= 2")
    if self.verify_tokens - 1 > self.num_candidates:
      raise ValueError(f"strategy {self.as_tuple()}: verify_tokens - 1 = "
                       f"{self.verify_tokens - 1} exceeds the {self.num_candidates} draft "
                       f"candidates that steps={self.steps}, topk={self.topk} produce")

  @property
  def num_candidates(self) -> int:
    """topk children of the root, then topk^2 per further step."""
    return self.topk + (self.steps - 1) * self.topk * self.topk

  def as_tuple(self) -> tuple[int, int, int]:
    return (self.steps, self.topk, self.verify_tokens)

  @classmethod
  def parse(cls, value) -> "Strategy":
    """From a Strategy, a (steps, topk, verify_tokens) sequence, or a 'steps,topk,verify' str."""
    if isinstance(value, Strategy):
      return value
    if isinstance(value, str):
      parts = [p for p in value.replace("(", "").replace(")", "").split(",") if p.strip()]
      value = [int(p) for p in parts]
    value = tuple(value)
    if len(value) != 3:
      raise ValueError(f"a strategy is (steps, topk, verify_tokens), got {value!r}")
    return cls(*map(int, value))
