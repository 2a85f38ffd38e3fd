"""Rollout: generation from the policy on the mesh.

`engine.RolloutEngine` is the one decode path of RL, evaluation and the jobs (continuous
batching, adaptive SD); benchmarks that time single steps call the pure steps of
`tlt_jax.speculative.decoding` directly.
"""

from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, RolloutResult, StepRecord

__all__ = ["EngineConfig", "RolloutEngine", "RolloutResult", "StepRecord"]
