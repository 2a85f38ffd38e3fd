"""An SD strategy: which drafters propose, how deep to draft, how wide to branch, and how many
tokens to verify.

A strategy is plain data: it checks its own shape, and the drafters package checks it against
the drafters it names (`tlt_jax.drafters.check_strategy`: known names, enough candidates to
fill the tree) wherever strategies are made from input (the tuner's arms, the engine).
"""

from __future__ import annotations

import dataclasses

# The drafters a strategy names when it names none: the trained EAGLE drafter alone.
DEFAULT_DRAFTS = ("eagle",)


@dataclasses.dataclass(frozen=True, order=True)
class Strategy:
  """(depth, topk, verify_tokens), as in EAGLE-2, and the drafters whose candidates fill the
  tree (`tlt_jax.drafters`).

  depth: drafting depth; the tree is at most `depth` deep, so at most depth + 1 tokens are
    emitted per iteration (accepted path plus the bonus token).
  topk: branches kept per expansion of a tree-search drafter (children per beam and beams per
    level); a chain drafter (suffix) ignores it.
  verify_tokens: tree size T verified by the policy, root included.
  drafts: the proposing drafters' names, in merge order (e.g. ('eagle',), ('suffix',),
    ('eagle', 'suffix') = hybrid: one tree, their candidates ranked by score).
  """
  depth: int
  topk: int
  verify_tokens: int
  drafts: tuple[str, ...] = DEFAULT_DRAFTS

  def __post_init__(self):
    object.__setattr__(self, "drafts", tuple(self.drafts))
    if self.depth < 1 or self.topk < 1 or self.verify_tokens < 2:
      raise ValueError(f"strategy {self.as_tuple()}: need depth >= 1, topk >= 1, "
                       f"verify_tokens >= 2")
    if not self.drafts or len(set(self.drafts)) != len(self.drafts):
      raise ValueError(f"strategy {self.as_tuple()}: name each proposing drafter once, e.g. "
                       f"'4,2,8,eagle+suffix'")

  @property
  def drafts_name(self) -> str:
    """'eagle', 'suffix', 'eagle+suffix', ...: the drafts as written in a strategy string."""
    return "+".join(self.drafts)

  def as_tuple(self) -> tuple:
    """(depth, topk, verify_tokens), with the drafts' name appended unless they are the
    default (so EAGLE-only strategies read as they always have)."""
    base = (self.depth, self.topk, self.verify_tokens)
    return base if self.drafts == DEFAULT_DRAFTS else (*base, self.drafts_name)

  @classmethod
  def parse(cls, value) -> "Strategy":
    """From a Strategy, a (depth, topk, verify_tokens[, drafts]) sequence, or a
    'depth,topk,verify[,drafts]' str, drafts as 'eagle', 'suffix' or 'eagle+suffix'."""
    if isinstance(value, Strategy):
      return value
    if isinstance(value, str):
      value = [p.strip() for p in value.replace("(", "").replace(")", "").split(",")
               if p.strip()]
    value = tuple(value)
    if len(value) not in (3, 4):
      raise ValueError(f"a strategy is (depth, topk, verify_tokens[, drafts]), got {value!r}")
    drafts = DEFAULT_DRAFTS
    if len(value) == 4:
      d = value[3]
      drafts = tuple(str(d).strip("'\" ").split("+")) if isinstance(d, str) else tuple(d)
    return cls(*map(int, value[:3]), drafts)
