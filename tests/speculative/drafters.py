"""Drafters for tests: an exact copy of the policy (oracle), random ones, every registered
family's example (`Drafter.example`), and the strategies that exercise each family and every
hybrid of them."""

import itertools

import jax

from tlt_jax.drafters import DRAFTERS, EagleDrafter, MtpDrafter, make_drafter, num_candidates
from tlt_jax.drafters.mtp import MtpSettings
from tlt_jax.drafters.eagle.network import DrafterConfig, drafter_from_policy, init_drafter_params
from tlt_jax.speculative.strategy import Strategy

oracle_drafter = drafter_from_policy


def random_drafter(cfg, seed=0, **kw):
  """(DrafterConfig, params) of a random EAGLE drafter."""
  dcfg = DrafterConfig(**kw)
  return dcfg, init_drafter_params(cfg, dcfg, jax.random.key(seed))


def random_mtp(cfg, seed=0, **kw) -> MtpDrafter:
  """MTP heads with settings `kw` and random weights everywhere (`MtpDrafter.example`)."""
  return MtpDrafter.example(cfg, seed, MtpSettings(**kw))


def example_drafters(cfg, seed=0) -> dict:
  """name -> every registered family's example drafter for a policy of shape `cfg` (trained
  families with random weights, each from its own seed)."""
  return {name: cls.example(cfg, seed + i)
          for i, (name, cls) in enumerate(sorted(DRAFTERS.items()))}


def family_strategy(drafts: str, depth: int, topk: int, verify_tokens: int) -> Strategy:
  """Strategy (depth, topk, verify_tokens) drafting with `drafts` ('a+b'), its tree no larger
  than its drafters can fill (a chain drafter proposes `depth` candidates)."""
  shape = Strategy(depth, topk, 2, tuple(drafts.split("+")))
  return Strategy(depth, topk, min(verify_tokens, num_candidates(shape) + 1), shape.drafts)


def every_family_and_hybrid() -> list[str]:
  """Every registered family alone and every combination of two or more, as a strategy's
  drafts ('eagle', 'eagle+suffix', ...)."""
  names = sorted(DRAFTERS)
  return ["+".join(c) for n in range(1, len(names) + 1) for c in itertools.combinations(names, n)]


def drafter_set(eagle=None) -> dict:
  """name -> drafter: every registered weightless drafter with its default settings, and EAGLE
  from `eagle` = (DrafterConfig, params) when given."""
  out = {name: make_drafter(name) for name, cls in DRAFTERS.items() if not cls.trained}
  if eagle is not None:
    out["eagle"] = EagleDrafter(params=eagle[1], settings=eagle[0])
  return out
