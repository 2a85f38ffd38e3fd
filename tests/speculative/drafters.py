"""Drafters for tests: an exact copy of the policy (oracle) and random ones."""

import jax

from tlt_jax.models.drafter import DrafterConfig, drafter_from_policy, init_drafter_params

oracle_drafter = drafter_from_policy


def random_drafter(cfg, seed=0, **kw):
  dcfg = DrafterConfig(**kw)
  return dcfg, init_drafter_params(cfg, dcfg, jax.random.key(seed))
