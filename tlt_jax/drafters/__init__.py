"""Drafters behind one interface (`tlt_jax.drafters.base`), registered by name.

A strategy's `drafts` names the drafters that propose (`Strategy.drafts`); every drafter with
a state keeps it in step whether it proposes or not, so the tuner may switch among EAGLE
alone, suffix alone and their hybrid from one iteration to the next. To add a drafter: write
its module (the interface is in base.py) and register its class in `DRAFTERS`, and, if it
needs weights or options, where `build_drafters` makes it.
"""

from __future__ import annotations

from tlt_jax.drafters.base import Candidates, DraftContext
from tlt_jax.drafters.eagle import EagleDrafter
from tlt_jax.drafters.suffix import SuffixDrafter

# name -> drafter class (each has a static candidate_count(depth, topk)).
DRAFTERS = {"eagle": EagleDrafter, "suffix": SuffixDrafter}

__all__ = ["Candidates", "DraftContext", "EagleDrafter", "SuffixDrafter", "DRAFTERS",
           "build_drafters", "candidate_count", "reads_corpus"]


def candidate_count(name: str, depth: int, topk: int) -> int:
  """How many candidates drafter `name` proposes at (depth, topk); the error lists the
  registered names."""
  if name not in DRAFTERS:
    raise ValueError(f"unknown drafter {name!r} in a strategy; the registered drafters are "
                     f"{sorted(DRAFTERS)} (combine them with '+', e.g. 'eagle+suffix')")
  return DRAFTERS[name].candidate_count(depth, topk)


def reads_corpus(drafts) -> bool:
  """Whether any of the named drafters reads a corpus of other responses."""
  return any(DRAFTERS[name].reads_corpus for name in drafts)


def build_drafters(dcfg=None, dparams=None) -> dict:
  """The drafters an engine or a step can use: EAGLE when given its (DrafterConfig, params),
  and the suffix drafter, which needs nothing."""
  drafters = {"suffix": SuffixDrafter()}
  if dcfg is not None:
    drafters["eagle"] = EagleDrafter(params=dparams, dcfg=dcfg)
  return drafters
