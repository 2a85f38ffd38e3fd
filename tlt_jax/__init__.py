"""tlt_jax: reasoning-RL training with adaptive speculative decoding in the rollout (TLT)."""

from tlt_jax import xla_flags as _xla_flags

# Before any backend starts: XLA reads XLA_FLAGS once, when JAX starts its first backend.
_xla_flags.apply()
