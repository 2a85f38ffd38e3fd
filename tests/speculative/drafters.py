"""Drafters for tests: an exact copy of the policy (oracle) and random ones."""

import jax
import jax.numpy as jnp

from tlt_jax.models.drafter import DrafterConfig, init_drafter_params


def oracle_drafter(cfg, policy_params):
  """A drafter that computes exactly the policy's final-norm hidden state: no feature input,
  an identity fc, the policy's layers, and the policy's final norm."""
  dcfg = DrafterConfig(num_layers=cfg.num_layers, use_features=False, norm_input=True,
                       norm_output=True)
  params = {"fc": {"kernel": jnp.eye(cfg.hidden_size, dtype=cfg.jnp_param_dtype),
                   "bias": jnp.zeros((cfg.hidden_size,), cfg.jnp_param_dtype)},
            "norm": policy_params["norm"]}
  for i in range(cfg.num_layers):
    params[f"layer_{i}"] = jax.tree.map(lambda x: x[i], policy_params["layers"])
  return dcfg, params


def random_drafter(cfg, seed=0, **kw):
  dcfg = DrafterConfig(**kw)
  return dcfg, init_drafter_params(cfg, dcfg, jax.random.key(seed))
