"""Rollout: generation from the policy on the mesh.

`engine.RolloutEngine` is the rollout of RL and benchmarks (continuous batching, adaptive SD);
`plain.generate_plain` is a single fully compiled decode loop used for evaluation.
"""

from tlt_jax.rollout.engine import EngineConfig, RolloutEngine, RolloutResult, StepRecord
from tlt_jax.rollout.plain import generate_plain

__all__ = ["EngineConfig", "RolloutEngine", "RolloutResult", "StepRecord", "generate_plain"]
