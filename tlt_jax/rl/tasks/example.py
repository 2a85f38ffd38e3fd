"""The one record type that tasks and dataset loaders produce."""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class Example:
  """One problem.

  Attributes:
    prompt: the question text, without any chat template (the tokenizer's template adds it).
    answer: the final answer as a string ("32", "\\frac{3}{4}"), compared with
      `tlt_jax.rl.answers.answers_match`.
    solution: an optional worked solution ending in the final answer (the SFT target for the
      built-in task, e.g. "7+5=12\\n12*3=36\\n#### 36"); None when the source has none.
    metadata: free-form per-example data (source, number of steps, ids), JSON-serialisable.
  """
  prompt: str
  answer: str
  solution: str | None = None
  metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def json_safe(value: Any) -> bool:
  """Whether `value` can go into an Example's metadata (JSON-serialisable)."""
  try:
    json.dumps(value)
    return True
  except (TypeError, ValueError):
    return False
