"""Drafters for tests: an exact copy of the policy (oracle), random ones, and the set an
engine or a step may draft with."""

import jax

from tlt_jax.drafters import DRAFTERS, EagleDrafter, MtpDrafter, make_drafter
from tlt_jax.drafters.mtp import MtpSettings
from tlt_jax.models.drafter import DrafterConfig, drafter_from_policy, init_drafter_params

oracle_drafter = drafter_from_policy


def random_drafter(cfg, seed=0, **kw):
  """(DrafterConfig, params) of a random EAGLE drafter."""
  dcfg = DrafterConfig(**kw)
  return dcfg, init_drafter_params(cfg, dcfg, jax.random.key(seed))


def random_mtp(cfg, seed=0, **kw) -> MtpDrafter:
  """MTP heads with random weights everywhere (so their drafts are sometimes right and
  sometimes wrong)."""
  settings = MtpSettings(**kw)
  specs_params = MtpDrafter.init_params(settings, cfg, jax.random.key(seed))
  noisy = jax.tree.map(lambda x, k: x + 0.05 * jax.random.normal(k, x.shape, x.dtype),
                       specs_params, _keys(specs_params, seed))
  return MtpDrafter(params=noisy, settings=settings)


def _keys(tree, seed):
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, list(jax.random.split(jax.random.key(seed + 1000),
                                                          len(leaves))))


def drafter_set(eagle=None, mtp=None) -> dict:
  """name -> drafter: every registered weightless drafter with its default settings, EAGLE
  from `eagle` = (DrafterConfig, params) and the MTP heads `mtp` when given."""
  out = {name: make_drafter(name) for name, cls in DRAFTERS.items() if not cls.trained}
  if eagle is not None:
    out["eagle"] = EagleDrafter(params=eagle[1], settings=eagle[0])
  if mtp is not None:
    out["mtp"] = mtp
  return out
