"""Drafters behind one interface (`tlt_jax.drafters.base`), registered by name.

A strategy's `drafts` names the drafters that propose (`Strategy.drafts`). An engine builds
only the drafters its strategies name, and every one of them with a state keeps it in step
whether it proposes or not, so the tuner may switch among EAGLE alone, suffix alone and their
hybrid from one iteration to the next. Each family's settings dataclass (`Settings`) is its
config section `drafter.<name>`; a trained family's weights are trained, checkpointed and
exported by name.

To add a drafter: write its module (the interface and its defaults are in base.py) and
register its class with `@register_drafter("name")`, in the package or in a module of your
own that the config's `plugins` names (docs/extending.md walks through both).
"""

from __future__ import annotations

from collections.abc import Iterable

from tlt_jax.drafters.base import (DRAFTERS, Candidates, DraftContext, Drafter, TrainedDrafter,
                                   fixed_part, param_count, register_drafter, trainable_part)
# Imported in this order, they register in it (a family's place seeds its fresh weights).
from tlt_jax.drafters.eagle import EagleDrafter
from tlt_jax.drafters.suffix import SuffixDrafter
from tlt_jax.drafters.mtp import MtpDrafter
from tlt_jax.drafters.prompt_lookup import PromptLookupDrafter

__all__ = ["Candidates", "DRAFTERS", "DraftContext", "Drafter", "EagleDrafter", "MtpDrafter",
           "PromptLookupDrafter", "SuffixDrafter", "TrainedDrafter", "candidate_count",
           "check_strategy", "drafter_class", "drafters_named", "fixed_part", "make_drafter",
           "num_candidates", "param_count", "reads_corpus", "register_drafter",
           "trainable_part", "trained_drafters"]


def drafter_class(name: str, where: str = "a strategy") -> type:
  """The registered class of drafter `name`; ValueError (one line, `where` it was named)
  listing the registered names."""
  if name not in DRAFTERS:
    raise ValueError(f"unknown drafter {name!r} in {where}; the registered drafters are "
                     f"{sorted(DRAFTERS)} (combine them with '+', e.g. 'eagle+suffix')")
  return DRAFTERS[name]


def trained_drafters() -> tuple[str, ...]:
  """The names of the registered families that have weights (`TrainedDrafter`), sorted."""
  return tuple(sorted(name for name, cls in DRAFTERS.items() if cls.trained))


def candidate_count(name: str, depth: int, topk: int) -> int:
  """How many candidates drafter `name` proposes at (depth, topk)."""
  return drafter_class(name).candidate_count(depth, topk)


def num_candidates(strategy) -> int:
  """Candidates the drafters a `tlt_jax.speculative.strategy.Strategy` names propose together
  at its (depth, topk); ValueError for a name that is not registered."""
  return sum(candidate_count(name, strategy.depth, strategy.topk) for name in strategy.drafts)


def check_strategy(strategy) -> None:
  """ValueError (one line) unless every drafter `strategy` names is registered and together
  they propose enough candidates to fill its verify_tokens - 1 tree slots."""
  count = num_candidates(strategy)
  if strategy.verify_tokens - 1 > count:
    raise ValueError(f"strategy {strategy.as_tuple()}: verify_tokens - 1 = "
                     f"{strategy.verify_tokens - 1} exceeds the {count} draft candidates that "
                     f"{strategy.drafts_name} drafts at depth={strategy.depth}, "
                     f"topk={strategy.topk}")


def reads_corpus(drafts: Iterable[str]) -> bool:
  """Whether any of the named drafters reads a corpus of other responses."""
  return any(drafter_class(name).reads_corpus for name in drafts)


def drafters_named(strategies) -> tuple[str, ...]:
  """The drafters some of `strategies` (Strategy objects; None = plain decoding) draft with,
  in the order they are first named."""
  return tuple(dict.fromkeys(name for s in strategies if s is not None for name in s.drafts))


def make_drafter(name: str, settings=None, params: dict | None = None) -> Drafter:
  """Drafter `name` with `settings` (its Settings; None: the defaults) and, for a trained
  family, its weights `params`."""
  cls = drafter_class(name)
  given = {}
  if "settings" in cls.__dataclass_fields__:  # a drafter without knobs may have no field
    given["settings"] = cls.Settings() if settings is None else settings
  if cls.trained:
    if params is None:
      raise ValueError(f"drafter {name!r} is trained: give its weights (params)")
    given["params"] = params
  return cls(**given)
